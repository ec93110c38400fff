"""What GraphRunner.capture() does at startup on the CPU: rank agreement, the memory plan
and its log lines, timings, the warmup stream, the progress bar and the CUDA calls."""

import contextlib
import logging
import types

import pytest
import torch

from cudagraphs.errors import CudaGraphsTypeError
from cudagraphs.serving import (
    Bucket,
    BucketConfig,
    BucketCost,
    CaptureTime,
    GraphRunner,
    InputSpec,
    MemoryUse,
    startup,
)
from cudagraphs.serving.startup import (
    CaptureArgs,
    choose_by_memory,
    measure_bucket,
    memory_now,
    warmup_scope,
)
from helpers.serving_runner import (
    HIDDEN,
    EagerGraph,
    dummy,
    eager_backend,
    forward,
    make_runner,
    synthetic_cost,
)

LOG = "cudagraphs.serving.runner"
MIB = 1 << 20
ALL = [Bucket(b) for b in (64, 32, 16, 8, 4, 2, 1)]  # the default config, capture order


def args_of(runner, make_inputs=dummy, **kw):
    """The CaptureArgs a capture() of ``runner`` with ``kw`` hands the startup."""
    return CaptureArgs(
        runner.forward,
        runner.specs,
        runner.config,
        runner.device,
        make_inputs,
        runner.backend,
        stand_in=True,
        **kw,
    )


def messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == level]


def recording_agree(monkeypatch, fail_index=None):
    """Stand-in for agree_on_captured: records its arguments; another rank failed the
    bucket at ``fail_index`` (config order)."""
    calls = []

    def agree(local_ok, group=None):
        calls.append((list(local_ok), group))
        return [ok and i != fail_index for i, ok in enumerate(local_ok)]

    monkeypatch.setattr(startup, "agree_on_captured", agree)
    return calls


def graph_keeping_backend():
    graphs = {}

    def backend(run, pool, what):
        out = run()
        graphs[what] = EagerGraph(run, out)
        return graphs[what], out

    backend.graphs = graphs
    return backend


def test_a_bucket_another_rank_dropped_is_reset_dropped_and_said(monkeypatch, caplog):
    group = object()
    calls = recording_agree(monkeypatch, fail_index=ALL.index(Bucket(8)))
    backend = graph_keeping_backend()
    runner = make_runner(backend=backend, group=group, require_all_buckets=False)
    with caplog.at_level(logging.INFO, logger=LOG):
        runner.capture(dummy)
    assert calls == [([True] * 7, group)]
    assert Bucket(8) not in runner.graphs and len(runner.graphs) == 6
    assert backend.graphs["bucket(bs=8)"].was_reset
    assert [what for what, g in backend.graphs.items() if g.was_reset] == ["bucket(bs=8)"]
    assert runner.dropped_buckets == {Bucket(8): "dropped on another rank"}
    assert messages(caplog, logging.ERROR) == [
        "GraphRunner: dropping bucket(bs=8): another rank could not capture it: "
        "dropped on another rank"
    ]
    assert runner.select(5) == Bucket(16)


def test_every_rank_reports_one_bool_per_bucket_also_for_failed_and_planned_out(
    monkeypatch, caplog
):
    calls = recording_agree(monkeypatch)
    runner = make_runner(backend=eager_backend(fail_on=[Bucket(8)]), require_all_buckets=False)
    with caplog.at_level(logging.INFO, logger=LOG):
        runner.capture(dummy, plan_memory=True, free_bytes=134 * MIB, measure=synthetic_cost)
    # 64 and 32 do not fit the plan, 8 fails its capture: all three False, not None.
    ((local_ok, group),) = calls
    assert local_ok == [False, False, True, False, True, True, True]
    assert all(type(ok) is bool for ok in local_ok)
    assert group is None
    assert runner.dropped_buckets[Bucket(8)] == (
        "RuntimeError: operation not permitted when stream is capturing"
    )
    assert messages(caplog, logging.ERROR)[-1] == (
        "GraphRunner: dropping bucket(bs=8): its capture failed: RuntimeError: operation "
        "not permitted when stream is capturing"
    )


