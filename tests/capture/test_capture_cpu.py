"""Capture primitives' host-side logic (CPU only)."""

import gc

import pytest
import torch

from cudagraphs import NoCudaDeviceError, capture_into_graph
from cudagraphs.capture import _describe_mismatch, capture_environment
from cudagraphs.cuda_binding import cuda_binding
from cudagraphs.introspect import GraphMemory
from cudagraphs.timing import _union_length


def test_capture_environment_sets_and_restores_even_on_error():
    torch.backends.cudnn.benchmark = True
    gc.enable()
    try:
        with pytest.raises(RuntimeError, match="boom"), capture_environment():
            assert not gc.isenabled()
            assert torch.backends.cudnn.benchmark is False
            raise RuntimeError("boom")
        assert gc.isenabled()
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = False


@pytest.fixture
def frozen_cudnn_flags():
    """cudnn flags frozen as torch's test harness freezes them (common_utils calls
    ``torch.backends.disable_global_flags()`` at import)."""
    yield
    # Undo the freeze for the tests that follow (torch has no public way back).
    torch.backends.disable_global_flags.__globals__["__allow_nonbracketed_mutation_flag"] = True
    assert not torch.backends.flags_frozen()


def _cudnn_flags():
    c = torch.backends.cudnn
    return (c.enabled, c.benchmark, c.deterministic, c.benchmark_limit, c.allow_tf32)


@pytest.mark.parametrize("bench_on", [True, False])
def test_capture_environment_works_with_frozen_cudnn_flags(frozen_cudnn_flags, bench_on):
    with torch.backends.cudnn.flags(**{**dict.fromkeys(_flag_names()), "benchmark": bench_on}):
        torch.backends.disable_global_flags()
        before = _cudnn_flags()
        with pytest.raises(RuntimeError, match="not allowed to set"):
            torch.backends.cudnn.benchmark = not bench_on  # frozen: assignment refused
        with capture_environment():
            assert torch.backends.cudnn.benchmark is False
            assert _cudnn_flags()[:1] + _cudnn_flags()[2:] == before[:1] + before[2:]
        assert _cudnn_flags() == before


def _flag_names():
    import inspect

    return inspect.signature(torch.backends.cudnn.flags).parameters


def test_capture_environment_keeps_gc_off_if_it_was_off():
    gc.disable()
    try:
        with capture_environment():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_capture_environment_refuses_recompilation_where_torch_can():
    if not hasattr(torch.compiler, "set_stance"):
        pytest.skip("this torch has no compiler stances")
    calls = []

    @torch.compile(backend="eager")
    def f(t):
        calls.append(1)
        return t + 1

    f(torch.zeros(2))
    with capture_environment(), pytest.raises(Exception, match="(?i)recompil"):
        f(torch.zeros(3, 3))  # a new rank forces a recompilation


def test_bad_capture_error_mode():
    with pytest.raises(ValueError, match="capture_error_mode must be one of"):
        capture_into_graph(lambda: None, capture_error_mode="strict")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_capture_without_cuda_is_the_no_device_error_naming_what():
    with pytest.raises(NoCudaDeviceError, match="capture of bucket 8 needs a CUDA device"):
        capture_into_graph(lambda: None, what="bucket 8")


def test_describe_mismatch_lists_every_difference():
    a = [torch.zeros(2), torch.zeros(3), 1]
    b = [torch.zeros(2), torch.zeros(4, dtype=torch.float16), "x"]
    spec = object()
    problems = _describe_mismatch(a, spec, b, spec)
    assert problems == ["leaf 1: (4,)/torch.float16 != expected (3,)/torch.float32"]
    b2 = [torch.zeros(2), 1.0, torch.zeros(1)]
    assert len(_describe_mismatch(a, spec, b2, spec)) == 2
    assert "tree structure" in _describe_mismatch(a, 1, b, 2)[0]


def test_union_of_intervals():
    assert _union_length([]) == 0
    assert _union_length([(0, 1), (2, 3)]) == 2
    assert _union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.75)]) == 4


def test_driver_backend_never_raises():
    backend = cuda_binding()
    assert backend is None or backend.name in ("ctypes", "cuda.bindings")


def test_graph_memory_per_node():
    assert GraphMemory(nodes=4, exec_bytes=4096).bytes_per_node == 1024
    assert GraphMemory(nodes=None, exec_bytes=0).bytes_per_node == 0.0


