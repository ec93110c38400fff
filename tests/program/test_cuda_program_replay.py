"""CudaGraphProgram on a real GPU: replays equal eager on nested trees (bitwise), borrowed
and owned outputs, registered leaf types, capture stats, random numbers, and outputs
without autograd history.

Replays run the kernels that eager execution runs, so every comparison with eager is
bitwise (``torch.equal``). Inputs are drawn on the CPU, so values do not depend on the
CUDA generator's state (some tests break captures on purpose).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from cudagraphs import (
    CudaGraphCaptureError,
    CudaGraphCaptureStats,
    ValueTreeSignature,
)
from cudagraphs.program import SignatureMismatchError
from helpers.asserts import assert_bitwise_equal
from helpers.leaf_types import LEAF_TYPES, QuantizedTensor
from helpers.program_cuda import (
    _assert_tree_equal,
    _assert_unchanged,
    _capture,
    _close,
    _map_tensors,
    _pool,
    _quantized,
    _randn,
    _snapshot,
    _tensors,
)

pytestmark = pytest.mark.cuda

POOL_MODES = [pytest.param(False, id="own_pool"), pytest.param(True, id="shared_pool")]


# ---- 1. equality with eager on a nested tree --------------------------------------------


def _tree(seed, device="cuda"):
    return {
        "a": _randn(32, 48, seed=seed, device=device),
        "b": (
            _randn(48, 16, seed=seed + 1, device=device),
            [_randn(7, seed=seed + 2, device=device), _randn(3, 5, seed=seed + 3, device=device)],
        ),
        "c": _randn(16, seed=seed + 4, device=device),
    }


def _tree_fn(tree):
    y = tree["a"] @ tree["b"][0] + tree["b"][1][0].sum()
    # An elementwise op on a transposed input keeps its layout: a non-contiguous output.
    return {"y": y, "z": [tree["c"] * 2], "w": (tree["b"][1][1].t() * 0.5,)}


def _sources(tree, source):
    if source == "mixed":
        return {**_map_tensors(tree, lambda t: t.cpu()), "b": tree["b"]}
    return _map_tensors(tree, lambda t: t.to(source))


@pytest.mark.parametrize("use_pool", POOL_MODES)
@pytest.mark.parametrize("source", ["cuda", "cpu", "mixed"])
def test_replay_of_nested_tree_equals_eager(source, use_pool):
    pool = _pool(use_pool)
    example = _tree(0)
    program = _capture(_tree_fn, example, pool=pool)
    try:
        assert program.device.type == "cuda"
        # Signatures are device independent: a CPU tree describes the same program.
        assert program.input_signature == ValueTreeSignature.from_value((_tree(0, "cpu"),))
        assert program.input_nbytes == sum(t.numel() * 4 for t in _tensors(example))
        for step in range(4):
            new = _tree(100 * (step + 1))
            out = program.replay(_sources(new, source))
            _assert_tree_equal(out, _tree_fn(new), f"replay {step} from {source} sources")
    finally:
        program.close()
        _close(pool)


# ---- 2. borrowed vs owned outputs -------------------------------------------------------


def _tanh_and_sum(x):
    return {"h": torch.tanh(x) * 2, "s": [x.sum(0)]}


@pytest.mark.parametrize("use_pool", POOL_MODES)
def test_borrowed_output_is_overwritten_and_owned_output_is_not(use_pool):
    pool = _pool(use_pool)
    program = _capture(_tanh_and_sum, _randn(256, 64), pool=pool)
    x1, x2 = _randn(256, 64, seed=1), _randn(256, 64, seed=2)
    try:
        borrowed = program.replay(x1)
        borrowed_ptrs = [t.data_ptr() for t in _tensors(borrowed)]
        _assert_tree_equal(borrowed, _tanh_and_sum(x1), "borrowed output of replay(x1)")

        owned = program.replay(x1, copy_output=True)
        _assert_tree_equal(owned, _tanh_and_sum(x1), "owned output of replay(x1)")
        owned_ptrs = {t.untyped_storage().data_ptr() for t in _tensors(owned)}
        graph_ptrs = {t.untyped_storage().data_ptr() for t in _tensors(borrowed)}
        graph_ptrs |= {t.untyped_storage().data_ptr() for t in program._buffer.tensors}
        assert not owned_ptrs & graph_ptrs, "the owned output shares storage with the graph"
        assert len(owned_ptrs) == 2, "owned output leaves must not share storage"

        again = program.replay(x2)
        assert [t.data_ptr() for t in _tensors(again)] == borrowed_ptrs
        assert [t.data_ptr() for t in _tensors(program.output)] == borrowed_ptrs
        _assert_tree_equal(borrowed, _tanh_and_sum(x2), "earlier borrowed output after replay(x2)")
        _assert_tree_equal(owned, _tanh_and_sum(x1), "owned output after replay(x2)")
        _assert_tree_equal(program.output, _tanh_and_sum(x2), "program.output")
    finally:
        program.close()
        _close(pool)


# ---- 8. registered leaf types -----------------------------------------------------------


def _requantize(q, bias):
    x = q.data.float() * q.scale
    y = torch.tanh(x + bias)
    scale = (y.abs().amax() / 127).clamp_min(1e-8).reshape(1)
    data = torch.round(y / scale).clamp(-127, 127).to(torch.int8)
    return {"q": QuantizedTensor(data, scale, q.block), "deq": x}


@pytest.mark.parametrize("use_pool", POOL_MODES)
def test_registered_leaf_type_as_input_and_output(use_pool):
    pool = _pool(use_pool)
    program = _capture(
        _requantize, _quantized(16, 32, seed=0), _randn(32), leaf_types=LEAF_TYPES, pool=pool
    )
    try:
        for step, device in enumerate(["cuda", "cpu", "cuda"]):
            q = _quantized(16, 32, seed=10 + step, device=device)
            bias = _randn(32, seed=20 + step, device=device)
            out = program.replay(q, bias)
            expected = _requantize(_map_tensors(q, lambda t: t.cuda()), bias.cuda())
            _assert_tree_equal(out, expected, f"step {step} from {device}")
        snapshot = _snapshot(program)
        q = _quantized(16, 32, seed=30, block=8)
        with pytest.raises(SignatureMismatchError) as info:
            program.replay(q, _randn(32))
        assert [(m.path, m.field) for m in info.value.mismatches] == [("inputs[0]", "metadata")]
        _assert_unchanged(program, snapshot, "after a metadata mismatch")
    finally:
        program.close()
        _close(pool)


# ---- 11. stats --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "warmup, use_pool", [(0, False), (1, False), (3, False), (1, True), (4, True)]
)
def test_capture_stats(warmup, use_pool):
    pool = _pool(use_pool)
    caller = torch.cuda.current_stream()
    calls = []

    def counted(t):
        calls.append(torch.cuda.current_stream())
        return torch.tanh(t) + 1

    program = _capture(counted, _randn(256), warmup=warmup, pool=pool)
    try:
        stats = program.stats
        assert isinstance(stats, CudaGraphCaptureStats)
        assert stats.warmup_iterations == warmup
        assert len(calls) == warmup + 1, f"{len(calls)} calls for {warmup} warmups + capture"
        assert all(s != caller for s in calls), "warmup and capture run on a side stream"
        for name in ("warmup_seconds", "capture_seconds", "first_replay_seconds"):
            value = getattr(stats, name)
            assert isinstance(value, float) and math.isfinite(value) and value >= 0, name
        assert stats.memory_allocated_bytes > 0
        assert stats.memory_reserved_bytes >= stats.memory_allocated_bytes > 0
    finally:
        program.close()
        _close(pool)


# ---- 12. random numbers -----------------------------------------------------------------


def _dropout(t):
    return F.dropout(t, p=0.5, training=True)


@pytest.mark.parametrize("use_pool", POOL_MODES)
def test_random_function_needs_check_first_replay_off(use_pool):
    pool = _pool(use_pool)
    x = torch.ones(4096, device="cuda")
    try:
        with pytest.raises(CudaGraphCaptureError, match="check_first_replay"):
            _capture(_dropout, x, pool=pool)
        program = _capture(_dropout, x, pool=pool, check_first_replay=False)
        masks = [program.replay(x, copy_output=True) for _ in range(3)]
        for i, m in enumerate(masks):
            values = set(torch.unique(m).tolist())
            assert values <= {0.0, 2.0}, f"replay {i}: dropout(p=0.5) of ones gave {values}"
            zeros = (m == 0).float().mean().item()
            assert 0.4 < zeros < 0.6, f"replay {i} zeroed {zeros:.3f} of the elements"
        assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2]), (
            "replays reused one dropout mask"
        )
    finally:
        _close(pool)


# ---- outputs: grad mode, autograd history, None leaves ----------------------------------


@pytest.mark.parametrize("use_pool", POOL_MODES)
@pytest.mark.parametrize("grad_enabled", [True, False])
def test_outputs_have_no_autograd_history(grad_enabled, use_pool):
    pool = _pool(use_pool)
    seen = []

    def fn(t):
        seen.append(torch.is_grad_enabled())
        return (t * 3).sin()

    with torch.set_grad_enabled(grad_enabled):
        program = _capture(fn, _randn(32).requires_grad_(), warmup=2, pool=pool)
    try:
        assert seen == [grad_enabled] * 3, "the function must run in the caller's grad mode"
        y = _randn(32, seed=1).requires_grad_()
        expected = (y.detach() * 3).sin()
        for copy_output in (False, True):
            out = program.replay(y, copy_output=copy_output)
            assert out.grad_fn is None and not out.requires_grad, f"copy_output={copy_output}"
            assert_bitwise_equal(out, expected, f"copy_output={copy_output}")
    finally:
        program.close()
        _close(pool)


def _none_output(t):
    t * 2
    return None


def _list_with_none(t):
    return [t * 2, None, (t + 1, None)]


def _dict_with_none(t):
    return {"y": t * 2, "nothing": None, "pair": [t + 1, None]}


@pytest.mark.parametrize("use_pool", POOL_MODES)
@pytest.mark.parametrize("fn", [_none_output, _list_with_none, _dict_with_none])
def test_output_tree_may_hold_none(fn, use_pool):
    pool = _pool(use_pool)
    try:
        program = _capture(fn, _randn(32), pool=pool)
        y = _randn(32, seed=1)
        _assert_tree_equal(program.replay(y), fn(y), fn.__name__)
        program.close()
    finally:
        _close(pool)


def test_refused_replays_copy_nothing_and_the_next_replay_equals_eager():
    """Each mismatching call names its path and copies nothing; the good replay after
    it equals eager and writes the program's borrowed output (the same memory every
    replay: it came from the graph, not from an eager run)."""
    program = _capture(_tree_fn, _tree(0))
    try:
        ptr = program.replay(_tree(1))["y"].data_ptr()
        good = _tree(2)
        wrong_dtype = {**good, "a": good["a"].double()}
        wrong_shape = {**good, "a": good["a"][:-1]}
        missing = {k: v for k, v in good.items() if k != "a"}
        not_tensor = {**good, "a": good["a"].tolist()}
        bad = [
            (
                (wrong_dtype,),
                r"inputs\[0\]\['a'\]: dtype expected torch.float32, received torch.float64",
            ),
            ((wrong_shape,), r"inputs\[0\]\['a'\]: shape expected \(32, 48\), received \(31, 48\)"),
            ((missing,), r"inputs\[0\]: keys expected"),
            ((not_tensor,), r"inputs\[0\]\['a'\]: type expected 'Tensor', received 'list'"),
            ((good, good), r"inputs: length expected 1, received 2"),
        ]
        for i, (args, match) in enumerate(bad):
            snapshot = _snapshot(program)
            with pytest.raises(SignatureMismatchError, match=match):
                program.replay(*args)
            _assert_unchanged(program, snapshot, f"refusal {i}")
            new = _tree(10 + i)
            out = program.replay(new)
            _assert_tree_equal(out, _tree_fn(new), f"replay after refusal {i}")
            assert out["y"].data_ptr() == ptr
    finally:
        program.close()
