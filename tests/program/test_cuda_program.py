"""CudaGraphProgram and CudaGraphPool on a real GPU.

Replays run the kernels that eager execution runs, so every comparison with eager is
bitwise (``torch.equal``). Inputs are drawn on the CPU, so values do not depend on the
CUDA generator's state (some tests break captures on purpose).
"""

import functools
import gc
import math
import random
import weakref

import pytest
import torch
import torch.nn.functional as F

import cudagraphs
from _asserts import assert_bitwise_equal, contain_failed_capture
from cudagraphs import (
    CopyHandle,
    CudaGraphCaptureError,
    CudaGraphCaptureStats,
    CudaGraphInputError,
    CudaGraphPool,
    CudaGraphProgram,
    GraphReleasedError,
    ProgramClosedError,
    ValueTreeSignature,
)
from cudagraphs.program import SignatureMismatchError

pytestmark = pytest.mark.cuda

MiB = 1 << 20
# torch.cuda._sleep spins this many GPU clock cycles: tens of milliseconds on an H200,
# far longer than the host needs to issue the racing work in the ordering tests.
SLEEP_CYCLES = 50_000_000
POOL_MODES = [pytest.param(False, id="own_pool"), pytest.param(True, id="shared_pool")]


# ---- helpers ----------------------------------------------------------------------------


