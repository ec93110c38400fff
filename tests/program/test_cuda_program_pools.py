"""CudaGraphPool on a real GPU: programs sharing scratch replay in any order, pools close
their members, a failed capture leaves the pool usable, capture/close cycles do not
leak, and close() is idempotent.

Replays run the kernels that eager execution runs, so every comparison with eager is
bitwise (``torch.equal``). Inputs are drawn on the CPU, so values do not depend on the
CUDA generator's state (some tests break captures on purpose).
"""

import gc
import random
import weakref

import pytest
import torch

import cudagraphs
from cudagraphs import (
    CudaGraphCaptureError,
    CudaGraphPool,
    GraphReleasedError,
    ProgramClosedError,
)
from helpers.asserts import assert_bitwise_equal, contain_failed_capture
from helpers.program_cuda import (
    MiB,
    _assert_tree_equal,
    _capture,
    _close,
    _double,
    _pool,
    _randn,
    _scale_shift,
)

pytestmark = pytest.mark.cuda

POOL_MODES = [pytest.param(False, id="own_pool"), pytest.param(True, id="shared_pool")]


# ---- 4. pools ---------------------------------------------------------------------------


def _pool_cases():
    """(name, function, make_inputs(seed)) of three programs of different shapes."""
    w = _randn(32, 48, seed=500)

    def mlp(x):
        h = torch.relu(x @ w)
        return torch.tanh(h) * 0.5 + h.mean()

    def stats(d):
        prod = d["u"] * d["v"]
        return {"cum": prod.cumsum(0), "exp": [d["u"].exp(), prod.amax()]}

    def mix(a, b):
        s = torch.softmax(a + b.t(), dim=-1)
        return s @ a, s.sum(0)

    return [
        ("mlp", mlp, lambda seed: (_randn(64, 32, seed=seed),)),
        (
            "stats",
            stats,
            lambda seed: ({"u": _randn(1000, seed=seed), "v": _randn(1000, seed=seed + 1)},),
        ),
        ("mix", mix, lambda seed: (_randn(24, 24, seed=seed), _randn(24, 24, seed=seed + 1))),
    ]


@pytest.mark.parametrize("streams", ["one_stream", "stream_per_program"])
def test_pool_programs_replay_in_any_order(streams):
    cases = _pool_cases()
    pool = CudaGraphPool()
    try:
        programs = [_capture(fn, *make(0), pool=pool) for _, fn, make in cases]
        if streams == "one_stream":
            replay_streams = [torch.cuda.current_stream()] * len(cases)
        else:
            replay_streams = [torch.cuda.Stream() for _ in cases]
        rng = random.Random(0)
        latest, seed = {}, 1
        for round_ in range(6):
            order = list(range(len(cases)))
            rng.shuffle(order)
            for i in order:
                with torch.cuda.stream(replay_streams[i]):
                    latest[i] = cases[i][2](seed * 10)
                    programs[i].replay(*latest[i])
                seed += 1
            torch.cuda.synchronize()
            for i, (name, fn, _) in enumerate(cases):
                what = f"{name} after round {round_} (order {[cases[j][0] for j in order]})"
                _assert_tree_equal(programs[i].output, fn(*latest[i]), what)
    finally:
        pool.close()


def test_pool_close_closes_live_members_and_refuses_new_captures():
    pool = CudaGraphPool()
    x = _randn(64)
    first = _capture(_scale_shift, x, pool=pool)
    second = _capture(torch.sin, x, pool=pool)
    first.replay(x)
    second.close()  # an already closed member is fine
    pool.close()
    pool.close()  # idempotent
    assert pool.closed
    assert first.closed and second.closed
    for program in (first, second):
        with pytest.raises(ProgramClosedError, match="was closed; its graph, buffers"):
            program.replay(x)
    with pytest.raises((cudagraphs.CudaGraphsError, ValueError), match="closed"):
        _capture(_scale_shift, x, pool=pool)


def test_pool_does_not_keep_its_members_alive():
    pool = CudaGraphPool()
    x = _randn(64)
    try:
        program = _capture(_scale_shift, x, pool=pool)
        program.replay(x)
        ref = weakref.ref(program)
        del program
        gc.collect()
        assert ref() is None, "the pool kept a program alive"
        survivor = _capture(torch.cos, x, pool=pool)
        assert_bitwise_equal(survivor.replay(x), torch.cos(x), "program captured afterwards")
    finally:
        pool.close()
    assert survivor.closed


def test_pool_outputs_have_independent_storage():
    def aliases(t):
        y = t * 2
        return {"input": t, "y": y, "y_again": y, "view": y[:8]}

    pool = CudaGraphPool()
    try:
        program = _capture(aliases, _randn(64), pool=pool)
        z = _randn(64, seed=1)
        out = program.replay(z)
        storages = {k: v.untyped_storage().data_ptr() for k, v in out.items()}
        assert len(set(storages.values())) == 4, f"retained outputs share storage: {storages}"
        buffer = program._buffer.tensors[0].untyped_storage().data_ptr()
        assert buffer not in storages.values(), "a retained output aliases the input buffer"
        _assert_tree_equal(out, aliases(z), "outputs")
    finally:
        pool.close()


