"""The Hugging Face generator's decoding rule on the CPU: sampling values merged with the
model's generation_config as generate does, HF's processors in HF's order, and the stop
and pad tokens."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from transformers.generation.logits_process import (  # noqa: E402
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cudagraphs.errors import (  # noqa: E402
    CudaGraphsTypeError,
    CudaGraphsValueError,
)
from cudagraphs.serving.hf import (  # noqa: E402
    Sampling,
    stop_tokens,
)
from cudagraphs.serving.hf.sampling import check_sampling_generator  # noqa: E402

CPU = torch.device("cpu")


# ---- sampling.py -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, error, text",
    [
        (dict(do_sample=True, temperature=0.0), CudaGraphsValueError, "temperature must be a finite number > 0"),
        (dict(do_sample=True, temperature=-0.5), CudaGraphsValueError, "temperature must be a finite number > 0"),
        (dict(do_sample=True, temperature=float("inf")), CudaGraphsValueError, "finite number > 0, got inf"),
        (dict(do_sample=True, temperature=float("nan")), CudaGraphsValueError, "finite number > 0, got nan"),
        (dict(repetition_penalty=float("inf")), CudaGraphsValueError, "repetition_penalty"),
        (dict(do_sample=True, top_p=float("nan")), CudaGraphsValueError, r"top_p must be in \[0, 1\]"),
        (dict(temperature="1"), CudaGraphsTypeError, "^temperature must be a number.* got str '1'"),
        (dict(do_sample=True, top_p=-0.1), CudaGraphsValueError, r"top_p must be in \[0, 1\]"),
        (dict(do_sample=True, top_p=1.5), CudaGraphsValueError, r"top_p must be in \[0, 1\]"),
        (dict(top_p="0.5"), CudaGraphsTypeError, "^top_p must be a number.* got str '0.5'"),
        (dict(do_sample=True, top_k=-1), CudaGraphsValueError, "top_k must be an int >= 0"),
        (dict(top_k=2.0), CudaGraphsTypeError, "top_k must be an int"),
        (dict(do_sample=1), CudaGraphsTypeError, "do_sample must be a bool"),
        (dict(do_sample="yes"), CudaGraphsTypeError, "do_sample must be a bool"),
    ],
)
def test_bad_sampling_values_are_refused(kw, error, text):
    with pytest.raises(error, match=text):
        Sampling(**kw)


@pytest.mark.parametrize(
    "kw", [dict(temperature=0.0), dict(top_p=1.5), dict(top_k=-1), dict(temperature=-1, top_k=3)]
)
def test_greedy_decoding_ignores_the_warpers_values_as_hf_does(kw):
    # temperature=0 for "greedy" (often in a generation_config): HF's generate runs.
    rule = Sampling(do_sample=False, **kw)
    assert (rule.temperature, rule.top_k, rule.top_p) == (1.0, None, None)
    assert rule.processors() == []


def test_greedy_decoding_still_refuses_values_of_the_wrong_type():
    with pytest.raises(CudaGraphsTypeError, match="top_k must be an int"):
        Sampling(do_sample=False, top_k=2.0)


def test_sampling_counts_are_held_as_ints_hfs_processors_take():
    # HF's top-k warper and minimum-length processors refuse a numpy int mid-request.
    np = pytest.importorskip("numpy")
    rule = Sampling(
        do_sample=True, top_k=np.int64(10), min_length=np.int64(9), min_new_tokens=np.int32(2)
    )
    assert [type(v) for v in (rule.top_k, rule.min_length, rule.min_new_tokens)] == [int] * 3
    eos = torch.tensor([2])
    assert len(rule.processors(prompt_len=4, eos=eos)) == 3  # min length, min new, top-k


def test_sampling_numbers_are_held_as_floats_hfs_warpers_take():
    # HF's warpers refuse an int 2 or a numpy float mid-request: held as floats here.
    np = pytest.importorskip("numpy")
    rule = Sampling(
        do_sample=True, temperature=2, top_p=np.float32(0.5), repetition_penalty=np.int64(2)
    )
    assert [type(v) for v in (rule.temperature, rule.top_p, rule.repetition_penalty)] == [float] * 3
    assert (rule.temperature, rule.top_p, rule.repetition_penalty) == (2.0, 0.5, 2.0)
    assert len(rule.processors()) == 3  # HF's own take them: penalty, temperature, top-p


def test_a_sampling_generator_is_a_torch_generator_of_the_models_device():
    check_sampling_generator(None, CPU)
    check_sampling_generator(torch.Generator(), CPU)
    with pytest.raises(CudaGraphsTypeError, match="generator must be a torch.Generator"):
        check_sampling_generator(123, CPU)
    with pytest.raises(CudaGraphsValueError, match="generator is on cpu, the model on meta"):
        check_sampling_generator(torch.Generator(), torch.device("meta"))


def test_sampling_accepts_the_edges_of_its_ranges():
    rule = Sampling(do_sample=True, temperature=1e-3, top_k=0, top_p=1.0)
    assert (rule.temperature, rule.top_k, rule.top_p) == (1e-3, 0, 1.0)
    # top_p=0 keeps the likeliest token alone, as HF's own warper (which takes it).
    (warper,) = Sampling(do_sample=True, top_p=0.0).processors()
    logits = torch.tensor([[0.5, 2.0, 1.0]])
    kept = warper(torch.zeros(1, 1, dtype=torch.long), logits).isfinite()
    assert kept.tolist() == [[False, True, False]]


def test_greedy_has_no_processors_whatever_the_sampling_values():
    assert len(Sampling(False, temperature=0.5, top_k=10, top_p=0.9).processors()) == 0


def test_sampling_processors_are_hfs_in_hfs_order():
    processors = Sampling(True, temperature=0.5, top_k=10, top_p=0.9).processors()
    assert [type(p) for p in processors] == [
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    ]
    assert processors[0].temperature == 0.5
    assert processors[1].top_k == 10
    assert processors[2].top_p == 0.9


@pytest.mark.parametrize(
    "temperature, top_k, top_p, expected",
    [
        (1.0, None, None, []),
        (1.0, 0, 1.0, []),
        (0.7, 0, None, [TemperatureLogitsWarper]),
        (1.0, 5, 1.0, [TopKLogitsWarper]),
        (1.0, None, 0.5, [TopPLogitsWarper]),
        (2.0, None, 0.5, [TemperatureLogitsWarper, TopPLogitsWarper]),
    ],
)
def test_sampling_skips_values_hf_treats_as_off(temperature, top_k, top_p, expected):
    processors = Sampling(True, temperature, top_k, top_p).processors()
    assert [type(p) for p in processors] == expected


def test_stop_tokens_default_to_the_generation_config():
    stops = stop_tokens(None, None, SimpleNamespace(eos_token_id=5, pad_token_id=9), CPU)
    assert stops.eos.tolist() == [5] and stops.eos.dtype == torch.long
    assert stops.pad == 9 and stops.active


def test_stop_tokens_are_on_the_device_given():
    meta = torch.device("meta")  # stands in for a GPU
    stops = stop_tokens([6, 4], None, None, meta)
    assert stops.eos.device == meta and stops.eos.dtype == torch.long and stops.pad == 6


def test_stop_token_arguments_override_the_generation_config():
    stops = stop_tokens(7, 1, SimpleNamespace(eos_token_id=5, pad_token_id=9), CPU)
    assert stops.eos.tolist() == [7] and stops.pad == 1


def test_stop_tokens_take_a_list_and_pad_falls_back_to_the_first_eos():
    stops = stop_tokens([6, 4], None, SimpleNamespace(eos_token_id=None, pad_token_id=None), CPU)
    assert stops.eos.tolist() == [6, 4] and stops.pad == 6


def test_stop_tokens_list_from_the_generation_config():
    stops = stop_tokens(None, None, SimpleNamespace(eos_token_id=[3, 8], pad_token_id=None), CPU)
    assert stops.eos.tolist() == [3, 8] and stops.pad == 3


@pytest.mark.parametrize("eos", [torch.tensor([3, 4]), torch.tensor(3)])
def test_stop_tokens_accept_a_tensor_of_eos_ids(eos):
    stops = stop_tokens(eos, 0, None, CPU)
    assert stops.eos.tolist() == torch.atleast_1d(eos).tolist() and stops.pad == 0


def test_without_eos_stop_tokens_are_inactive():
    stops = stop_tokens(None, None, None, CPU)
    assert not stops.active and stops.eos.numel() == 0 and stops.pad is None
    assert stops.eos.dtype == torch.long  # token ids, even when there are none
    stops = stop_tokens([], 4, SimpleNamespace(eos_token_id=None, pad_token_id=None), CPU)
    assert not stops.active and stops.pad == 4


@pytest.mark.parametrize(
    "eos, pad, text",
    [
        ("2", None, "eos_token_id must be an int or a list of ints, got str '2'"),
        (2.0, None, "eos_token_id must be an int or a list of ints, got float 2.0"),
        (True, None, "eos_token_id must be an int or a list of ints, got bool True"),
        ([1, "a"], None, r"eos_token_id\[1\] must be an int"),
        (2, "0", "pad_token_id must be an int"),
        (2, 1.5, "pad_token_id must be an int"),
    ],
)
def test_stop_tokens_of_bad_types_are_refused(eos, pad, text):
    with pytest.raises(CudaGraphsTypeError, match=text):
        stop_tokens(eos, pad, None, CPU)


class _Head(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.head = torch.nn.Linear(2, vocab, bias=False)

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize(
    ("eos", "pad", "text"),
    [
        (10, None, r"eos_token_id 10 outside the model's vocabulary \[0, 10\)"),
        ([3, -1], None, r"eos_token_id -1 outside"),
        (3, -1, r"pad_token_id -1 outside"),
        (3, 99, r"pad_token_id 99 outside.*tokenizer.pad_token_id"),
    ],
)
def test_stop_ids_outside_the_vocabulary_are_refused_before_any_step(eos, pad, text):
    with pytest.raises(CudaGraphsValueError, match=text):
        stop_tokens(eos, pad, None, CPU, _Head(10))
    # In range, the same model takes them; a config's vocab_size is read without a head.
    assert stop_tokens(9, 0, None, CPU, _Head(10)).pad == 0
    config_only = SimpleNamespace(config=SimpleNamespace(vocab_size=10))
    with pytest.raises(CudaGraphsValueError, match="outside"):
        stop_tokens(eos, pad, None, CPU, config_only)


@settings(max_examples=200, deadline=None)
# Each setting on its own, where a derived flag that forgot one would show.
@example(False, 1.0, None, None, 1.0, 0, 1)
@example(False, 1.0, None, None, 1.0, 2, 0)
@example(True, 1.0, 5, None, 1.3, 0, 0)
@given(
    do_sample=st.booleans(),
    temperature=st.sampled_from([1.0, 0.7]),
    top_k=st.sampled_from([None, 0, 5]),
    top_p=st.sampled_from([None, 1.0, 0.8]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    # A minimum of 1 holds nothing back for any sequence (both are at least 1 long).
    min_length=st.one_of(st.just(0), st.integers(2, 50)),
    min_new_tokens=st.integers(0, 50),
)
def test_reads_sequences_is_true_exactly_when_the_processors_read_the_tokens(
    do_sample, temperature, top_k, top_p, repetition_penalty, min_length, min_new_tokens
):
    # Reference: the processors' output on the same logits differs between a short
    # sequence holding token 3 and a long one without it, for any setting that reads
    # the tokens so far; the decode loop passes them only where reads_sequences says.
    pytest.importorskip("transformers")
    rule = Sampling(
        do_sample, temperature, top_k, top_p, repetition_penalty, min_length, min_new_tokens
    )
    processors = rule.processors(prompt_len=1, eos=torch.tensor([0]))
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(0)) + 4.0
    logits[0, 0] = 12.0  # the end-of-sequence id on top: no warper hides its masking
    logits[0, 3] = 11.9  # and the repeated token as likely, so its penalty shows
    short = torch.tensor([[3]])
    long = torch.full((1, 60), 7)
    differ = not torch.equal(processors(short, logits.clone()), processors(long, logits.clone()))
    assert rule.reads_sequences == differ


def test_vocab_size_of_reads_the_named_embedding_then_the_config():
    from types import SimpleNamespace

    from cudagraphs.serving.hf.sampling import vocab_size_of

    class Model:
        config = SimpleNamespace(vocab_size=7)

        def get_input_embeddings(self):
            return torch.nn.Embedding(10, 4)

        def get_output_embeddings(self):
            return torch.nn.Linear(4, 12)

    assert vocab_size_of(Model(), "input") == 10
    assert vocab_size_of(Model(), "output") == 12 == vocab_size_of(Model())
    bare = SimpleNamespace(config=SimpleNamespace(vocab_size=7))
    assert vocab_size_of(bare, "input") == 7 == vocab_size_of(bare)
    assert vocab_size_of(SimpleNamespace(config=SimpleNamespace(vocab_size=True))) is None
    assert vocab_size_of(SimpleNamespace()) is None


def test_the_penalty_leaves_out_the_padding_only_where_generate_does(monkeypatch):
    from cudagraphs.serving.hf import sampling

    padding = torch.tensor([0, 2])
    rule = sampling.Sampling(repetition_penalty=1.3)
    monkeypatch.setattr(sampling, "penalty_skips_padding", lambda: True)
    (penalty,) = rule.processors(4, None, padding)
    assert penalty.prompt_ignore_length is padding
    (penalty,) = rule.processors(4, None, None)
    assert penalty.prompt_ignore_length is None
    monkeypatch.setattr(sampling, "penalty_skips_padding", lambda: False)
    (penalty,) = rule.processors(4, None, padding)
    assert penalty.prompt_ignore_length is None


def test_a_minimum_length_of_one_alone_holds_the_end_back():
    from cudagraphs.serving.hf.sampling import Sampling

    (only,) = Sampling(min_length=1).processors(0, torch.tensor([2]))
    assert type(only).__name__ == "MinLengthLogitsProcessor" and only.min_length == 1
