"""GraphRunner details on the CPU that the broader tests leave open: the config's
error hint, what a runner holds before capture and after close, the defaults of
capture() as they act, compile_options reaching torch.compile, the fast path's plan
made once per row count, slots taken in turn, and stats() naming dropped buckets."""

import re

import pytest
import torch

from cudagraphs.errors import CudaGraphCaptureError, CudaGraphsTypeError
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec, plan_buckets
from cudagraphs.serving.call_path import CallPath
from cudagraphs.serving.static_inputs import StaticInputs
from helpers.serving_runner import (
    HIDDEN,
    EagerGraph,
    batch,
    dummy,
    eager_backend,
    forward,
    make_runner,
    synthetic_cost,
)


@pytest.mark.parametrize(
    "config, hint",
    [
        (8, "BucketConfig(batch_sizes=(1, 2, 4))"),
        ("1,2", "BucketConfig(batch_sizes=(1, 2, 4))"),
        ([1, "2"], "BucketConfig(batch_sizes=(1, 2, 4))"),
        ([1, 8], "BucketConfig(batch_sizes=(1, 8))"),
    ],
)
def test_a_config_that_is_not_a_bucket_config_gets_a_hint(config, hint):
    with pytest.raises(CudaGraphsTypeError, match=re.escape(f"; pass {hint}")):
        make_runner(config=config)


def test_before_capture_nothing_is_planned_staged_or_disabled():
    runner = make_runner()
    assert runner.memory_plan is None and runner.memory_used is None
    assert runner.slot_inputs == [] and runner.static is None
    stats = runner.stats()
    assert stats["disabled"] is False and stats["captured"] == [] and stats["dropped"] == {}


def test_close_leaves_empty_containers_and_capture_works_again():
    runner = make_runner()
    runner.capture(dummy)
    runner.run(batch(3))
    runner.close()
    assert runner.slot_inputs == [] and runner.replay_steps == {} and runner.graphs == {}
    runner.capture(dummy)
    assert torch.equal(runner.run(batch(3)), forward(**batch(3)))


def runner_of(batch_sizes, fn=forward, **kw):
    """A runner over buffers of the largest batch size's rows, with the eager stand-in."""
    rows = max(batch_sizes)
    specs = [
        InputSpec("x", (rows, HIDDEN), torch.float32),
        InputSpec("scale", (rows, 1), torch.float32, pad_value=0),
    ]
    config = BucketConfig(batch_sizes=batch_sizes)
    return GraphRunner(fn, specs, config, device="cpu", capture_backend=eager_backend(), **kw)


def test_capture_defaults_warm_the_first_bucket_twice_and_later_ones_once():
    calls = []

    def counting(x, scale):
        calls.append(x.shape[0])
        return forward(x, scale)

    runner = runner_of((2, 8), counting)
    runner.capture(dummy)
    # Bucket 8: two warmups and the capture's run; bucket 2: one warmup and its run.
    assert calls == [8, 8, 8, 2, 2]
    seconds = runner.stats()["capture_seconds"]
    assert [seconds[str(Bucket(b))]["warmup_runs"] for b in (8, 2)] == [2, 1]


def test_capture_keeps_no_headroom_by_default():
    costs = [synthetic_cost(b) for b in BucketConfig().buckets()]
    roomy = plan_buckets(costs, 1 << 40)
    exact = roomy.eager_reserve_bytes + roomy.predicted_pool_bytes + roomy.predicted_exec_bytes
    runner = make_runner(require_all_buckets=False)
    runner.capture(dummy, plan_memory=True, free_bytes=exact, measure=synthetic_cost)
    assert runner.dropped_buckets == {}, "every bucket fits exactly"
    tight = make_runner(require_all_buckets=False)
    tight.capture(dummy, plan_memory=True, free_bytes=exact - 1, measure=synthetic_cost)
    assert Bucket(64) in tight.dropped_buckets