def test_a_compiled_forward_warms_up_every_bucket_in_full():
    specs = [InputSpec("x", (4, HIDDEN), torch.float32), InputSpec("scale", (4, 1), torch.float32)]
    config = BucketConfig(batch_sizes=(2, 4))
    plain = GraphRunner(forward, specs, config, device="cpu", capture_backend=eager_backend())
    plain.capture(dummy, warmup=3)
    assert [t.warmup_runs for t in plain.capture_times.values()] == [3, 1]
    compiled = GraphRunner(
        forward,
        specs,
        config,
        device="cpu",
        capture_backend=eager_backend(),
        compile_options={"backend": "eager"},
    )
    compiled.capture(dummy, warmup=3)
    assert [t.warmup_runs for t in compiled.capture_times.values()] == [3, 3]


def fake_clock(monkeypatch, ticks):
    it = iter(ticks)
    monkeypatch.setattr(startup, "time", types.SimpleNamespace(perf_counter=lambda: next(it)))


def two_slot_runner(**kw):
    specs = [InputSpec("x", (8, HIDDEN), torch.float32), InputSpec("scale", (8, 1), torch.float32)]
    return GraphRunner(
        forward, specs, BucketConfig(batch_sizes=(2, 8)), device="cpu", slots=2, **kw
    )


def test_capture_times_add_up_every_slot(monkeypatch, caplog):
    # per slot: start, end of warmup, end of capture
    fake_clock(
        monkeypatch, [10.0, 11.0, 13.0, 20.0, 24.0, 32.0, 40.0, 40.5, 42.5, 50.0, 50.25, 51.0]
    )
    runner = two_slot_runner(capture_backend=eager_backend())
    with caplog.at_level(logging.INFO, logger=LOG):
        runner.capture(dummy, warmup=2)
    assert runner.capture_times == {
        Bucket(8): CaptureTime(2, 5.0, 10.0),
        Bucket(2): CaptureTime(1, 0.75, 2.75),
    }
    assert messages(caplog, logging.INFO) == [
        "GraphRunner: captured bucket(bs=8) (1/2): warmup 5.000 s, capture 10.000 s",
        "GraphRunner: captured bucket(bs=2) (2/2): warmup 0.750 s, capture 2.750 s",
    ]


def test_each_warmup_runs_in_the_pools_warmup_scope_and_each_capture_outside_it(monkeypatch):
    events = []

    @contextlib.contextmanager
    def scope(pool, device):
        events.append("enter")
        yield
        events.append("exit")

    monkeypatch.setattr(startup, "warmup_scope", scope)
    backend = eager_backend()
    real = backend

    def capturing(*args, **kwargs):
        events.append("capture")
        return real(*args, **kwargs)

    two_slot_runner(capture_backend=capturing).capture(dummy)
    assert len(backend.captured) == 4
    # A capture inside the scope would run with the warmup's allocator routing on.
    assert events == ["enter", "exit", "capture"] * 4


class FakePool:
    def __init__(self):
        self.asked = []

    @contextlib.contextmanager
    def warmup_scope(self, device):
        self.asked.append(device)
        yield ("warmup stream", device)


def test_warmup_scope_is_the_pools_on_cuda_and_nothing_elsewhere():
    pool = FakePool()
    cuda = torch.device("cuda", 1)
    with warmup_scope(pool, cuda) as got:
        assert got == ("warmup stream", cuda)
    assert pool.asked == [cuda]
    with warmup_scope(pool, torch.device("cpu")) as got:
        assert got is None
    assert pool.asked == [cuda]


