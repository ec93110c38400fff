"""The Hugging Face generator on the CPU, with the eager stand-in for CUDA capture: request
checks and HF's position rule, the sampling rule and stop tokens, the shared static
cache, greedy and sampled tokens equal to HF's ``generate`` over a static cache (every
batch size, left padding, EOS, batches above the largest bucket, MoE experts), the
models it refuses, and the runner's per-bucket warmup counts, capture times, progress
and the collector paused while it captures."""

import gc
import inspect
import io
import logging
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from _hf_models import tiny

transformers = pytest.importorskip("transformers")

from transformers import StaticCache  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cudagraphs.capture import gc_paused  # noqa: E402
from cudagraphs.errors import (  # noqa: E402
    CudaGraphInputError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    Mismatch,
    UnsupportedModelError,
)
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec  # noqa: E402
from cudagraphs.serving.buckets import warmup_runs  # noqa: E402
from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import (  # noqa: E402
    GraphedGenerator,
    LayerShape,
    Sampling,
    SharedStaticCache,
    check_request,
    positions_from_mask,
    stop_tokens,
)
from cudagraphs.serving.hf.cache import cache_keyword, layer_shapes  # noqa: E402
from cudagraphs.serving.hf.sampling import sampling_rule  # noqa: E402
from cudagraphs.serving.runner import progress_bar  # noqa: E402

CPU = torch.device("cpu")
L = 24  # max_cache_len of every generator here
PROMPT = 6
NEW = 10
EOS, PAD = 2, 0  # tiny llama's generation_config eos is 2; passed explicitly to both sides
GENERATOR_LOG = "cudagraphs.serving.hf.generator"
RUNNER_LOG = "cudagraphs.serving.runner"


# ---- helpers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


