"""GraphRunner's bucket walk, dropping, staging and dispatch on the CPU, with an eager
stand-in for CUDA capture (a "graph" that re-runs the function into the captured
output buffers)."""

import pytest
import torch

from cudagraphs.errors import CudaGraphCaptureError, CudaGraphInputError, CudaGraphsStateError
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec
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


def test_captures_largest_first_and_replays_every_padded_size():
    backend = eager_backend()
    runner = make_runner(backend=backend)
    runner.capture(dummy)
    assert backend.captured == [str(Bucket(b)) for b in (64, 32, 16, 8, 4, 2, 1)]
    for n in (1, 3, 5, 8, 33, 64):
        inputs = batch(n, seed=n)
        out = runner.run(inputs)
        assert out.shape == (n, HIDDEN)
        assert torch.equal(out, forward(**inputs)), n
    stats = runner.stats()
    assert stats["replays"][str(Bucket(4))] == 1 and stats["replays"][str(Bucket(64))] == 2
    assert stats["eager_runs"] == {}


def test_outputs_are_borrowed_unless_copied():
    runner = make_runner()
    runner.capture(dummy)
    first = runner.run(batch(3, seed=1))
    kept = first.clone()
    owned = runner.run(batch(3, seed=1), copy_output=True)
    runner.run(batch(3, seed=2))
    assert not torch.equal(first, kept)  # overwritten by the next replay of bucket 4
    assert torch.equal(owned, kept)


def test_batches_no_bucket_fits_run_eagerly_and_are_counted():
    specs = [InputSpec("x", (4, HIDDEN), torch.float32), InputSpec("scale", (4, 1), torch.float32)]
    runner = GraphRunner(
        forward,
        specs,
        BucketConfig(batch_sizes=(1, 2, 4), max_pad_ratio=0.3),
        device="cpu",
        capture_backend=eager_backend(),
    )
    runner.capture(dummy)
    assert runner.select(3) == Bucket(4)  # 25% padding: allowed
    assert runner.select(1) == Bucket(1)
    assert runner.select(5) is None  # larger than every bucket
    assert torch.equal(runner.run(batch(3)), forward(**batch(3)))
    assert torch.equal(runner.run(batch(5)), forward(**batch(5)))
    assert runner.stats()["eager_runs"] == {"too_large": 1}


def test_wasteful_padding_runs_eagerly():
    runner = make_runner(BucketConfig(max_pad_ratio=0.3))
    runner.capture(dummy)
    assert runner.select(5) is None  # 8 rows for 5: 37.5% padding
    assert torch.equal(runner.run(batch(5)), forward(**batch(5)))
    assert runner.stats()["eager_runs"] == {"pad_ratio": 1}


def test_a_failed_bucket_is_dropped_and_the_rest_serve():
    backend = eager_backend(fail_on=[Bucket(8)])
    runner = make_runner(backend=backend, require_all_buckets=False)
    runner.capture(dummy)
    assert Bucket(8) in runner.dropped_buckets
    assert "operation not permitted" in runner.dropped_buckets[Bucket(8)]
    assert runner.select(5) == Bucket(16)  # 8 is gone: the next one up
    assert torch.equal(runner.run(batch(5)), forward(**batch(5)))


def test_dropped_buckets_can_be_a_startup_error(monkeypatch):
    runner = make_runner(backend=eager_backend(fail_on=[Bucket(2)]), require_all_buckets=True)
    with pytest.raises(CudaGraphCaptureError, match=r"bucket\(bs=2\): RuntimeError"):
        runner.capture(dummy)
    monkeypatch.setenv("CUDAGRAPHS_REQUIRE_ALL_BUCKETS", "1")
    runner = make_runner(backend=eager_backend(fail_on=[Bucket(2)]))
    with pytest.raises(CudaGraphCaptureError, match="dropped at startup"):
        runner.capture(dummy)