# ---- 5. a failed capture, then a good one in the same pool ------------------------------


def _host_sync(t):
    y = t * 2
    if y.sum().item() > 1e30:  # .item() waits for the GPU: illegal while capturing
        y = y + 1
    return y


def _raises_at_capture(t):
    y = t * 2
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("boom at capture")
    return y


def _raises_in_warmup(t):
    raise RuntimeError("boom in warmup")


def _changes_shape_at_capture(t):
    return t[:2] * 2 if torch.cuda.is_current_stream_capturing() else t * 2


def _tanh3(t):
    return torch.tanh(t) * 3


def _square_plus_one(t):
    return t @ t + 1


@pytest.mark.parametrize(
    "failing", [_host_sync, _raises_at_capture, _raises_in_warmup, _changes_shape_at_capture]
)
def test_failed_capture_leaves_the_pool_usable(failing):
    gc.enable()
    pool = CudaGraphPool()
    x = _randn(64, 64, seed=1)
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    retired = []
    try:
        earlier = _capture(_tanh3, x, pool=pool)
        with torch.cuda.stream(caller):
            with pytest.raises(CudaGraphCaptureError) as info:
                _capture(failing, x, pool=pool)
            assert torch.cuda.current_stream() == caller, "the current stream changed"
        retired = list(pool._graph_pool.retired)
        assert info.value.__cause__ is not None, "the underlying error must be chained"
        assert not torch.cuda.is_current_stream_capturing()
        assert gc.isenabled(), "gc must be enabled again"
        z = torch.rand(4096, device="cuda")
        assert ((z >= 0) & (z < 1)).all() and z.std() > 0.2, "eager torch.rand is broken"

        good = _capture(_square_plus_one, x, pool=pool)
        for seed in (2, 3):
            new, other = _randn(64, 64, seed=seed), _randn(64, 64, seed=seed + 10)
            good.replay(new)
            earlier.replay(other)
            assert_bitwise_equal(good.output, _square_plus_one(new), f"good program, seed {seed}")
            assert_bitwise_equal(earlier.output, _tanh3(other), f"earlier program, seed {seed}")
        pool.close()
        assert earlier.closed and good.closed
    finally:
        for handle in retired or [None]:
            contain_failed_capture(handle)
        pool.close()


# ---- 6. capture/close cycles do not leak ------------------------------------------------


def _small(t):
    # Elementwise only: a matmul would allocate a cuBLAS workspace per new stream,
    # which is torch's cache, not a leak.
    return (t * 2 + 1).relu(), t.sum()


def _settled_allocated():
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("use_pool", POOL_MODES)
def test_capture_close_cycles_do_not_grow_allocated_memory(use_pool):
    pool = _pool(use_pool)
    x = _randn(1024)

    def cycle():
        program = _capture(_small, x, warmup=1, pool=pool)
        program.replay(x)
        program.close()

    try:
        cycle()
        before = _settled_allocated()
        for _ in range(100):
            cycle()
        after = _settled_allocated()
        assert abs(after - before) <= MiB, (
            f"memory_allocated went from {before} to {after} bytes over 100 capture/close cycles"
        )
    finally:
        _close(pool)


def test_closed_programs_release_their_private_pools():
    # Once a program's graphs are gone its private pool becomes freeable, and
    # empty_cache() hands the segments back: reserved memory returns to its level.
    x = _randn(1024)

    def reserved():
        _settled_allocated()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    _capture(_small, x, warmup=1).close()
    before = reserved()
    for _ in range(40):
        _capture(_small, x, warmup=1).close()
    after = reserved()
    assert after - before <= 16 * MiB, (
        f"memory_reserved after empty_cache went from {before} to {after} bytes over 40 "
        "capture/close cycles: closed programs keep their graph pools"
    )


# ---- 10. close --------------------------------------------------------------------------


@pytest.mark.parametrize("use_pool", POOL_MODES)
def test_close_is_idempotent_and_later_use_raises(use_pool):
    pool = _pool(use_pool)
    x = _randn(64)
    program = _capture(_double, x, pool=pool)
    handle = program.copy_inputs_from(x)
    program.replay_prepared(copy_handle=handle)
    program.close()
    program.close()
    assert program.closed
    uses = {
        "replay": lambda: program.replay(x),
        "copy_inputs_from": lambda: program.copy_inputs_from(x),
        "replay_prepared": lambda: program.replay_prepared(),
        "replay_prepared(copy_handle)": lambda: program.replay_prepared(copy_handle=handle),
        "output": lambda: program.output,
        "cuda_graph": lambda: program.cuda_graph,
    }
    try:
        for name, use in uses.items():
            with pytest.raises(ProgramClosedError) as info:
                use()
            assert isinstance(info.value, GraphReleasedError), name
        assert "closed" in repr(program)
    finally:
        _close(pool)
    assert program.closed