def test_as_graph_pool_accepts_pools_and_handles_only():
    from cudagraphs import GraphMemoryPool
    from cudagraphs.capture import as_graph_pool

    pool = GraphMemoryPool(handle=(0, 7))
    assert as_graph_pool(pool) is pool
    wrapped = as_graph_pool((0, 9))
    assert isinstance(wrapped, GraphMemoryPool) and wrapped.handle == (0, 9)
    with pytest.raises(TypeError, match="pool must be a cudagraphs.GraphMemoryPool"):
        as_graph_pool("pool")


def test_graph_pool_retire_moves_off_the_failed_handle(caplog):
    from cudagraphs import GraphMemoryPool

    pool = GraphMemoryPool(handle=(0, 11))
    with caplog.at_level("WARNING", logger="cudagraphs.capture"):
        pool.retire()
    assert pool.retired == [(0, 11)]
    assert "retired after a failed capture" in caplog.text
    assert pool._handle is None and pool._anchor is None  # a fresh handle comes next


def test_capture_failure_hint_names_a_live_eager_graph_for_legacy_stream_errors():
    from cudagraphs.capture import _failure_hint

    hint = _failure_hint("operation would make the legacy stream depend on a capturing stream")
    assert "AccumulateGrad" in hint and "del loss" in hint and "side stream" in hint
    assert "host sync" in _failure_hint("operation not permitted when stream is capturing")


def test_interleaved_step_times_take_turns_and_report_every_step():
    from cudagraphs.timing import interleaved_step_times_ms

    order = []
    steps = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    times = interleaved_step_times_ms(
        steps, iters=2, warmup=1, repeats=3, synchronize=lambda: order.append("|")
    )
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    # Warmup of each, then 3 rounds of (a a | b b |).
    assert "".join(order) == "ab|" + "aa|bb|" * 3


def test_interleaved_step_times_can_shuffle_the_order_of_each_round():
    from cudagraphs.timing import interleaved_step_times_ms

    order: list[str] = []
    steps = {n: (lambda n=n: order.append(n)) for n in "abcd"}
    times = interleaved_step_times_ms(
        steps, iters=1, warmup=0, repeats=20, synchronize=lambda: None, shuffle_seed=0
    )
    assert set(times) == set("abcd")
    rounds = ["".join(order[i : i + 4]) for i in range(0, len(order), 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)  # each step once per round
    assert len(set(rounds)) > 1  # in changing orders
    again: list[str] = []
    steps = {n: (lambda n=n: again.append(n)) for n in "abcd"}
    interleaved_step_times_ms(
        steps, iters=1, warmup=0, repeats=20, synchronize=lambda: None, shuffle_seed=0
    )
    assert again == order  # seeded: the same orders again


def test_graph_pool_is_the_deprecated_alias_of_graph_memory_pool():
    import cudagraphs
    from cudagraphs import capture

    assert cudagraphs.GraphPool is cudagraphs.GraphMemoryPool is capture.GraphMemoryPool
    assert "GraphPool" in cudagraphs.__all__ and "GraphMemoryPool" in cudagraphs.__all__


def test_a_pool_drops_torchs_workspaces_once_per_device_before_making_its_streams(monkeypatch):
    # torch hands out its streams in turn, so a new Stream may be one eager matmuls used:
    # the pool clears torch's cuBLAS workspaces, then makes both streams, once a device.
    import cudagraphs.graph_pool as graph_pool
    from cudagraphs import GraphMemoryPool

    events = []
    monkeypatch.setattr(graph_pool, "clear_cublas_workspaces", lambda: events.append("clear"))
    monkeypatch.setattr(graph_pool, "device_index", lambda device, optional=False: device or 0)

    class Stream:
        def __init__(self, index):
            self.index = index
            events.append(("stream", index))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    pool = GraphMemoryPool(handle=(0, 13))
    warmup = pool.warmup_stream(0)
    capture = pool.capture_stream(0)
    assert events == ["clear", ("stream", 0), ("stream", 0)]
    assert warmup is not capture
    assert pool.warmup_stream(0) is warmup and pool.capture_stream(0) is capture
    assert events == ["clear", ("stream", 0), ("stream", 0)]  # nothing made or cleared again
    other = pool.capture_stream(1)
    assert events[3:] == ["clear", ("stream", 1), ("stream", 1)] and other.index == 1


def test_capture_failure_hint_names_allow_unused_input_for_an_unused_input():
    # num_warmup_iters=0: the capture is the first backward, so autograd's refusal of
    # an unused input comes from the capture, not the warmup's own check.
    from cudagraphs.capture import _failure_hint

    hint = _failure_hint(
        "One of the differentiated Tensors appears to not have been used in the graph. "
        "Set allow_unused=True if this is the desired behavior."
    )
    assert "allow_unused_input=True" in hint and "host sync" not in hint