def test_bad_inputs_name_the_input_and_the_bucket_and_stage_nothing():
    runner = make_runner()
    runner.capture(dummy)
    runner.run(batch(4, seed=3))
    before = runner.static.view("x", 64).clone()
    bad = batch(4)
    bad["x"] = bad["x"].double()
    with pytest.raises(
        CudaGraphInputError,
        match=r"bucket\(bs=4\)[\s\S]*inputs\['x'\]: dtype expected torch.float32, received torch.float64",
    ):
        runner.run(bad)
    with pytest.raises(CudaGraphInputError, match=r"Missing inputs: \['scale'\]"):
        runner.run({"x": torch.zeros(4, HIDDEN)})
    assert torch.equal(runner.static.view("x", 64), before)


def test_rows_must_agree_across_inputs():
    runner = make_runner()
    runner.capture(dummy)
    with pytest.raises(
        CudaGraphInputError,
        match=r"row counts expected one count for all, received \{'x': 4, 'scale': 3\}",
    ):
        runner.run({"x": torch.zeros(4, HIDDEN), "scale": torch.ones(3, 1)})


def test_run_before_capture_and_close():
    runner = make_runner()
    with pytest.raises(CudaGraphsStateError, match=r"run\(\) before capture\(\)"):
        runner.run(batch(2))
    runner.capture(dummy)
    graphs = [g.graph for g in runner.graphs.values()]
    runner.close()
    runner.close()
    assert all(g.was_reset for g in graphs)
    with pytest.raises(CudaGraphsStateError, match="capture"):
        runner.run(batch(2))


def test_memory_plan_drops_the_expensive_buckets_before_capture():
    backend = eager_backend()
    runner = make_runner(backend=backend, require_all_buckets=False)
    mib = 1 << 20
    # 64 MiB kept for the largest eager step; 70 MiB left fit the 16-row pool (64 MiB)
    # plus executable memory, not the 32-row one (128 MiB).
    runner.capture(dummy, plan_memory=True, free_bytes=134 * mib, measure=synthetic_cost)
    assert backend.captured == [str(Bucket(b)) for b in (16, 8, 4, 2, 1)]
    assert set(runner.dropped_buckets) == {Bucket(64), Bucket(32)}
    assert all(
        why.startswith("memory plan: does not fit") for why in runner.dropped_buckets.values()
    )
    assert runner.memory_plan.chosen == tuple(Bucket(b) for b in (16, 8, 4, 2, 1))
    assert runner.select(20) is None  # runs eagerly now
    assert torch.equal(runner.run(batch(20)), forward(**batch(20)))


def test_memory_plan_with_room_for_everything_keeps_every_bucket():
    backend = eager_backend()
    runner = make_runner(backend=backend)
    runner.capture(dummy, plan_memory=True, free_bytes=1 << 40, measure=synthetic_cost)
    assert len(backend.captured) == 7 and runner.dropped_buckets == {}


def test_static_outputs_option_selects_the_copying_capture():
    from cudagraphs.serving.graphs import default_backend, static_outputs_backend

    specs = [InputSpec("x", (4, HIDDEN), torch.float32)]
    config = BucketConfig(batch_sizes=(2, 4))
    assert (
        GraphRunner(forward, specs, config, device="cpu", static_outputs=True).backend
        is static_outputs_backend
    )
    assert GraphRunner(forward, specs, config, device="cpu").backend is default_backend