def _randn(*shape, seed=0, dtype=torch.float32, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _pinned(*shape, seed):
    out = torch.empty(*shape, pin_memory=True)
    out.copy_(_randn(*shape, seed=seed, device="cpu"))
    assert out.is_pinned()
    return out


def _capture(function, *example_inputs, **kwargs):
    return CudaGraphProgram.capture(function, example_inputs=example_inputs, **kwargs)


def _pool(use_pool):
    return CudaGraphPool() if use_pool else None


def _close(pool):
    if pool is not None:
        pool.close()


from _leaf_types import LEAF_TYPES, PackedTensor, QuantizedTensor  # noqa: E402


def _quantized(*shape, seed, block=4, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    scale = torch.rand(1, generator=g) * 0.1 + 0.01
    return QuantizedTensor(data.to(device), scale.to(device), block)


def _map_tensors(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, QuantizedTensor):
        zp = None if tree.zero_point is None else fn(tree.zero_point)
        return QuantizedTensor(fn(tree.data), fn(tree.scale), tree.block, zp)
    if tree is None:
        return None
    if type(tree) is dict:
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    items = [_map_tensors(v, fn) for v in tree]
    return items if type(tree) is list else tuple(items)


def _tensors(tree):
    out = []
    _map_tensors(tree, out.append)
    return out


def _clone(tree):
    return _map_tensors(tree, lambda t: t.detach().clone())


def _assert_tree_equal(actual, expected, what):
    """Same structure, leaf types and metadata; every tensor bitwise equal."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__}, not a tensor"
        assert_bitwise_equal(actual, expected, what)
    elif isinstance(expected, QuantizedTensor):
        assert type(actual) is QuantizedTensor, f"{what}: {type(actual).__name__}"
        assert actual.block == expected.block, f"{what}: block {actual.block} != {expected.block}"
        assert_bitwise_equal(actual.data, expected.data, f"{what}.data")
        assert_bitwise_equal(actual.scale, expected.scale, f"{what}.scale")
    elif expected is None:
        assert actual is None, f"{what}: {type(actual).__name__} instead of None"
    elif type(expected) is dict:
        assert type(actual) is dict, f"{what}: {type(actual).__name__} instead of dict"
        assert set(actual) == set(expected), f"{what}: keys {set(actual)} != {set(expected)}"
        for k in expected:
            _assert_tree_equal(actual[k], expected[k], f"{what}[{k!r}]")
    else:
        assert type(actual) is type(expected), f"{what}: {type(actual).__name__}"
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_tree_equal(a, e, f"{what}[{i}]")


def _snapshot(program):
    """Clones of the fixed input buffer and of the borrowed output (synchronized)."""
    torch.cuda.synchronize()
    return [t.detach().clone() for t in program._buffer.tensors], _clone(program.output)


def _assert_unchanged(program, snapshot, what):
    torch.cuda.synchronize()
    buffers, output = snapshot
    for i, (now, before) in enumerate(zip(program._buffer.tensors, buffers)):
        assert_bitwise_equal(now.detach(), before, f"{what}: input buffer tensor {i}")
    _assert_tree_equal(program.output, output, f"{what}: borrowed output")


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


# ---- 3. prefetch: copy_inputs_from + replay_prepared ------------------------------------


def _affine_tanh(w):
    def affine_tanh(x, b):
        return torch.tanh(x @ w) + b

    return affine_tanh


def test_prefetch_pinned_inputs_on_transfer_stream():
    fn = _affine_tanh(_randn(64, 64, seed=99))
    program = _capture(fn, _randn(128, 64), _randn(64, seed=1))
    steps = [(_pinned(128, 64, seed=10 + i), _pinned(64, seed=20 + i)) for i in range(6)]
    transfer, compute = torch.cuda.Stream(), torch.cuda.Stream()
    owned, checks = [], []
    try:
        for x, b in steps:
            handle = program.copy_inputs_from(x, b, stream=transfer, non_blocking=True)
            assert isinstance(handle, CopyHandle)
            with torch.cuda.stream(compute):
                borrowed = program.replay_prepared(copy_handle=handle)
                checks.append(borrowed.sum(0))  # consumed on the compute stream
                owned.append(program.replay_prepared(copy_handle=handle, copy_output=True))
        torch.cuda.synchronize()
        for i, ((x, b), out, check) in enumerate(zip(steps, owned, checks)):
            expected = fn(x.cuda(), b.cuda())
            assert_bitwise_equal(out, expected, f"prefetched step {i}")
            assert_bitwise_equal(check, expected.sum(0), f"borrowed output at step {i}")
        last = fn(*(t.cuda() for t in steps[-1]))
        assert_bitwise_equal(program.output, last, "borrowed output after the loop")
    finally:
        program.close()


def _scale_shift(x):
    return x * 3 - 1


def test_stale_and_foreign_copy_handles_are_rejected():
    program = _capture(_scale_shift, _randn(512))
    other = _capture(_scale_shift, _randn(512))
    a, b, c = (_randn(512, seed=s) for s in (1, 2, 3))
    try:
        # Both programs made exactly one copy: only the owner tells the handles apart.
        foreign = other.copy_inputs_from(c)
        h_a = program.copy_inputs_from(a)
        with pytest.raises(CudaGraphInputError, match="copy_handle was made by another program"):
            program.replay_prepared(copy_handle=foreign)
        assert_bitwise_equal(program.replay_prepared(copy_handle=h_a), _scale_shift(a), "h_a")
        assert_bitwise_equal(other.replay_prepared(copy_handle=foreign), _scale_shift(c), "c")

        h_b = program.copy_inputs_from(b)
        with pytest.raises(CudaGraphInputError, match=r"copy_handle is stale \(payload 1, .* 2\)"):
            program.replay_prepared(copy_handle=h_a)  # older than h_b
        assert_bitwise_equal(program.replay_prepared(copy_handle=h_b), _scale_shift(b), "h_b")
        assert_bitwise_equal(program.replay_prepared(), _scale_shift(b), "current payload")

        h_c = program.copy_inputs_from(c)
        program.replay(a)  # replaces the payload h_c copied
        with pytest.raises(CudaGraphInputError, match="copy_handle is stale"):
            program.replay_prepared(copy_handle=h_c)
        assert_bitwise_equal(program.replay_prepared(), _scale_shift(a), "payload after replay")
    finally:
        program.close()
        other.close()


# ---- 3b. ordering of writes into the fixed input buffer ---------------------------------


def _slow_double(t):
    torch.cuda._sleep(SLEEP_CYCLES)  # the graph reads its input only after this
    return t * 2


def _slow_program():
    return _capture(_slow_double, _randn(4096), warmup=1)


def _event_after_sleep(cycles):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def test_replay_on_another_stream_does_not_overwrite_inputs_of_a_running_replay():
    program = _slow_program()
    x1, x2 = _randn(4096, seed=1), _randn(4096, seed=2)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(first):
            owned = program.replay(x1, copy_output=True)
        with torch.cuda.stream(second):
            program.replay(x2)
        torch.cuda.synchronize()
        assert_bitwise_equal(
            owned,
            x1 * 2,
            "first replay: a replay() from another stream copied its inputs "
            "into the buffer while the first replay still read it",
        )
        assert_bitwise_equal(program.output, x2 * 2, "second replay")
    finally:
        program.close()


def test_copy_inputs_from_waits_for_the_running_replay():
    program = _slow_program()
    x1, x2 = _randn(4096, seed=1), _randn(4096, seed=2)
    compute, transfer = torch.cuda.Stream(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(compute):
            owned = program.replay(x1, copy_output=True)
        handle = program.copy_inputs_from(x2, stream=transfer)
        torch.cuda.synchronize()
        assert_bitwise_equal(owned, x1 * 2, "replay running while the prefetch was issued")
        with torch.cuda.stream(compute):
            out = program.replay_prepared(copy_handle=handle, copy_output=True)
        torch.cuda.synchronize()
        assert_bitwise_equal(out, x2 * 2, "replay of the prefetched payload")
    finally:
        program.close()


@pytest.mark.parametrize("newer", ["replay", "copy_inputs_from"])
def test_an_older_delayed_copy_does_not_overwrite_a_newer_payload(newer):
    program = _slow_program()
    old, new = _randn(4096, seed=1), _randn(4096, seed=2)
    try:
        # The old copy waits for an event that fires half way through the replay below.
        delay = _event_after_sleep(SLEEP_CYCLES // 2)
        program.copy_inputs_from(old, stream=torch.cuda.Stream(), wait_for=delay)
        if newer == "replay":
            owned = program.replay(new, copy_output=True)
        else:
            handle = program.copy_inputs_from(new, stream=torch.cuda.Stream(), wait_for=[])
            owned = program.replay_prepared(copy_handle=handle, copy_output=True)
        torch.cuda.synchronize()
        assert_bitwise_equal(owned, new * 2, f"{newer} of the newest payload")
        # The payload a replay without a newer copy reads is still the newest one. (Under
        # in-graph staging replay() reads `new` in place and leaves the buffer alone.)
        again = program.replay_prepared(copy_output=True)
        torch.cuda.synchronize()
        assert_bitwise_equal(again, new * 2, "the payload at the end")
        if program.staging == "copy" or newer == "copy_inputs_from":
            assert_bitwise_equal(program._buffer.tensors[0], new, "input buffer at the end")
    finally:
        program.close()


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


# ---- 7. bad inputs ----------------------------------------------------------------------


def _bad_example(seed):
    tree = {
        "a": _randn(4, 8, seed=seed),
        "b": (_randn(8, 3, seed=seed + 1), [_randn(5, seed=seed + 2), _randn(2, 6, seed=seed + 3)]),
        "c": [_randn(6, seed=seed + 4)],
        "q": _quantized(4, 8, seed=seed + 5),
    }
    return tree, _randn(3, seed=seed + 6)


def _bad_fn(tree, v):
    b0, (b10, b11) = tree["b"]
    y = tree["a"] @ b0 + b10.sum() + b11.sum() + v
    deq = tree["q"].data.float() * tree["q"].scale
    return {"y": y, "c": tree["c"][0] * 2, "deq": deq @ b0}


def _replace(tree, loc, new):
    """A copy of ``tree`` with ``new`` at ``loc`` (containers rebuilt along the way)."""
    if not loc:
        return new
    head, rest = loc[0], loc[1:]
    if type(tree) is dict:
        return {**tree, head: _replace(tree[head], rest, new)}
    items = list(tree)
    items[head] = _replace(tree[head], rest, new)
    return items if type(tree) is list else tuple(items)


def _without(tree, key):
    return {k: v for k, v in tree.items() if k != key}


def _requant(q, **changes):
    fields = {"data": q.data, "scale": q.scale, "block": q.block, "zero_point": q.zero_point}
    return QuantizedTensor(**{**fields, **changes})


A, B, B1, C, Q, V = (
    "inputs[0]['a']",
    "inputs[0]['b']",
    "inputs[0]['b'][1]",
    "inputs[0]['c']",
    "inputs[0]['q']",
    "inputs[1]",
)

# (edit of a valid (tree, v) into bad positional args, expected {(path, field)}).
BAD_INPUTS = [
    pytest.param(lambda t, v: (_replace(t, ("a",), _randn(5, 8)), v), {(A, "shape")}, id="shape"),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(4, 8, dtype=torch.float64)), v),
        {(A, "dtype")},
        id="dtype",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(8, 4).t()), v), {(A, "stride")}, id="transposed"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(4, 8).requires_grad_()), v),
        {(A, "requires_grad")},
        id="requires_grad",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(5, 8, dtype=torch.float16)), v),
        {(A, "shape"), (A, "dtype")},
        id="shape_and_dtype_of_one_tensor",
    ),
    pytest.param(
        lambda t, v: (t, _randn(())), {(V, "shape"), (V, "stride")}, id="scalar_for_vector"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 1), t["b"][1][:1]), v),
        {(B1, "length")},
        id="missing_list_element",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 1), [*t["b"][1], _randn(2)]), v),
        {(B1, "length")},
        id="extra_list_element",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b",), list(t["b"])), v), {(B, "type")}, id="list_for_tuple"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("c",), tuple(t["c"])), v), {(C, "type")}, id="tuple_for_list"
    ),
    pytest.param(
        lambda t, v: (_without(t, "c"), v), {("inputs[0]", "keys")}, id="missing_dict_key"
    ),
    pytest.param(
        lambda t, v: ({**t, "d": _randn(2)}, v), {("inputs[0]", "keys")}, id="extra_dict_key"
    ),
    pytest.param(
        lambda t, v: ({**_without(t, "c"), "C": t["c"]}, v),
        {("inputs[0]", "keys")},
        id="renamed_dict_key",
    ),
    pytest.param(lambda t, v: (list(t.values()), v), {("inputs[0]", "type")}, id="list_for_dict"),
    pytest.param(lambda t, v: (t, 3), {(V, "type")}, id="int_leaf"),
    pytest.param(
        lambda t, v: (_replace(t, ("c", 0), None), v), {(C + "[0]", "type")}, id="none_leaf"
    ),
    pytest.param(lambda t, v: (_replace(t, ("a",), "a"), v), {(A, "type")}, id="str_leaf"),
    pytest.param(lambda t, v: (t, {"v": v}), {(V, "type")}, id="dict_for_tensor"),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], block=8)), v),
        {(Q, "metadata")},
        id="leaf_metadata",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), PackedTensor(t["q"].data, t["q"].scale, 4)), v),
        {(Q, "type")},
        id="other_leaf_type",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), t["q"].data), v), {(Q, "type")}, id="tensor_for_leaf"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _quantized(4, 8, seed=1)), v),
        {(A, "type")},
        id="leaf_for_tensor",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], data=t["q"].data[:2])), v),
        {(Q + ".data", "shape")},
        id="leaf_tensor_shape",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], scale=t["q"].scale.double())), v),
        {(Q + ".scale", "dtype")},
        id="leaf_tensor_dtype",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], zero_point=t["q"].scale + 1)), v),
        {(Q, "tensor names")},
        id="leaf_tensor_names",
    ),
    pytest.param(lambda t, v: (t,), {("inputs", "length")}, id="too_few_args"),
    pytest.param(lambda t, v: (t, v, v), {("inputs", "length")}, id="too_many_args"),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 1, 1), _randn(3, 6)), v),
        {(B1 + "[1]", "shape")},
        id="deep_shape",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 0), _randn(8, 3, dtype=torch.float16, device="cpu")), v),
        {(B + "[0]", "dtype")},
        id="cpu_source_dtype",
    ),
    pytest.param(
        lambda t, v: (
            {
                **t,
                "a": t["a"].double(),
                "c": tuple(t["c"]),
                "q": _requant(t["q"], block=8),
            },
            _randn(4),
        ),
        {(A, "dtype"), (C, "type"), (Q, "metadata"), (V, "shape")},
        id="errors_in_four_places",
    ),
]


@pytest.fixture
def bad_input_program():
    program = _capture(_bad_fn, *_bad_example(0), leaf_types=LEAF_TYPES)
    yield program
    program.close()


@pytest.mark.parametrize("edit, expected", BAD_INPUTS)
def test_bad_inputs_are_rejected_before_any_copy(bad_input_program, edit, expected):
    program = bad_input_program
    good = _bad_example(1)
    program.replay(*good)
    handle = program.copy_inputs_from(*good)
    snapshot = _snapshot(program)
    bad = edit(*_bad_example(2))
    for name in ("replay", "copy_inputs_from"):
        with pytest.raises(SignatureMismatchError) as info:
            getattr(program, name)(*bad)
        assert isinstance(info.value, CudaGraphInputError)
        got = [(m.path, m.field) for m in info.value.mismatches]
        assert sorted(got) == sorted(expected), f"{name}: mismatches {info.value.mismatches}"
        for path, _ in expected:
            assert path in str(info.value), f"{name}: the message does not name {path}"
        _assert_unchanged(program, snapshot, f"after the rejected {name}")
    # Nothing was copied, so the handle of the last good copy is still the latest.
    out = program.replay_prepared(copy_handle=handle)
    _assert_tree_equal(out, _bad_fn(*good), "replay_prepared after the rejected inputs")


def test_mismatches_report_expected_and_received(bad_input_program):
    tree, v = _bad_example(2)
    tree = _replace(tree, ("a",), _randn(5, 8))
    tree = _replace(tree, ("b", 1), tree["b"][1][:1])
    tree = _replace(tree, ("q",), _requant(tree["q"], block=8))
    with pytest.raises(SignatureMismatchError) as info:
        bad_input_program.replay(tree, v)
    found = {(m.path, m.field): (m.expected, m.received) for m in info.value.mismatches}
    assert found == {
        (A, "shape"): ((4, 8), (5, 8)),
        (B1, "length"): (2, 1),
        (Q, "metadata"): ({"block": 4}, {"block": 8}),
    }


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


# ---- 9. capture argument validation -----------------------------------------------------


def _double(t):
    return t * 2


def _add(a, b):
    return a + b


def _return_int(t):
    return 3


def _with_cpu_output(t):
    return t * 2, torch.ones(2)  # a CPU tensor: never written by a replay


CAPTURE_ARGUMENT_CASES = [
    pytest.param(lambda x: {"example_inputs": ()}, ValueError, "hold no tensor", id="no_inputs"),
    pytest.param(
        lambda x: {"example_inputs": ([], {"k": ()})}, ValueError, "hold no tensor", id="no_tensor"
    ),
    pytest.param(
        lambda x: {"example_inputs": (x.cpu(),)}, ValueError, "one CUDA device", id="cpu_tensor"
    ),
    pytest.param(
        lambda x: {"function": _add, "example_inputs": (x, x.cpu())},
        ValueError,
        r"one CUDA device, found \['cpu', 'cuda:0'\]",
        id="cpu_and_cuda",
    ),
    pytest.param(
        lambda x: {"function": _add, "example_inputs": (x, x[1:])},
        ValueError,
        "tensors 0 and 1 .* share storage",
        id="tensor_and_view",
    ),
    pytest.param(
        lambda x: {"function": _add, "example_inputs": (x, x)},
        ValueError,
        "tensors 0 and 1 .* share storage",
        id="same_tensor_twice",
    ),
    pytest.param(
        lambda x: {"example_inputs": (x,), "warmup": -1},
        ValueError,
        "warmup must be an int >= 0",
        id="warmup_-1",
    ),
    pytest.param(
        lambda x: {"example_inputs": (x,), "warmup": 0, "pool": CudaGraphPool()},
        ValueError,
        "CudaGraphPool needs warmup >= 1",
        id="pool_without_warmup",
    ),
    pytest.param(
        lambda x: {"function": _return_int, "example_inputs": (x,)},
        TypeError,
        "output: unsupported leaf of type int",
        id="int_output",
    ),
    pytest.param(
        lambda x: {"function": _return_int, "example_inputs": (x,), "pool": CudaGraphPool()},
        TypeError,
        "output: unsupported leaf of type int",
        id="int_output_in_pool",
    ),
    pytest.param(
        lambda x: {"function": _with_cpu_output, "example_inputs": (x,)},
        TypeError,
        r"returned tensors on \['cpu'\]",
        id="cpu_tensor_output",
    ),
    pytest.param(
        lambda x: {"function": 42, "example_inputs": (x,)},
        TypeError,
        "function must be callable, got int",
        id="not_callable",
    ),
    pytest.param(
        lambda x: {"example_inputs": x},
        TypeError,
        "example_inputs must be a sequence of positional arguments",
        id="example_inputs_not_a_sequence",
    ),
    pytest.param(
        lambda x: {"example_inputs": (x, 3)},
        TypeError,
        r"inputs\[1\]: unsupported leaf of type int",
        id="int_input_leaf",
    ),
]


@pytest.mark.parametrize("build, error, match", CAPTURE_ARGUMENT_CASES)
def test_capture_rejects_bad_arguments(build, error, match):
    kwargs = {"function": _double, **build(_randn(16))}
    try:
        with pytest.raises(error, match=match):
            CudaGraphProgram.capture(**kwargs)
    finally:
        _close(kwargs.get("pool"))


def test_capture_as_decorator_returns_a_program():
    x = _randn(16)

    @CudaGraphProgram.capture(example_inputs=(x,), warmup=1)
    def doubled_plus_one(t):
        return t * 2 + 1

    try:
        assert isinstance(doubled_plus_one, CudaGraphProgram)
        y = _randn(16, seed=3)
        assert_bitwise_equal(doubled_plus_one.replay(y), y * 2 + 1, "decorated program")
    finally:
        doubled_plus_one.close()


class _Project:
    def __init__(self, w):
        self.w = w

    def __call__(self, t):
        return t @ self.w


def _project_shift(t, *, w, shift):
    return t @ w + shift


def test_static_state_bound_by_partial_or_callable_object():
    w, shift = _randn(16, 16, seed=5), _randn(16, seed=6)
    functions = [functools.partial(_project_shift, w=w, shift=shift), _Project(w)]
    for function in functions:
        program = _capture(function, _randn(8, 16))
        try:
            y = _randn(8, 16, seed=7)
            assert_bitwise_equal(program.replay(y), function(y), repr(program))
        finally:
            program.close()


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