def prompts(batch, prompt_len=PROMPT, seed=0):
    """Left-padded prompts: row r has r % 3 padding tokens (id 0) before real ids >= 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, prompt_len), generator=g)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    for r in range(batch):
        mask[r, : r % 3] = 0
        ids[r, : r % 3] = 0
    return ids, mask


def hf_keyword(model):
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_generate(model, ids, mask, max_new_tokens, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        disable_compile=True,
        **{hf_keyword(model): StaticCache(config=model.config, max_cache_len=L)},
        **kw,
    )


def captured(model, batch_sizes=(1, 2, 4, 8), **kw):
    gen = GraphedGenerator(model, batch_sizes, max_cache_len=L, capture_backend=eager_backend, **kw)
    gen.capture(progress=False)
    return gen


def ended(free, eos, pad):
    """What ``free`` (new tokens made without EOS) becomes with EOS ids ``eos``: a row's
    tokens after its first EOS are ``pad``; the output ends when every row has ended."""
    out = free.clone()
    lengths = []
    for r in range(free.shape[0]):
        hits = [t for t in range(free.shape[1]) if int(free[r, t]) in eos]
        if hits:
            out[r, hits[0] + 1 :] = pad
            lengths.append(hits[0] + 1)
        else:
            lengths.append(free.shape[1])
    return out[:, : max(lengths)]


# ---- requests.py -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask, expected",
    [
        ([[1, 1, 1]], [[0, 1, 2]]),
        ([[0, 0, 1, 1]], [[0, 0, 0, 1]]),
        ([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], [[0, 0, 1, 2], [0, 1, 2, 3], [0, 0, 0, 0]]),
        ([0, 1, 1], [0, 0, 1]),  # one row, unbatched: the count runs along the last dim
    ],
)
def test_positions_from_mask_follow_hf_rule(mask, expected):
    mask = torch.tensor(mask)
    hf_rule = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    assert torch.equal(positions_from_mask(mask), torch.tensor(expected))
    assert torch.equal(positions_from_mask(mask), hf_rule)
    assert torch.equal(positions_from_mask(mask.bool()), hf_rule)


def test_valid_request_without_mask_gets_an_all_true_bool_mask():
    ids = torch.arange(3, 15, dtype=torch.int32).reshape(2, 6)
    request = check_request(ids, None, 4, 16, CPU)
    assert request.attention_mask.dtype == torch.bool
    assert request.attention_mask.shape == (2, 6)
    assert bool(request.attention_mask.all())
    assert request.input_ids.dtype == torch.long
    assert torch.equal(request.input_ids, ids.long())
    assert (request.batch, request.prompt_len, request.max_new_tokens) == (2, 6, 4)


@pytest.mark.parametrize("with_mask", [True, False])
def test_request_is_moved_to_the_device_given(with_mask):
    # the meta device stands in for a GPU: ids and mask both go to the device given
    ids, mask = prompts(3)
    meta = torch.device("meta")
    request = check_request(ids, mask if with_mask else None, 2, 16, meta)
    assert request.input_ids.device == meta and request.input_ids.dtype == torch.long
    assert request.attention_mask.device == meta and request.attention_mask.dtype == torch.bool


def test_a_missing_mask_is_made_on_the_device_given_not_the_default_device():
    ids = torch.ones(2, 3, dtype=torch.long)
    with torch.device("meta"):  # torch's default device for new tensors
        request = check_request(ids, None, 2, 16, CPU)
    assert request.attention_mask.device == CPU
    assert bool(request.attention_mask.all())


def test_valid_mask_becomes_bool_with_the_same_pattern():
    ids, mask = prompts(3)
    request = check_request(ids, mask, 2, 16, CPU)
    assert request.attention_mask.dtype == torch.bool
    assert torch.equal(request.attention_mask, mask.bool())


def test_positions_needed_is_prompt_plus_new_minus_one():
    request = check_request(torch.ones(2, 5, dtype=torch.long), None, 7, 64, CPU)
    assert request.positions_needed == 5 + 7 - 1


def test_request_filling_the_cache_exactly_is_accepted():
    request = check_request(torch.ones(1, 5, dtype=torch.long), None, 4, 8, CPU)
    assert request.positions_needed == 8


def test_request_longer_than_the_cache_names_positions_and_max_cache_len():
    with pytest.raises(CudaGraphsValueError, match="needs 9 cache positions") as err:
        check_request(torch.ones(1, 5, dtype=torch.long), None, 5, 8, CPU)
    assert "max_cache_len=8" in str(err.value)
    assert "max_cache_len >= 9" in str(err.value)


@pytest.mark.parametrize(
    "ids, kind", [([[1, 2, 3]], "list"), ((1, 2), "tuple"), (None, "NoneType")]
)
def test_non_tensor_ids_are_a_type_error(ids, kind):
    with pytest.raises(CudaGraphsTypeError, match="input_ids must be a torch.Tensor") as err:
        check_request(ids, None, 2, 16, CPU)
    assert f"got {kind};" in str(err.value)
    assert "return_tensors='pt'" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_ids_are_a_type_error(dtype):
    with pytest.raises(CudaGraphsTypeError, match="integer token ids"):
        check_request(torch.ones(1, 3, dtype=dtype), None, 2, 16, CPU)


def test_one_dimensional_ids_suggest_unsqueeze():
    with pytest.raises(CudaGraphsValueError, match=r"unsqueeze\(0\)") as err:
        check_request(torch.ones(4, dtype=torch.long), None, 2, 16, CPU)
    assert "got shape (4,) (one prompt: input_ids.unsqueeze(0))" in str(err.value)


def test_three_dimensional_ids_are_refused_without_the_unsqueeze_hint():
    with pytest.raises(CudaGraphsValueError, match="must be 2-D") as err:
        check_request(torch.ones(1, 2, 3, dtype=torch.long), None, 2, 16, CPU)
    assert "unsqueeze" not in str(err.value)
    assert str(err.value).endswith("got shape (1, 2, 3)")  # the shape received, no hint


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_empty_ids_are_refused(shape):
    with pytest.raises(CudaGraphsValueError, match="empty"):
        check_request(torch.ones(shape, dtype=torch.long), None, 2, 16, CPU)


def test_mask_of_another_shape_is_an_input_error_with_one_mismatch():
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(CudaGraphInputError, match="attention_mask") as err:
        check_request(ids, torch.ones(2, 4, dtype=torch.long), 2, 16, CPU)
    assert err.value.mismatches == [Mismatch("attention_mask", "shape", (2, 3), (2, 4))]
    assert "attention_mask: shape expected (2, 3), received (2, 4)" in str(err.value)
    assert "attention_mask does not match input_ids" in str(err.value)
    assert "Pass the mask the tokenizer returned with these ids" in str(err.value)


def test_mask_that_is_not_a_tensor_is_a_type_error():
    with pytest.raises(CudaGraphsTypeError, match="attention_mask must be a torch.Tensor") as err:
        check_request(torch.ones(1, 3, dtype=torch.long), [[1, 1, 1]], 2, 16, CPU)
    assert str(err.value).endswith("got list")


def test_mask_values_other_than_zero_and_one_are_refused():
    mask = torch.tensor([[1, 2, 1]])
    with pytest.raises(CudaGraphInputError, match="values other than 0 and 1"):
        check_request(torch.ones(1, 3, dtype=torch.long), mask, 2, 16, CPU)


def test_a_row_without_real_tokens_is_named():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(CudaGraphInputError, match=r"rows \[1\] have no real token"):
        check_request(torch.ones(2, 3, dtype=torch.long), mask, 2, 16, CPU)


@pytest.mark.parametrize("bad_row", [[1, 1, 0], [1, 0, 1], [0, 1, 0]])
def test_right_padding_or_holes_name_the_row_and_padding_side(bad_row):
    mask = torch.tensor([[0, 1, 1], bad_row])
    with pytest.raises(CudaGraphInputError, match=r"rows \[1\] have padding after") as err:
        check_request(torch.ones(2, 3, dtype=torch.long), mask, 2, 16, CPU)
    assert "padding_side = 'left'" in str(err.value)
    assert str(err.value).endswith(
        "the static cache needs left padding: tokenizer.padding_side = 'left'"
    )


def test_every_mask_problem_is_said_at_once():
    mask = torch.tensor([[0, 0, 0], [1, 1, 0], [0, 1, 1]])
    with pytest.raises(CudaGraphInputError) as err:
        check_request(torch.ones(3, 3, dtype=torch.long), mask, 2, 16, CPU)
    assert "rows [0] have no real token" in str(err.value)
    assert "rows [1] have padding after" in str(err.value)
    # all three kinds, one clause each after the headline, in the order they are checked
    mask = torch.tensor([[0, 0, 0], [1, 2, 0], [0, 1, 1]])
    with pytest.raises(CudaGraphInputError) as err:
        check_request(torch.ones(3, 3, dtype=torch.long), mask, 2, 16, CPU)
    assert (
        "0/1 mask: it holds values other than 0 and 1; rows [0] have no real token; "
        "rows [1] have padding after"
    ) in str(err.value)


def test_zero_new_tokens_is_a_value_error():
    with pytest.raises(CudaGraphsValueError, match="max_new_tokens must be an int >= 1"):
        check_request(torch.ones(1, 3, dtype=torch.long), None, 0, 16, CPU)


@pytest.mark.parametrize("new", [2.0, "2", True, None])
def test_non_int_new_tokens_is_a_type_error(new):
    with pytest.raises(CudaGraphsTypeError, match="max_new_tokens must be an int"):
        check_request(torch.ones(1, 3, dtype=torch.long), None, new, 16, CPU)


# ---- sampling.py -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, error, text",
    [
        (dict(temperature=0.0), CudaGraphsValueError, "temperature must be > 0"),
        (dict(temperature=-0.5), CudaGraphsValueError, "temperature must be > 0"),
        (dict(temperature="1"), CudaGraphsTypeError, "^temperature must be a number.* got str '1'"),
        (dict(top_p=0.0), CudaGraphsValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), CudaGraphsValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p="0.5"), CudaGraphsTypeError, "^top_p must be a number.* got str '0.5'"),
        (dict(top_k=-1), CudaGraphsValueError, "top_k must be an int >= 0"),
        (dict(top_k=2.0), CudaGraphsTypeError, "top_k must be an int"),
        (dict(do_sample=1), CudaGraphsTypeError, "do_sample must be a bool"),
        (dict(do_sample="yes"), CudaGraphsTypeError, "do_sample must be a bool"),
    ],
)
def test_bad_sampling_values_are_refused(kw, error, text):
    with pytest.raises(error, match=text):
        Sampling(**kw)


def test_sampling_accepts_the_edges_of_its_ranges():
    rule = Sampling(do_sample=True, temperature=1e-3, top_k=0, top_p=1.0)
    assert (rule.temperature, rule.top_k, rule.top_p) == (1e-3, 0, 1.0)


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


# ---- cache.py --------------------------------------------------------------------------
class TakesCache(nn.Module):
    def forward(self, input_ids, cache=None, use_cache=True):
        return input_ids


class TakesPastKeyValues(nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=True):
        return input_ids


class TakesBoth(nn.Module):
    def forward(self, input_ids, past_key_values=None, cache=None):
        return input_ids


class TakesNoCache(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids


@pytest.mark.parametrize(
    "module, expected",
    [(TakesCache, "cache"), (TakesPastKeyValues, "past_key_values"), (TakesBoth, "cache")],
)
def test_cache_keyword_follows_the_forward_signature(module, expected):
    assert cache_keyword(module()) == expected


def test_cache_keyword_refuses_a_forward_without_a_cache():
    with pytest.raises(UnsupportedModelError, match="TakesNoCache.forward takes no cache"):
        cache_keyword(TakesNoCache())


def test_cache_keyword_of_the_installed_transformers(model):
    assert cache_keyword(model) == hf_keyword(model)


def test_layer_shapes_read_heads_and_widths(model):
    shapes = layer_shapes(model, cache_keyword(model))
    # tiny llama: 2 layers, 2 KV heads of 64 / 4 = 16
    assert shapes == [LayerShape(2, 16, 16, torch.float32)] * 2


@pytest.fixture
def kv(model):
    return SharedStaticCache(model, layer_shapes(model, cache_keyword(model)), 4, 16, CPU)


def test_shared_cache_nbytes(kv):
    assert kv.nbytes == 2 * 2 * (4 * 2 * 16 * 16) * 4  # layers x (k, v) x elements x fp32
    assert kv.nbytes == sum(t.numel() * t.element_size() for t in kv.keys + kv.values)


def test_cache_for_the_same_rows_is_the_same_object(kv):
    assert kv.cache_for(2) is kv.cache_for(2)
    assert kv.cache_for(2) is not kv.cache_for(4)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_cache_for_rows_binds_the_leading_rows_of_the_storage(kv, rows):
    cache = kv.cache_for(rows)
    assert len(cache.layers) == 2
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape == (rows, 2, 16, 16)
        assert layer.keys.data_ptr() == kv.keys[i][:rows].data_ptr()
        assert layer.values.data_ptr() == kv.values[i][:rows].data_ptr()
        assert layer.cumulative_length is kv.counters[i]


def test_caches_of_all_row_counts_share_the_write_counters(model, kv):
    small, large = kv.cache_for(2), kv.cache_for(4)
    with torch.no_grad():
        model(
            input_ids=torch.randint(3, 128, (2, 3)),
            use_cache=True,
            **{cache_keyword(model): small},
        )
    assert [int(c) for c in kv.counters] == [3, 3]
    for i, layer in enumerate(large.layers):
        assert int(layer.cumulative_length) == 3
        # the prefill wrote rows 0-1, positions 0-2 of the shared storage only
        assert bool(kv.keys[i][:2, :, :3].ne(0).any())
        assert not bool(kv.keys[i][2:].ne(0).any())
        assert not bool(kv.keys[i][:, :, 3:].ne(0).any())
    kv.reset()
    assert [int(c) for c in kv.counters] == [0, 0]
    assert all(int(layer.cumulative_length) == 0 for layer in small.layers)


@pytest.mark.parametrize("rows", [0, 5, -1])
def test_cache_for_rows_outside_the_storage_is_refused(kv, rows):
    with pytest.raises(CudaGraphsValueError, match=f"a cache of {rows} rows"):
        kv.cache_for(rows)


def test_shared_cache_needs_a_layer(model):
    with pytest.raises(CudaGraphsValueError, match="at least one layer"):
        SharedStaticCache(model, [], 4, 16, CPU)


# ---- generator.py: tokens equal HF's ----------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_tokens_equal_hf_static_cache_generate(model, batch):
    gen = captured(model)
    ids, mask = prompts(batch, seed=batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert ours.dtype == torch.long and ours.shape == ref.shape
    assert torch.equal(ours, ref)
    assert torch.equal(ours[:, :PROMPT], ids)


def test_request_filling_the_cache_exactly_equals_hf(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(2, seed=11)
    new = L - PROMPT + 1  # the last token is returned, never written
    ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, new, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)
    free = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=[])
    assert free.shape == (2, L + 1)


def test_batch_above_the_largest_bucket_equals_hf_and_is_counted_and_said_once(model, caplog):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(6, seed=6)
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert gen.stats()["requests"] == {"too_large": 1}
        again = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref) and torch.equal(again, ref)
    stats = gen.stats()
    assert stats["requests"] == {"too_large": 2}
    assert sum(stats["replays"].values()) == 0 and stats["eager_runs"] == {}
    warnings = [
        r
        for r in caplog.records
        if r.name.startswith("cudagraphs") and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1
    assert warnings[0].name == GENERATOR_LOG
    assert "a batch of 6 is larger than the largest bucket (4)" in warnings[0].getMessage()


def test_rows_after_their_eos_are_pad_and_equal_hf(model):
    gen = captured(model)
    ids, mask = prompts(3, seed=3)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    assert free.shape == (3, NEW)
    # an EOS that row 0 makes first at a middle step
    step = next(t for t in range(2, NEW - 2) if int(free[0, t]) not in free[0, :t].tolist())
    eos = int(free[0, step])
    pad = 1 if eos != 1 else 0
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad)
    expected = ended(free, {eos}, pad)
    assert torch.equal(ours[:, PROMPT:], expected)
    assert ours.shape == (3, PROMPT + NEW)  # rows 1 and 2 never make this EOS
    assert int(ours[0, PROMPT + step]) == eos
    assert bool((ours[0, PROMPT + step + 1 :] == pad).all())
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(ours, ref)


def test_output_is_shorter_when_every_row_ends_early(model):
    gen = captured(model)
    ids, mask = prompts(3, seed=4)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    eos = sorted({int(free[r, 1]) for r in range(3)})  # every row ends by its 2nd token
    pad = next(p for p in range(128) if p not in eos)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad)
    expected = ended(free, set(eos), pad)
    assert expected.shape[1] <= 2
    assert torch.equal(ours[:, PROMPT:], expected)
    assert gen.stats()["tokens"] == 3 * NEW + 3 * expected.shape[1]
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("after", [1, 0])
def test_eos_at_one_of_the_last_two_steps(model, after):
    # an EOS made at step s of max_new_tokens = s + 1 + after: with one step left the
    # request ends one token early; at the last step nothing changes
    gen = captured(model, (1, 2))
    ids, mask = prompts(1, seed=12)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    step = next(t for t in range(3, NEW) if int(free[0, t]) not in free[0, :t].tolist())
    eos, new = int(free[0, step]), step + 1 + after
    ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours[:, PROMPT:], free[:, : step + 1])
    ref = hf_generate(model, ids, mask, new, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours, ref)


def test_a_row_ending_one_step_before_the_last_gets_pad(model):
    gen = captured(model, (1, 2))
    ids, mask = prompts(2, seed=10)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    step = next(t for t in range(3, NEW) if int(free[0, t]) not in free[0, :t].tolist())
    eos, new = int(free[0, step]), step + 2
    assert eos not in free[1, :new].tolist()  # row 1 runs to the end
    ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=PAD)
    assert ours.shape == (2, PROMPT + new)
    assert torch.equal(ours[1, PROMPT:], free[1, :new])
    assert ours[0, PROMPT:].tolist() == free[0, : step + 1].tolist() + [PAD]
    ref = hf_generate(model, ids, mask, new, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours, ref)


def test_stop_tokens_default_to_the_models_generation_config():
    model = tiny("llama").eval()
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(2, seed=5)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    model.generation_config.eos_token_id = int(free[0, 3])
    model.generation_config.pad_token_id = 1 if int(free[0, 3]) != 1 else 0
    by_default = gen.generate(ids, mask, max_new_tokens=NEW)
    explicit = gen.generate(
        ids,
        mask,
        max_new_tokens=NEW,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    assert torch.equal(by_default, explicit)
    expected = ended(
        free, {model.generation_config.eos_token_id}, model.generation_config.pad_token_id
    )
    assert torch.equal(by_default[:, PROMPT:], expected)
    assert not torch.equal(expected, free[:, : expected.shape[1]])  # the EOS changed something


def test_sampling_with_a_seeded_generator_repeats_and_other_seeds_differ(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=7)

    def sample(seed):
        return gen.generate(
            ids,
            mask,
            max_new_tokens=NEW,
            do_sample=True,
            temperature=0.8,
            eos_token_id=[],
            generator=torch.Generator().manual_seed(seed),
        )

    first, second, other = sample(1), sample(1), sample(2)
    assert first.shape == (3, PROMPT + NEW)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)
    assert bool(((first[:, PROMPT:] >= 0) & (first[:, PROMPT:] < 128)).all())


def test_sampling_with_a_generator_leaves_the_global_rng_alone(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(2, seed=8)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    gen.generate(
        ids, mask, max_new_tokens=4, do_sample=True, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(torch.rand(4), expected)


def test_sampling_from_the_global_rng_equals_hf_sampling(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(4, seed=9)
    rule = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(5)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    torch.manual_seed(5)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    assert torch.equal(ours, ref)


def test_a_request_that_ends_early_draws_no_more_random_numbers_than_hf(model):
    # Whether every sequence has ended is read one step late (the next step is already
    # queued); the request must still stop before sampling that step, as HF does, or
    # the next request from the same RNG would draw different tokens.
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=10)
    rule = dict(do_sample=True, temperature=1.5)
    many = list(range(3, 100))  # most of the vocabulary ends a sequence: all end early
    torch.manual_seed(6)
    ours_a = gen.generate(
        ids, mask, max_new_tokens=NEW, eos_token_id=many, pad_token_id=PAD, **rule
    )
    ours_b = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    torch.manual_seed(6)
    ref_a = hf_generate(model, ids, mask, NEW, eos_token_id=many, pad_token_id=PAD, **rule)
    ref_b = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    assert ours_a.shape[1] < PROMPT + NEW, "the first request should end early"
    assert torch.equal(ours_a, ref_a)
    assert torch.equal(ours_b, ref_b)


def test_no_state_leaks_between_requests(model):
    gen = captured(model, (1, 2, 4))
    ids_a, mask_a = prompts(2, prompt_len=4, seed=21)
    ids_b, mask_b = prompts(3, prompt_len=9, seed=22)  # longer: writes past A's positions
    stops = dict(eos_token_id=EOS, pad_token_id=PAD)
    first = gen.generate(ids_a, mask_a, max_new_tokens=NEW, **stops)
    other = gen.generate(ids_b, mask_b, max_new_tokens=12, **stops)
    again = gen.generate(ids_a, mask_a, max_new_tokens=NEW, **stops)
    assert torch.equal(first, again)
    assert torch.equal(first, hf_generate(model, ids_a, mask_a, NEW, **stops))
    assert torch.equal(other, hf_generate(model, ids_b, mask_b, 12, **stops))


def test_generate_before_capture_and_after_close_is_a_state_error(model):
    gen = GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=eager_backend)
    ids, mask = prompts(2, seed=1)
    with pytest.raises(CudaGraphsStateError, match="before capture"):
        gen.generate(ids, mask, max_new_tokens=3)
    gen.capture(progress=False)
    tokens = gen.generate(ids, mask, max_new_tokens=3, eos_token_id=[])
    gen.close()
    gen.close()  # idempotent
    assert gen.kv is None and gen.stats()["cache_bytes"] == 0
    with pytest.raises(CudaGraphsStateError, match="after close"):
        gen.generate(ids, mask, max_new_tokens=3)
    gen.capture(progress=False)
    assert torch.equal(gen.generate(ids, mask, max_new_tokens=3, eos_token_id=[]), tokens)


def test_a_bad_request_runs_nothing_and_counts_nothing(model):
    gen = captured(model, (1, 2))
    ids, mask = prompts(2, seed=1)
    with pytest.raises(CudaGraphsValueError, match="max_cache_len=24"):
        gen.generate(ids, mask, max_new_tokens=L)
    with pytest.raises(CudaGraphsValueError, match="temperature"):
        gen.generate(ids, mask, max_new_tokens=2, do_sample=True, temperature=0.0)
    stats = gen.stats()
    assert stats["requests"] == {} and stats["tokens"] == 0
    assert sum(stats["replays"].values()) == 0


def test_stats_count_requests_tokens_cache_bytes_and_runner_keys(model):
    gen = GraphedGenerator(model, (1, 2, 4), max_cache_len=L, capture_backend=eager_backend)
    assert gen.stats()["cache_bytes"] == 0 and gen.stats()["tokens"] == 0
    gen.capture(progress=False)
    gen.generate(*prompts(2, seed=1), max_new_tokens=5, eos_token_id=[])
    gen.generate(*prompts(4, seed=2), max_new_tokens=4, eos_token_id=[])  # the largest
    stats = gen.stats()
    assert stats["requests"] == {"graphs": 2}
    assert stats["tokens"] == 2 * 5 + 4 * 4
    assert stats["cache_bytes"] == gen.kv.nbytes == 2 * 2 * (4 * 2 * L * 16) * 4
    assert stats["captured"] == [str(Bucket(b)) for b in (4, 2, 1)]
    # the first token comes from the prefill: max_new_tokens - 1 decode steps
    assert stats["replays"] == {str(Bucket(4)): 3, str(Bucket(2)): 4, str(Bucket(1)): 0}
    assert stats["eager_runs"] == {} and stats["dropped"] == {}
    assert {b: t["warmup_runs"] for b, t in stats["capture_seconds"].items()} == {
        str(Bucket(4)): 2,
        str(Bucket(2)): 1,
        str(Bucket(1)): 1,
    }


def test_padding_rows_of_a_bucket_attend_everywhere_and_stay_finite(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=1)
    gen.generate(ids, mask, max_new_tokens=4, eos_token_id=[])
    staged = gen.runner.static.views(Bucket(4))
    assert bool(staged["attention_mask"][3].all())  # the padding row: every position
    assert staged["attention_mask"][:3, PROMPT + 3 :].sum() == 0  # real rows: not yet
    logits = gen.runner.graphs[Bucket(4)].slots[0].output
    assert logits.shape == (4, 128) and bool(torch.isfinite(logits).all())


# ---- generator.py: models it refuses, MoE -----------------------------------------------
def _encoder_decoder(model):
    model.config.is_encoder_decoder = True


def _stateful(model):
    model._is_stateful = True


def _not_graph_safe(model):
    model._can_compile_fullgraph = False


@pytest.mark.parametrize(
    "change, text",
    [
        (_encoder_decoder, "is an encoder-decoder model"),
        (_stateful, "keeps recurrent state outside a KV cache"),
        (_not_graph_safe, "_can_compile_fullgraph=False"),
    ],
)
def test_models_without_a_static_decode_step_are_refused(change, text):
    model = tiny("llama").eval()
    change(model)
    with pytest.raises(UnsupportedModelError, match=text):
        GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=eager_backend)


@pytest.fixture(scope="module")
def moe():
    model = tiny("qwen3_moe").eval()
    model.set_experts_implementation("grouped_mm")
    try:
        with torch.no_grad():
            model(input_ids=torch.ones(2, 3, dtype=torch.long))
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"grouped_mm experts cannot run on this CPU torch build: {exc}")
    return model


def test_moe_with_looping_experts_is_refused_naming_grouped_mm():
    model = tiny("qwen3_moe").eval()
    model.set_experts_implementation("eager")
    with pytest.raises(UnsupportedModelError, match="'eager' implementation") as err:
        GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=eager_backend)
    assert "set_experts_implementation('grouped_mm')" in str(err.value)


@pytest.mark.parametrize("batch", [3, 4])
def test_moe_with_grouped_mm_experts_equals_hf(moe, batch):
    gen = captured(moe, (1, 2, 4))
    ids, mask = prompts(batch, seed=30 + batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(moe, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)


# ---- runner: warmup runs, progress, capture times ----------------------------------------
@pytest.mark.parametrize(
    "index, warmup, compiled, expected",
    [
        (0, 2, False, 2),
        (1, 2, False, 1),
        (5, 3, False, 1),
        (3, 0, False, 0),
        (0, 0, False, 0),
        (1, 1, False, 1),
        (0, 3, True, 3),
        (4, 3, True, 3),
    ],
)
def test_warmup_runs_full_for_the_first_bucket_one_for_later_ones(
    index, warmup, compiled, expected
):
    assert warmup_runs(index, warmup, compiled) == expected


@pytest.mark.parametrize("progress, total", [(False, 3), (True, 0), (None, 0), (False, 0)])
def test_no_progress_bar_when_off_or_nothing_to_do(progress, total):
    assert progress_bar(progress, total, "capturing buckets") is None


def test_progress_bar_counts_buckets():
    pytest.importorskip("tqdm")
    bar = progress_bar(True, 3, "capturing buckets")
    try:
        assert (bar.total, bar.desc, bar.unit, bar.disable) == (
            3,
            "capturing buckets",
            "bucket",
            False,
        )
    finally:
        bar.close()


def test_default_progress_bar_is_off_without_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress_bar(None, 3, "capturing buckets")
    try:
        assert bar.disable is True
    finally:
        bar.close()


HIDDEN = 4


def counting_runner(calls, backend=eager_backend, **kw):
    def forward(x):
        calls.append(x.shape[0])
        return x * 2.0 + 1.0

    return GraphRunner(
        forward,
        [InputSpec("x", (4, HIDDEN), torch.float32)],
        BucketConfig(batch_sizes=(1, 2, 4)),
        device="cpu",
        capture_backend=backend,
        **kw,
    )


def dummy(bucket):
    return {"x": torch.zeros(bucket.rows, HIDDEN)}


@pytest.mark.parametrize(
    "warmup, runs, calls",
    [
        (2, [2, 1, 1], [4, 4, 4, 2, 2, 1, 1]),  # warmups, then one run at capture
        (3, [3, 1, 1], [4, 4, 4, 4, 2, 2, 1, 1]),
        (0, [0, 0, 0], [4, 2, 1]),
    ],
)
def test_only_the_first_bucket_gets_the_full_warmup(warmup, runs, calls):
    seen = []
    runner = counting_runner(seen)
    runner.capture(dummy, warmup, progress=False)
    assert seen == calls
    seconds = runner.stats()["capture_seconds"]
    assert list(seconds) == [str(Bucket(b)) for b in (4, 2, 1)]
    assert [seconds[str(Bucket(b))]["warmup_runs"] for b in (4, 2, 1)] == runs
    for entry in seconds.values():
        assert entry["warmup"] >= 0.0 and entry["capture"] > 0.0


def test_capture_says_each_bucket_at_info(caplog):
    runner = counting_runner([])
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
        runner.capture(dummy, 2, progress=False)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == RUNNER_LOG and r.levelno == logging.INFO and "captured" in r.getMessage()
    ]
    assert len(lines) == 3
    for line, (b, n) in zip(lines, [(4, 1), (2, 2), (1, 3)]):
        assert f"captured {Bucket(b)} ({n}/3)" in line
        assert "warmup" in line and "capture" in line


def test_a_dropped_bucket_has_no_capture_time_nor_info_line(caplog):
    def backend(run, pool, what):
        if what == str(Bucket(2)):
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_backend(run, pool, what)

    runner = counting_runner([], backend=backend, require_all_buckets=False)
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
        runner.capture(dummy, 2, progress=False)
    assert set(runner.stats()["capture_seconds"]) == {str(Bucket(4)), str(Bucket(1))}
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert not any(f"captured {Bucket(2)}" in m for m in infos)
    assert any(f"captured {Bucket(1)} (3/3)" in m for m in infos)


def test_capture_with_progress_shows_a_bar_over_the_buckets(capsys):
    pytest.importorskip("tqdm")
    runner = counting_runner([])
    runner.capture(dummy, 1, progress=True)
    err = capsys.readouterr().err
    assert "capturing buckets" in err and "3/3" in err


def test_generator_capture_without_progress_shows_no_bar(model, capsys):
    captured(model, (1, 2))
    assert "capturing buckets" not in capsys.readouterr().err


def test_collector_is_off_for_warmups_and_captures_and_back_on_after():
    enabled = []

    def forward(x):
        enabled.append(gc.isenabled())
        return x + 1.0

    runner = GraphRunner(
        forward,
        [InputSpec("x", (2, HIDDEN), torch.float32)],
        BucketConfig(batch_sizes=(1, 2)),
        device="cpu",
        capture_backend=eager_backend,
    )
    assert gc.isenabled()
    runner.capture(dummy, 2, progress=False)
    assert enabled == [False] * 5  # 2 + 1 runs for bucket 2, 1 + 1 for bucket 1
    assert gc.isenabled()
    runner.run({"x": torch.ones(1, HIDDEN)})
    assert enabled[-1] is True  # replays run with the collector on


def test_gc_paused_restores_the_collector_also_on_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_gc_paused_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_sampling_rule_takes_unset_values_from_the_generation_config():
    config = SimpleNamespace(do_sample=True, temperature=0.5, top_k=7, top_p=None)
    rule = sampling_rule(config, None, None, None, 0.9)
    assert rule == Sampling(do_sample=True, temperature=0.5, top_k=7, top_p=0.9)
    assert sampling_rule(config, False, 1.5, 3, None) == Sampling(False, 1.5, 3, 1.0)
    config = SimpleNamespace(do_sample=False, temperature=None, top_k=None, top_p=0.8)
    assert sampling_rule(config, None, None, None, None) == Sampling(False, 1.0, 50, 0.8)


def test_sampling_rule_without_a_config_uses_hf_defaults():
    assert sampling_rule(None, None, None, None, None) == Sampling(False, 1.0, 50, 1.0)
    assert sampling_rule(None, True, None, None, None).top_k == 50


def test_sampling_without_top_k_equals_hf_generate_with_its_default_top_k(model):
    gen = captured(model)
    ids, mask = prompts(4)
    torch.manual_seed(5)
    ours = gen.generate(ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=[])
    torch.manual_seed(5)
    want = hf_generate(model, ids, mask, 8, do_sample=True, eos_token_id=None)
    assert torch.equal(ours, want)


def test_sampling_follows_the_model_generation_config(model, monkeypatch):
    gen = captured(model)
    ids, mask = prompts(4)
    monkeypatch.setattr(model.generation_config, "temperature", 0.5)
    monkeypatch.setattr(model.generation_config, "top_k", 5)
    torch.manual_seed(9)
    ours = gen.generate(ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=[])
    torch.manual_seed(9)
    want = hf_generate(model, ids, mask, 8, do_sample=True, eos_token_id=None)
    assert torch.equal(ours, want)