def test_double_buffered_slots_alternate_and_plan_runs_before_each_replay():
    backend = eager_backend()
    planned = []
    specs = [InputSpec("x", (8, HIDDEN), torch.float32), InputSpec("scale", (8, 1), torch.float32)]

    def plan(bucket, slot):
        # runs outside the graph, after staging: the slot's buffers hold this step's rows
        planned.append((str(bucket), slot, runner.slot_inputs[slot].view("x", 2)[0, 0].item()))

    runner = GraphRunner(
        forward,
        specs,
        BucketConfig(batch_sizes=(2, 8)),
        device="cpu",
        capture_backend=backend,
        slots=2,
        plan=plan,
    )
    runner.capture(dummy)
    assert backend.captured == [
        "bucket(bs=8) slot 0",
        "bucket(bs=8) slot 1",
        "bucket(bs=2) slot 0",
        "bucket(bs=2) slot 1",
    ]
    outs = []
    for seed in range(3):
        inputs = batch(2, seed=seed)
        outs.append(runner.run(inputs, copy_output=True))
        assert torch.equal(outs[-1], forward(**inputs))
    assert [(b, s) for b, s, _ in planned] == [
        ("bucket(bs=2)", 0),
        ("bucket(bs=2)", 1),
        ("bucket(bs=2)", 0),
    ]
    assert [v for *_, v in planned] == [batch(2, seed=s)["x"][0, 0].item() for s in range(3)]
    # the two slots have their own buffers
    assert (
        runner.slot_inputs[0].view("x", 8).data_ptr()
        != runner.slot_inputs[1].view("x", 8).data_ptr()
    )


def test_a_slot_failing_drops_its_bucket_and_releases_the_other_slot():
    captured_graphs = []

    def backend(run, pool, what):
        if what == "bucket(bs=2) slot 1":
            raise RuntimeError("boom")
        out = run()
        g = EagerGraph(run, out)
        captured_graphs.append((what, g))
        return g, out

    specs = [InputSpec("x", (8, HIDDEN), torch.float32), InputSpec("scale", (8, 1), torch.float32)]
    runner = GraphRunner(
        forward,
        specs,
        BucketConfig(batch_sizes=(2, 8)),
        device="cpu",
        capture_backend=backend,
        slots=2,
        require_all_buckets=False,
    )
    runner.capture(dummy)
    assert list(runner.dropped_buckets) == [Bucket(2)]
    slot0 = dict(captured_graphs)["bucket(bs=2) slot 0"]
    assert slot0.was_reset


def test_slots_must_be_positive():
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        GraphRunner(forward, [InputSpec("x", (4, HIDDEN), torch.float32)], device="cpu", slots=0)


def test_compiled_forward_serves_buckets_and_eager_runs_stay_eager():
    calls = []

    def traced_forward(x, scale):
        calls.append(x.shape[0])
        return forward(x, scale)

    specs = [InputSpec("x", (4, HIDDEN), torch.float32), InputSpec("scale", (4, 1), torch.float32)]
    runner = GraphRunner(
        traced_forward,
        specs,
        BucketConfig(batch_sizes=(2, 4)),
        device="cpu",
        capture_backend=eager_backend(),
        compile_options={"backend": "eager"},
    )
    assert runner.forward is not traced_forward and runner.eager_forward is traced_forward
    runner.capture(dummy)
    assert torch.equal(runner.run(batch(3)), forward(**batch(3)))
    calls.clear()
    runner.run(batch(5))  # no bucket: the eager function, not the compiled one
    assert calls == [5]


@pytest.mark.parametrize("batch_size", [None, 2])
def test_an_empty_batch_is_an_input_error_and_the_next_batch_runs(batch_size):
    # A rank with nothing to serve, say: refused by name, not by an assert when
    # staging (which python -O would strip, staging zero rows).
    from cudagraphs.serving.graphs import eager_backend

    runner = GraphRunner(
        lambda x: x * 2,
        [InputSpec("x", (4, 3), torch.float32)],
        BucketConfig(batch_sizes=(1, 2, 4)),
        device="cpu",
        capture_backend=eager_backend,
    )
    runner.capture(lambda b: {"x": torch.ones(b.rows, 3)})
    with pytest.raises(CudaGraphInputError, match="rows"):
        runner.run({"x": torch.zeros(0, 3)}, batch_size=batch_size)
    x = torch.ones(2, 3)
    assert torch.equal(runner.run({"x": x}), x * 2)