def fake_cuda_memory(monkeypatch, free=111, total=999, reserved=222):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty",)))

    def memory_reserved(d=None):
        calls.append(("reserved", d))
        return reserved

    def mem_get_info(d=None):
        calls.append(("info", d))
        return free, total

    monkeypatch.setattr(torch.cuda, "memory_reserved", memory_reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return calls


def test_memory_now_empties_the_cache_and_reads_the_runners_device(monkeypatch):
    calls = fake_cuda_memory(monkeypatch)
    cuda = torch.device("cuda", 1)
    assert memory_now(cuda) == (222, 111)
    assert calls == [("sync", cuda), ("empty",), ("reserved", cuda), ("info", cuda)]
    calls.clear()
    assert memory_now(torch.device("cpu")) is None
    assert calls == []


def test_memory_used_is_the_change_across_the_captures_and_is_logged(monkeypatch, caplog):
    readings = iter([(100 * MIB, 5000 * MIB), (400 * MIB, 3000 * MIB)])
    monkeypatch.setattr(startup, "memory_now", lambda device: next(readings))
    runner = make_runner(backend=eager_backend())
    with caplog.at_level(logging.INFO, logger=LOG):
        runner.capture(
            dummy, plan_memory=True, free_bytes=1 << 40, headroom_bytes=5, measure=synthetic_cost
        )
    assert runner.memory_used == MemoryUse(300 * MIB, 2000 * MIB)
    plan = runner.memory_plan
    assert plan.eager_reserve_bytes == 64 * MIB + 5  # the largest eager peak + headroom
    assert plan.budget_bytes == 1 << 40
    lines = [r for r in caplog.records if r.name == LOG and r.levelno == logging.INFO]
    plan_line, used_line = lines[0], lines[-1]
    assert plan_line.getMessage() == plan.describe()
    assert plan_line.getMessage().startswith("memory plan: 7 bucket(s) predicted to take")
    assert used_line.getMessage() == (
        "memory plan vs capture: pool predicted 256.0 MiB, reserved 300.0 MiB; total "
        "predicted 256.7 MiB, device free memory dropped by 2.0 GiB (actual/predicted 7.79)"
    )
    # Passed as an argument, never as the format: a "%" in it stays text.
    assert (plan_line.msg, used_line.msg) == ("%s", "%s")
    assert len(lines) == 9  # the plan, 7 captured buckets, the memory used


def test_without_the_memory_plan_memory_is_not_read(monkeypatch):
    read = []
    monkeypatch.setattr(startup, "memory_now", lambda device: read.append(1) or (1, 2))
    runner = make_runner(backend=eager_backend())
    runner.capture(dummy)
    assert read == [] and runner.memory_used is None and runner.memory_plan is None


def test_a_measure_that_returns_no_bucket_cost_is_a_type_error():
    runner = make_runner(backend=eager_backend())
    with pytest.raises(CudaGraphsTypeError) as info:
        runner.capture(dummy, plan_memory=True, free_bytes=1 << 40, measure=lambda b: 5)
    assert str(info.value) == "measure(bucket(bs=64)) must return a BucketCost, got int"


def test_the_plan_reads_the_devices_free_memory_when_not_given(monkeypatch):
    runner = make_runner(backend=eager_backend())
    runner.capture(dummy)
    calls = fake_cuda_memory(monkeypatch, free=134 * MIB, total=1 << 40)
    chosen = choose_by_memory(
        args_of(runner, plan_memory=True, measure=synthetic_cost), runner.captured
    )
    assert calls == [("info", runner.device)]
    assert runner.memory_plan.budget_bytes == 134 * MIB
    assert chosen == {Bucket(b) for b in (16, 8, 4, 2, 1)}


def test_the_default_measure_runs_the_staged_bucket_on_the_warmup_stream(monkeypatch):
    stream = object()
    seen = []

    def measure_bucket_cost(bucket, run, stream=None):
        seen.append((bucket, run(), stream))
        return BucketCost(bucket, 1, 2, 3, 4.0)

    monkeypatch.setattr(startup, "measure_bucket_cost", measure_bucket_cost)
    runner = make_runner(backend=eager_backend())
    runner.capture(dummy)
    monkeypatch.setattr(startup, "warmup_stream", lambda pool, device: stream)
    inputs = {"x": torch.arange(16.0).reshape(4, HIDDEN), "scale": torch.full((4, 1), 2.0)}
    cost = measure_bucket(args_of(runner, make_inputs=lambda b: inputs), runner.captured, Bucket(4))
    assert cost == BucketCost(Bucket(4), 1, 2, 3, 4.0)
    ((bucket, out, used),) = seen
    assert bucket == Bucket(4) and used is stream
    assert torch.equal(out, forward(**inputs))


class FakeBar:
    def __init__(self):
        self.updates, self.closed = 0, False

    def update(self, n):
        self.updates += n

    def close(self):
        self.closed = True


def test_the_progress_bar_counts_the_buckets_the_plan_kept(monkeypatch):
    bars = []

    def progress_bar(progress, total, what):
        bars.append(((progress, total, what), FakeBar()))
        return bars[-1][1]

    monkeypatch.setattr(startup, "progress_bar", progress_bar)
    runner = make_runner(backend=eager_backend(), require_all_buckets=False)
    runner.capture(
        dummy, plan_memory=True, free_bytes=134 * MIB, measure=synthetic_cost, progress=True
    )
    ((args, bar),) = bars
    assert args == (True, 5, "capturing buckets")
    assert bar.updates == 5 and bar.closed
