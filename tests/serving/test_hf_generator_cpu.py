"""The GraphedGenerator's constructor, capture, generate paths and helpers on the CPU,
with the eager stand-in for CUDA capture: the arguments it refuses and the errors naming
them; which models check_supported accepts or refuses, naming the model's class; a thin
wrapper around an HF model (no generation_config, no logits_to_keep) served like the
model itself; the prefill computing the last position's logits only; the smallest cache
it accepts; the pad ratio, the required buckets and the graph pool it hands the runner;
what capture says about the cache, its warmups, progress and memory-plan arguments; a
failed capture leaving it refusing requests until capture succeeds; a bfloat16 batch
above the largest bucket; and the end-of-sequence flag read one step late."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.capture import GraphMemoryPool  # noqa: E402
from cudagraphs.errors import (  # noqa: E402
    CudaGraphCaptureError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    UnsupportedModelError,
)
from cudagraphs.serving import Bucket  # noqa: E402
from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator, check_supported  # noqa: E402
from cudagraphs.serving.hf.per_token import EndFlag  # noqa: E402
from helpers.hf_generate import (  # noqa: E402
    EOS,
    PAD,
    PROMPT,
    L,
    captured,
    ended,
    hf_generate,
    hf_keyword,
    prompts,
)

CPU = torch.device("cpu")
NEW = 8
GENERATOR_LOG = "cudagraphs.serving.hf.generator"


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


def generator(model, batch_sizes=(1, 2, 4), **kw):
    kw.setdefault("capture_backend", eager_backend)
    return GraphedGenerator(model, batch_sizes, max_cache_len=kw.pop("max_cache_len", L), **kw)


def failing_once(bucket):
    """A capture backend whose first capture of ``bucket`` fails (as a CUDA capture can),
    every other capture running eagerly."""
    failed = []

    def backend(run, pool, what):
        if what == str(bucket) and not failed:
            failed.append(what)
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_backend(run, pool, what)

    return backend


# ---- constructor: what it refuses, and how it says so -----------------------------------
def test_a_model_that_is_not_a_module_is_refused_naming_the_argument():
    with pytest.raises(CudaGraphsTypeError) as err:
        GraphedGenerator("gpt2", (1, 2), max_cache_len=L, capture_backend=eager_backend)
    message = str(err.value)
    assert (
        message.startswith("model must be a transformers causal LM") and "got str 'gpt2'" in message
    )


class _Bare(nn.Module):
    def forward(self, x):
        return x


def test_a_module_without_a_config_is_refused_naming_its_class():
    with pytest.raises(CudaGraphsTypeError) as err:
        GraphedGenerator(_Bare(), (1, 2), max_cache_len=L, capture_backend=eager_backend)
    message = str(err.value)
    assert "with a config" in message and "got _Bare without one" in message


@pytest.mark.parametrize("length", [1, 0])
def test_a_cache_shorter_than_two_positions_is_refused_naming_max_cache_len(model, length):
    with pytest.raises(CudaGraphsValueError) as err:
        generator(model, max_cache_len=length)
    message = str(err.value)
    assert message.startswith("max_cache_len") and ">= 2" in message and f"got {length}" in message


def test_a_two_position_cache_serves_a_one_token_prompt_and_two_new_tokens(model):
    gen = generator(model, (1, 2), max_cache_len=2)
    gen.capture(progress=False)
    ids = torch.tensor([[7], [11]])
    mask = torch.ones(2, 1, dtype=torch.long)
    ours = gen.generate(ids, mask, max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, 2, eos_token_id=EOS, pad_token_id=PAD)
    assert ours.shape == (2, 3)
    assert torch.equal(ours, ref)
    with pytest.raises(CudaGraphsValueError, match="max_cache_len=2"):
        gen.generate(ids, mask, max_new_tokens=3)


# ---- check_supported ---------------------------------------------------------------------
def test_refused_moe_experts_are_named_with_the_models_class():
    model = tiny("qwen3_moe").eval()
    model.set_experts_implementation("eager")
    with pytest.raises(UnsupportedModelError) as err:
        check_supported(model)
    assert str(err.value).startswith(
        f"{type(model).__name__}'s MoE experts use the 'eager' implementation"
    )


class _GraphSafe(nn.Module):
    """A module marked graph-safe whose config declares nothing else (no
    encoder-decoder flag, no experts implementation) and that has no statefulness mark."""

    _can_compile_fullgraph = True

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace()
        self.experts = nn.Linear(2, 2)  # an MoE-looking child without an implementation


class _Unmarked(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace()


def test_check_supported_refuses_only_what_a_model_declares_or_lacks_the_graph_safe_mark():
    # undeclared: not encoder-decoder, not stateful, no looping experts
    assert check_supported(_GraphSafe()) is None
    # graph-safety must be declared: a module without HF's mark is refused
    with pytest.raises(UnsupportedModelError) as err:
        check_supported(_Unmarked())
    assert str(err.value).startswith("_Unmarked does not support a static cache")


# ---- a wrapper around an HF model ------------------------------------------------------
class _Wrapped(nn.Module):
    """A thin wrapper a user may put around an HF causal LM: its config and graph-safe
    mark, a forward taking the cache (but no logits_to_keep), no generation_config."""

    _can_compile_fullgraph = True

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, use_cache=None, cache=None
    ):
        return self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **{hf_keyword(self.lm): cache},
        )


def test_a_wrapper_without_generation_config_or_logits_to_keep_generates_the_models_tokens(
    model,
):
    gen = captured(_Wrapped(model).eval(), (1, 2, 4))
    ids, mask = prompts(3, seed=7)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)
    # without a generation_config: greedy, and no end-of-sequence id stops a row
    free = gen.generate(ids, mask, max_new_tokens=NEW)
    assert free.shape == (3, PROMPT + NEW)
    assert torch.equal(free[:, :PROMPT], ids)
    assert torch.equal(ended(free[:, PROMPT:], {EOS}, PAD), ref[:, PROMPT:])
    assert gen.stats()["requests"] == {"graphs": 2}


# ---- prefill -------------------------------------------------------------------------------
def test_the_prefill_computes_vocabulary_logits_for_the_last_prompt_position_only(model):
    # as HF's generate (logits_to_keep=1): no [batch, prompt_len, vocab] tensor is made
    gen = captured(model, (1, 2, 4))
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        ids, mask = prompts(3, seed=8)
        ours = gen.generate(ids, mask, max_new_tokens=3, eos_token_id=[])
    finally:
        hook.remove()
    vocab = model.config.vocab_size
    assert shapes[0] == (3, 1, vocab)  # the prefill
    assert shapes[1:] == [(4, 1, vocab)] * 2  # decode steps in bucket 4
    ref = hf_generate(model, ids, mask, 3, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ended(ours[:, PROMPT:], {EOS}, PAD), ref[:, PROMPT:])


# ---- what the runner gets ----------------------------------------------------------------
def test_a_batch_padding_its_bucket_beyond_max_pad_ratio_decodes_eagerly(model):
    gen = generator(model, (1, 8), max_pad_ratio=0.5)
    gen.capture(progress=False)
    ids, mask = prompts(3, seed=9)  # bucket 8 would be 5/8 padding
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])
    stats = gen.stats()
    assert stats["eager_runs"] == {"pad_ratio": NEW - 1}
    assert stats["replays"] == {str(Bucket(8)): 0, str(Bucket(1)): 0}
    one = gen.generate(ids[:1], mask[:1], max_new_tokens=NEW, eos_token_id=[])
    assert gen.stats()["replays"][str(Bucket(1))] == NEW - 1  # an exact bucket replays
    assert torch.equal(one, ours[:1])


def test_required_buckets_make_a_failed_capture_an_error_and_generate_refuses_until_recaptured(
    model,
):
    gen = generator(
        model, (1, 2, 4), require_all_buckets=True, capture_backend=failing_once(Bucket(2))
    )
    with pytest.raises(CudaGraphCaptureError, match=r"bucket\(bs=2\)"):
        gen.capture(progress=False)
    ids, mask = prompts(2, seed=10)
    for new in (1, NEW):
        with pytest.raises(CudaGraphsStateError, match=r"GraphedGenerator\.generate\(\) before"):
            gen.generate(ids, mask, max_new_tokens=new, eos_token_id=EOS, pad_token_id=PAD)
    assert gen.stats()["requests"] == {}
    gen.capture(progress=False)  # the backend captures every bucket now
    assert gen.stats()["captured"] == [str(Bucket(b)) for b in (4, 2, 1)]
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)


def test_buckets_capture_into_the_pool_the_generator_is_given(model):
    pool = GraphMemoryPool()
    seen = []

    def backend(run, given, what):
        seen.append((what, given))
        return eager_backend(run, given, what)

    gen = generator(model, (1, 2), pool=pool, capture_backend=backend)
    gen.capture(warmup=0, progress=False)
    assert [what for what, _ in seen] == [str(Bucket(2)), str(Bucket(1))]
    assert all(given is pool for _, given in seen)
    gen.close()
    gen.capture(warmup=0, progress=False)  # the given pool is kept after close()
    assert len(seen) == 4 and all(given is pool for _, given in seen)


# ---- capture -------------------------------------------------------------------------------
def test_capture_says_the_cache_layers_rows_positions_and_size_at_info(model, caplog):
    positions = 256
    gen = generator(model, (1, 2, 8), max_cache_len=positions)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    # keys and values of each layer: 8 rows x kv heads x positions x head_dim float32
    nbytes = 2 * config.num_hidden_layers * 8 * config.num_key_value_heads * positions
    nbytes *= head_dim * 4
    assert nbytes == 2**20
    with caplog.at_level(logging.INFO, logger=GENERATOR_LOG):
        gen.capture(progress=False)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == GENERATOR_LOG and r.levelno == logging.INFO
    ]
    assert lines == ["GraphedGenerator: static cache of 2 layers x 8 rows x 256 positions: 1.0 MiB"]
    assert gen.layers == config.num_hidden_layers == 2
    assert gen.stats()["cache_bytes"] == nbytes


@pytest.mark.parametrize("warmup, runs", [(3, [3, 1, 1]), (0, [0, 0, 0])])
def test_capture_runs_the_warmup_it_is_given_before_the_first_bucket(model, warmup, runs):
    gen = generator(model, (1, 2, 4))
    gen.capture(warmup=warmup, progress=False)
    seconds = gen.stats()["capture_seconds"]
    assert [seconds[str(Bucket(b))]["warmup_runs"] for b in (4, 2, 1)] == runs


def test_capture_with_progress_shows_a_bar_over_the_buckets(model, capsys):
    pytest.importorskip("tqdm")
    gen = generator(model, (1, 2))
    gen.capture(progress=True)
    err = capsys.readouterr().err
    assert "capturing buckets" in err and "2/2" in err


@pytest.mark.parametrize(
    "kw, text",
    [
        # the CPU has no CUDA memory to measure: a plan is refused, not skipped
        (dict(plan_memory=True), "capture(plan_memory=True) measures CUDA memory"),
        (dict(plan_memory=True, free_bytes=2**30), "off CUDA pass both measure="),
        (dict(free_bytes=-1), "free_bytes must be an int >= 0, got -1"),
        (dict(headroom_bytes=-1), "headroom_bytes must be an int >= 0, got -1"),
    ],
)
def test_capture_hands_its_memory_plan_arguments_to_the_runner(model, kw, text):
    gen = generator(model, (1, 2))
    with pytest.raises(CudaGraphsValueError) as err:
        gen.capture(progress=False, **kw)
    assert text in str(err.value)
    ids, mask = prompts(1, seed=2)
    with pytest.raises(CudaGraphsStateError, match="before capture"):
        gen.generate(ids, mask, max_new_tokens=2)
    gen.capture(progress=False)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))


# ---- a batch above the largest bucket --------------------------------------------------
def test_a_bfloat16_batch_above_the_largest_bucket_has_a_bfloat16_cache_and_equals_hf():
    model = tiny("llama").eval().to(torch.bfloat16)
    gen = captured(model, (1, 2))
    ids, mask = prompts(3, seed=13)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert gen.stats()["requests"] == {"too_large": 1}
    assert gen.kv.keys[0].dtype == torch.bfloat16
    assert torch.equal(ours, ref)


# ---- the end-of-sequence flag --------------------------------------------------------------
def test_the_end_flag_reads_each_recorded_value_once_and_false_when_none_is_pending():
    flag = EndFlag(CPU)
    assert flag.read() is False  # nothing recorded
    flag.record(torch.tensor(True))
    assert flag.read() is True
    assert flag.read() is False  # read already
    flag.record(torch.tensor(False))
    assert flag.read() is False
    flag.record(torch.tensor(True))
    flag.record(torch.tensor(False))
    assert flag.read() is False  # the last recorded value


def test_each_request_starts_with_nothing_pending_on_the_generators_end_flag(model):
    gen = captured(model, (1, 2))
    ids, mask = prompts(2, seed=14)
    free = gen.generate(ids, mask, max_new_tokens=4, eos_token_id=[])
    first = sorted({int(t) for t in free[:, PROMPT]})
    # every row ends at its first token: the flag's last recorded value is "ended"
    out = gen.generate(ids, mask, max_new_tokens=4, eos_token_id=first, pad_token_id=PAD)
    assert torch.equal(out, free[:, : PROMPT + 1])
    flag = gen._end_flag()
    assert flag.read() is False
    assert gen._end_flag() is flag  # one per generator, reused by every request