def test_compile_options_reach_torch_compile(monkeypatch):
    seen = []

    def fake_compile(fn, **options):
        seen.append((fn, options))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    runner = make_runner(compile_options={"fullgraph": True, "dynamic": False})
    assert seen == [(forward, {"fullgraph": True, "dynamic": False})]
    assert runner.forward is forward and runner.compiles


def test_the_fast_path_plans_a_row_count_once_and_skips_the_full_path(monkeypatch):
    runner = make_runner()
    runner.capture(dummy)
    made = []
    real = StaticInputs.staging

    def counting(self, bucket, rows):
        made.append(rows)
        return real(self, bucket, rows)

    def refuse(*args, **kwargs):
        raise AssertionError("an exactly matching batch took the full path")

    monkeypatch.setattr(StaticInputs, "staging", counting)
    monkeypatch.setattr(CallPath, "_run_checked", refuse)
    for seed in range(3):
        inputs = batch(3, seed=seed)
        assert torch.equal(runner.run(inputs), forward(**inputs))
    assert made == [3], "one staging plan for row count 3, reused"


def test_slots_are_taken_in_turn():
    planned = []
    runner = runner_of((4,), slots=3, plan=lambda bucket, slot: planned.append(slot))
    runner.capture(dummy)
    for seed in range(5):
        runner.run(batch(4, seed=seed))
    assert planned == [0, 1, 2, 0, 1]


def test_stats_name_each_dropped_bucket_with_its_reason():
    runner = make_runner(backend=eager_backend(fail_on=[Bucket(8)]), require_all_buckets=False)
    runner.capture(dummy)
    dropped = runner.stats()["dropped"]
    assert list(dropped) == ["bucket(bs=8)"]
    assert "operation not permitted" in dropped["bucket(bs=8)"]


def test_select_before_capture_and_after_close_runs_eagerly():
    runner = make_runner()
    assert runner.select(3) is None and runner.captured is None
    runner.capture(dummy)
    assert runner.select(3) == Bucket(4)
    runner.close()
    assert runner.select(3) is None


def test_the_runner_holds_the_captured_value_and_close_keeps_its_report():
    runner = make_runner(backend=eager_backend(fail_on=[Bucket(8)]), require_all_buckets=False)
    runner.capture(dummy)
    captured, report = runner.captured, runner.report
    assert captured.report is report and captured.static is runner.static
    assert captured.slot_inputs == runner.slot_inputs and captured.graphs is runner.graphs
    assert list(captured.graphs) == [Bucket(b) for b in (64, 32, 16, 4, 2, 1)]
    assert set(report.times) == set(captured.graphs)
    before = runner.stats()
    runner.close()
    assert runner.captured is None and runner.report is report
    after = runner.stats()
    assert after["captured"] == [] and after["replays"] == {}
    for key in ("dropped", "capture_seconds", "disabled", "memory"):
        assert after[key] == before[key], key
    assert list(runner.dropped_buckets) == [Bucket(8)]


def test_a_failed_capture_releases_its_graphs_and_its_report_says_why():
    made = []

    def backend(run, pool, what):
        if what == "bucket(bs=2)":
            raise RuntimeError("operation not permitted when stream is capturing")
        out = run()
        made.append(EagerGraph(run, out))
        return made[-1], out

    runner = make_runner(backend=backend, require_all_buckets=True)
    with pytest.raises(CudaGraphCaptureError, match=r"bucket\(bs=2\): RuntimeError"):
        runner.capture(dummy)
    assert len(made) == 6 and all(g.was_reset for g in made)
    assert runner.captured is None and runner.graphs == {} and runner.static is None
    assert runner.dropped_buckets == {
        Bucket(2): "RuntimeError: operation not permitted when stream is capturing"
    }
    assert set(runner.capture_times) == {Bucket(b) for b in (64, 32, 16, 8, 4, 1)}
    # The next capture starts a report of its own.
    runner.backend = eager_backend()
    runner.capture(dummy)
    assert runner.dropped_buckets == {} and len(runner.graphs) == 7
