"""Capture primitives on a real GPU: capture, failure recovery, static outputs, introspection."""

import gc

import pytest
import torch
import torch.nn.functional as F

import cudagraphs
from cudagraphs import (
    CudaGraphCaptureError,
    capture_into_graph,
    capture_with_static_outputs,
    new_pool,
)
from cudagraphs.introspect import GraphMemory, graph_node_count, instantiate_measured
from helpers.asserts import contain_failed_capture

pytestmark = pytest.mark.cuda


def _randn(*shape, seed=0, dtype=torch.float32):
    # Drawn on the CPU: tests that provoke a failed capture must not depend on the CUDA
    # generator being usable (that is checked on its own, below).
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).cuda()


_contain_failed_capture = contain_failed_capture


def _assert_equal(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.equal(actual, expected), (
        f"{what}: max abs difference {(actual.double() - expected.double()).abs().max().item()}"
    )


@pytest.fixture
def cudnn_benchmark_on():
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def test_capture_into_graph_replays_with_new_input():
    x = _randn(1024)
    graph, out = capture_into_graph(lambda: x * 2 + 1, what="x*2+1")
    assert isinstance(graph, torch.cuda.CUDAGraph)
    assert out.data_ptr() != x.data_ptr(), "the output must be a fresh buffer"
    for seed in (1, 2):
        x.copy_(_randn(1024, seed=seed))
        graph.replay()
        _assert_equal(out, x * 2 + 1, f"replay after new input (seed {seed})")


def test_capture_environment_is_active_inside_and_restored_after(cudnn_benchmark_on):
    gc.enable()
    seen = {}

    def run():
        seen["gc"] = gc.isenabled()
        seen["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        seen["capturing"] = torch.cuda.is_current_stream_capturing()
        return x + 1

    x = _randn(16)
    capture_into_graph(run)
    assert seen == {"gc": False, "cudnn_benchmark": False, "capturing": True}, seen
    assert gc.isenabled(), "gc must be enabled again after capture"
    assert torch.backends.cudnn.benchmark is True, "cudnn.benchmark must be restored"


def _assert_state_restored(stream_before):
    assert not torch.cuda.is_current_stream_capturing(), "still capturing after the failure"
    after = torch.cuda.current_stream()
    assert after == stream_before and after.cuda_stream == stream_before.cuda_stream, (
        f"current stream changed: {stream_before} -> {after}"
    )
    assert gc.isenabled(), "gc was enabled before the capture and must be enabled again"
    assert torch.backends.cudnn.benchmark is True, "cudnn.benchmark must be restored"


def _pool_for(pool_state, x):
    """A pool and, for "pool_in_use", a live graph already captured in it."""
    pool = new_pool()
    if pool_state == "fresh_pool":
        return pool, None
    graph, out = capture_into_graph(lambda: x + 100, pool)
    return pool, (graph, out)


def _check_earlier_graph(earlier, x):
    if earlier is not None:
        graph, out = earlier
        graph.replay()
        _assert_equal(out, x + 100, "the graph captured in the pool before the failure")


POOL_STATES = ["fresh_pool", "pool_in_use"]


@pytest.mark.parametrize("pool_state", POOL_STATES)
def test_failed_capture_host_sync_recovers_and_pool_is_reusable(cudnn_benchmark_on, pool_state):
    gc.enable()
    x = _randn(256, seed=1)
    a = _randn(64, 64, seed=2)
    w = _randn(64, 64, seed=3)
    ones = torch.ones(64, 64, device="cuda")
    pool, earlier = _pool_for(pool_state, x)
    stream_before = torch.cuda.current_stream()

    def host_sync():
        y = x * 2
        if y.sum().item() > 1e30:  # .item() synchronizes with the host: illegal in capture
            y = y + 1
        return y

    try:
        with pytest.raises(CudaGraphCaptureError) as info:
            capture_into_graph(host_sync, pool, what="host_sync")
        assert info.value.__cause__ is not None, "the underlying error must be chained"
        assert "host_sync" in str(info.value), "the message must name what was captured"
        _assert_state_restored(stream_before)

        def matmul_and_dropout():
            return a @ w, F.dropout(ones, p=0.5, training=True)

        # Warm the matmul (cuBLAS workspace for this stream) up outside the capture. The
        # dropout is not warmed up eagerly here: eager RNG after a failed capture is
        # checked by its own test.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a @ w
        torch.cuda.current_stream().wait_stream(side)

        graph, (mm, dropped) = capture_into_graph(matmul_and_dropout, pool, stream=side)
        graph.replay()
        _assert_equal(mm, a @ w, "matmul replay in the reused pool")
        first_mask = dropped.clone()
        a.copy_(_randn(64, 64, seed=4))
        graph.replay()
        _assert_equal(mm, a @ w, "matmul replay after a new input")
        values = set(torch.unique(dropped).tolist())
        assert values <= {0.0, 2.0}, f"dropout(p=0.5) of ones must give 0 or 2, got {values}"
        zeros = (dropped == 0).float().mean().item()
        assert 0.4 < zeros < 0.6, f"dropout(p=0.5) zeroed {zeros:.3f} of the elements"
        assert not torch.equal(first_mask, dropped), "two replays gave the same dropout mask"
        _check_earlier_graph(earlier, x)
    finally:
        _contain_failed_capture(pool)


def test_eager_rng_works_after_a_failed_capture():
    # A failed capture must leave nothing behind (DESIGN 1), the CUDA generator included:
    # an eager random op right after it (a typical warmup before the next capture) must
    # work. torch only takes the generator out of capture mode in a successful capture_end.
    x = _randn(256)
    pool = new_pool()

    def host_sync():
        return x.sum().item()

    try:
        with pytest.raises(CudaGraphCaptureError, match="capture of callable failed"):
            capture_into_graph(host_sync, pool)
        try:
            y = F.dropout(torch.ones(1024, device="cuda"), p=0.5, training=True)
            z = torch.rand(16, device="cuda")
        except RuntimeError as exc:
            pytest.fail(f"eager RNG failed after a failed capture: {exc}")
        assert 0 < (y == 0).sum().item() < 1024
        assert ((z >= 0) & (z < 1)).all()
    finally:
        _contain_failed_capture(pool)


@pytest.mark.parametrize("pool_state", POOL_STATES)
def test_failed_capture_python_exception_recovers(cudnn_benchmark_on, pool_state):
    gc.enable()
    x = _randn(128)
    pool, earlier = _pool_for(pool_state, x)
    stream_before = torch.cuda.current_stream()

    def raises():
        x * 3  # some captured work before the failure
        raise ValueError("boom inside capture")

    try:
        with pytest.raises(CudaGraphCaptureError, match="boom inside capture") as info:
            capture_into_graph(raises, pool)
        assert isinstance(info.value.__cause__, ValueError), f"cause: {info.value.__cause__!r}"
        _assert_state_restored(stream_before)

        graph, out = capture_into_graph(lambda: x * 3 - 1, pool)
        x.copy_(_randn(128, seed=5))
        graph.replay()
        _assert_equal(out, x * 3 - 1, "capture after a failed one in the same pool")
        _check_earlier_graph(earlier, x)
        # A capture that raised in Python ended cleanly, so the RNG is usable.
        assert torch.rand(4, device="cuda").shape == (4,)
    finally:
        _contain_failed_capture(pool)


def test_static_outputs_survive_replays_of_another_graph_in_the_pool():
    pool = new_pool()
    a = _randn(4096, seed=1)
    b = _randn(4096, seed=2)

    def run_a():
        t = a * 3
        return t + 1, t.sin()

    def run_b():
        t = (b - 2) * 5
        return {"sq": t * t, "neg": -t}

    def expect_a():
        t = a * 3
        return t + 1, t.sin()

    def expect_b():
        t = (b - 2) * 5
        return {"sq": t * t, "neg": -t}

    graph_a, outs_a = capture_with_static_outputs(run_a, run_a(), pool)
    graph_b, outs_b = capture_with_static_outputs(run_b, run_b(), pool)
    assert isinstance(outs_a, tuple) and len(outs_a) == 2
    assert isinstance(outs_b, dict) and set(outs_b) == {"sq", "neg"}

    for step, replay_order in enumerate([("a", "b"), ("b", "a"), ("a", "b")]):
        a.copy_(_randn(4096, seed=10 + step))
        b.copy_(_randn(4096, seed=20 + step))
        for name in replay_order:
            (graph_a if name == "a" else graph_b).replay()
        # Each graph's static outputs are read after the OTHER graph replayed too.
        for i, (got, want) in enumerate(zip(outs_a, expect_a())):
            _assert_equal(got, want, f"graph a output {i} after replay order {replay_order}")
        for key, want in expect_b().items():
            _assert_equal(outs_b[key], want, f"graph b output {key!r} after {replay_order}")


@pytest.mark.parametrize(
    "like, produce, fragment",
    [
        (lambda: torch.empty(4, device="cuda"), lambda x: x[:5] * 2, "(5,)"),
        (lambda: torch.empty(8, device="cuda"), lambda x: (x * 2).half(), "torch.float16"),
        (
            lambda: (torch.empty(8, device="cuda"),),
            lambda x: (x * 2, x * 3),
            "tree structure",
        ),
    ],
    ids=["shape", "dtype", "structure"],
)
def test_static_outputs_mismatch_is_capture_error(like, produce, fragment):
    pool = new_pool()
    x = _randn(8)
    try:
        with pytest.raises(CudaGraphCaptureError) as info:
            capture_with_static_outputs(lambda: produce(x), like(), pool)
        assert isinstance(info.value.__cause__, ValueError), f"cause: {info.value.__cause__!r}"
        assert fragment in str(info.value), f"message should mention {fragment!r}: {info.value}"
        assert not torch.cuda.is_current_stream_capturing()
    finally:
        _contain_failed_capture(pool)


@pytest.mark.parametrize("pool_state", POOL_STATES)
def test_static_outputs_capture_in_the_same_pool_after_a_mismatch(pool_state):
    # Like a serving runner whose bucket graphs share one pool: one failed capture must
    # not stop the next one.
    x = _randn(8)
    pool, earlier = _pool_for(pool_state, x)
    try:
        with pytest.raises(CudaGraphCaptureError, match=r"output differs from `like`"):
            capture_with_static_outputs(lambda: x[:5] * 2, torch.empty(4, device="cuda"), pool)
        graph, out = capture_with_static_outputs(lambda: x * 2, torch.empty(8, device="cuda"), pool)
        x.copy_(_randn(8, seed=3))
        graph.replay()
        _assert_equal(out, x * 2, "capture in the same pool after a mismatch")
        _check_earlier_graph(earlier, x)
    finally:
        _contain_failed_capture(pool)


def test_introspection_counts_nodes_and_measures_instantiation():
    x = _randn(1 << 16)

    def three_kernels():
        return ((x * 2) + 1).sin()

    graph, out = capture_into_graph(three_kernels, keep_graph=True)
    count = graph_node_count(graph)
    assert isinstance(count, int), f"expected an int node count on an NVIDIA GPU, got {count!r}"
    assert count >= 3, f"3 elementwise kernels were captured but the graph has {count} nodes"

    memory = instantiate_measured(graph)
    assert isinstance(memory, GraphMemory)
    assert memory.nodes == count, f"instantiate_measured saw {memory.nodes} nodes, not {count}"
    assert memory.bytes_per_node == memory.exec_bytes / count

    for seed in (1, 2):
        x.copy_(_randn(1 << 16, seed=seed))
        graph.replay()
        _assert_equal(out, ((x * 2) + 1).sin(), f"replay after instantiate_measured (seed {seed})")


def test_node_count_needs_keep_graph():
    x = _randn(64)
    graph, _ = capture_into_graph(lambda: x + 1)
    with pytest.raises(ValueError, match="keep_graph"):
        cudagraphs.introspect.graph_node_count(graph)


def test_captures_into_one_pool_share_its_stream_and_add_no_workspaces():
    # cuBLAS makes a workspace (32 MiB on Hopper) per stream on the stream's first
    # matmul. The pool's first capture makes its capture stream's workspace inside the
    # pool; later captures into the pool must not each allocate another.
    pool = cudagraphs.new_pool()
    stream = pool.capture_stream()
    assert pool.capture_stream(torch.cuda.current_device()) is stream
    assert pool.warmup_stream() is not stream
    assert pool.warmup_stream(torch.cuda.current_device()) is pool.warmup_stream()
    a = torch.randn(256, 256, device="cuda")
    with cudagraphs.capture.side_stream(pool.warmup_stream()):
        (a @ a).sum()
    torch.cuda.synchronize()
    graphs = [cudagraphs.capture_into_graph(lambda: a @ a, pool)]  # workspace, first segment
    reserved = torch.cuda.memory_reserved()
    graphs += [cudagraphs.capture_into_graph(lambda: a @ a, pool) for _ in range(4)]
    grown = torch.cuda.memory_reserved() - reserved
    assert grown < 8 * 2**20, f"4 more small captures grew reserved memory by {grown} bytes"
    for graph, out in graphs:
        graph.replay()
        torch.testing.assert_close(out, a @ a)


def test_a_graph_of_thousands_of_kernels_takes_executable_memory():
    # The serving memory plan charges executable memory per node; a large graph must
    # show some (the driver maps it in pages, so a three-kernel graph may show none).
    x = torch.zeros(1, device="cuda")

    def many_kernels():
        for _ in range(4000):
            x.add_(1)

    graph, _ = capture_into_graph(many_kernels, keep_graph=True)
    memory = instantiate_measured(graph)
    assert memory.nodes == 4000, memory
    assert memory.exec_bytes > 0, f"4000 nodes instantiated with no device memory: {memory}"
    assert memory.bytes_per_node < 1 << 20, f"implausible executable memory: {memory}"
    graph.replay()
    assert x.item() == 4000
