"""The serving runner's contract on the CPU: what its outputs are, the memory plan, when
and why it runs eagerly, and the environment flags."""

import logging

import pytest
import torch

from cudagraphs.errors import (
    CudaGraphCaptureError,
    CudaGraphOutputError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
)
from cudagraphs.serving import (
    STRICT_BUCKETS_ENV,
    Bucket,
    BucketConfig,
    BucketCost,
    check_dropped_buckets,
)
from cudagraphs.settings import DISABLE_ENV
from cudagraphs.settings import STRICT_BUCKETS_ENV as SETTINGS_STRICT_ENV
from helpers.serving_contract import (
    RUNNER_LOG,
    SMALL,
    small_runner,
    tree_backend,
    warnings_about,
)
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


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(STRICT_BUCKETS_ENV, raising=False)


# --------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("row_dim", [1, -1])
def test_output_row_dim_that_misses_the_rows_is_refused_at_capture(row_dim):
    backend = eager_backend()
    runner = make_runner(backend=backend, output_row_dim=row_dim, require_all_buckets=False)
    with pytest.raises(
        CudaGraphOutputError,
        match=(
            rf"outputs of bucket\(bs=64\) do not hold its 64 rows in output_row_dim={row_dim}"
            rf"[\s\S]*output: shape expected 64 rows in dim {row_dim}, received \(64, 4\)"
            r"[\s\S]*1\. set output_row_dim to the dimension holding the rows"
            r"[\s\S]*2\. return only row-wise outputs"
        ),
    ):
        runner.capture(dummy)
    # A configuration error: raised, not a dropped bucket; the runner is not captured.
    assert runner.dropped_buckets == {}
    assert runner.graphs == {}
    with pytest.raises(CudaGraphsStateError, match="before capture"):
        runner.run(batch(3))


def test_output_error_names_every_bad_leaf_by_path():
    def tree_forward(x, scale):
        y = x * scale
        return {"logits": y, "total": y.sum(), "pair": (y, y[0, :3])}

    runner = small_runner(tree_forward, eager_backend())
    with pytest.raises(CudaGraphOutputError) as info:
        runner.capture(dummy)
    msg = str(info.value)
    assert "outputs of bucket(bs=4)" in msg and "in 2 place(s)" in msg
    assert "output['total']: shape expected 4 rows in dim 0, received ()" in msg
    assert "output['pair'][1]: shape expected 4 rows in dim 0, received (3,)" in msg
    assert "output['logits']" not in msg


def test_output_error_at_a_smaller_bucket_releases_the_graphs_already_captured():
    made = []

    def backend(run, pool, what):
        out = run()
        if what == "bucket(bs=2)":
            out = out.t()  # [hidden, rows]: the rows are in dim 1 here only
        graph = EagerGraph(run, out)
        made.append(graph)
        return graph, out

    runner = small_runner(backend=backend, require_all_buckets=False)
    with pytest.raises(CudaGraphOutputError, match=r"outputs of bucket\(bs=2\)[\s\S]*\(4, 2\)"):
        runner.capture(dummy)
    assert len(made) == 2 and all(g.was_reset for g in made)
    assert runner.graphs == {} and runner.static is None
    # Capture is a transaction: a correct backend captures the same runner afterwards.
    runner.backend = eager_backend()
    runner.capture(dummy)
    assert torch.equal(runner.run(batch(3)), forward(**batch(3)))


def test_every_slot_output_is_checked():
    def backend(run, pool, what):
        out = run()
        if what == "bucket(bs=2) slot 1":
            out = out[:1]
        return EagerGraph(run, out), out

    runner = small_runner(backend=backend, slots=2)
    with pytest.raises(CudaGraphOutputError, match=r"outputs of bucket\(bs=2\) slot 1"):
        runner.capture(dummy)


@pytest.mark.parametrize("row_dim", [1, -1])
def test_a_correct_output_row_dim_cuts_the_real_rows(row_dim):
    def transposed(x, scale):
        return (x * scale + 1.0).t(), None, 7  # [hidden, rows] and non-tensor leaves

    runner = small_runner(transposed, tree_backend, output_row_dim=row_dim)
    runner.capture(dummy)
    # Worked out at capture: leaf 0 is cut in dim 1 (a negative dim normalized).
    assert runner.graphs[Bucket(4)].slots[0].narrow == ((0, 1),)
    for n in (1, 3, 4):
        got, none, seven = runner.run(batch(n, seed=n))
        assert got.shape == (HIDDEN, n)
        assert torch.equal(got, transposed(**batch(n, seed=n))[0])
        assert none is None and seven == 7
    assert runner.stats()["replays"] == {"bucket(bs=4)": 2, "bucket(bs=2)": 0, "bucket(bs=1)": 1}


def test_full_bucket_output_is_the_graph_output_unless_copied():
    runner = small_runner(backend=eager_backend())
    runner.capture(dummy)
    out = runner.run(batch(4))
    assert out is runner.graphs[Bucket(4)].output
    owned = runner.run(batch(4), copy_output=True)
    assert owned.data_ptr() != out.data_ptr() and torch.equal(owned, out)


# --------------------------------------------------------------------------- memory plan


def failing_measure(fail_at, exc=None):
    exc = exc or RuntimeError("operation not permitted when stream is capturing")

    def measure(bucket):
        if bucket == fail_at:
            raise exc
        return synthetic_cost(bucket)

    return measure


def test_a_bucket_whose_measurement_fails_is_dropped_and_the_rest_planned(caplog):
    caplog.set_level(logging.ERROR, logger=RUNNER_LOG)
    backend = eager_backend()
    runner = make_runner(backend=backend, require_all_buckets=False)
    runner.capture(dummy, plan_memory=True, free_bytes=1 << 40, measure=failing_measure(Bucket(8)))
    assert list(runner.dropped_buckets) == [Bucket(8)]
    assert runner.dropped_buckets[Bucket(8)] == (
        "memory measurement failed: RuntimeError: operation not permitted when stream is capturing"
    )
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "dropping bucket(bs=8): memory measurement failed" in (
        errors[0].getMessage()
    )
    assert Bucket(8) not in runner.memory_plan.chosen
    assert Bucket(8) not in runner.memory_plan.dropped
    assert backend.captured == [str(Bucket(b)) for b in (64, 32, 16, 4, 2, 1)]
    assert runner.select(5) == Bucket(16)
    assert torch.equal(runner.run(batch(5)), forward(**batch(5)))


def test_failing_dummy_inputs_during_measurement_drop_the_bucket():
    def make_inputs(bucket):
        if bucket == Bucket(2):
            raise ValueError("no dummy batch of 2")
        return dummy(bucket)

    runner = make_runner(require_all_buckets=False)
    runner.capture(make_inputs, plan_memory=True, free_bytes=1 << 40, measure=synthetic_cost)
    assert runner.dropped_buckets == {
        Bucket(2): "memory measurement failed: ValueError: no dummy batch of 2"
    }
    assert len(runner.graphs) == 6


def test_a_failed_measurement_is_a_startup_error_when_all_buckets_are_required():
    runner = make_runner(require_all_buckets=True)
    with pytest.raises(
        CudaGraphCaptureError, match=r"bucket\(bs=4\): memory measurement failed: KeyError"
    ):
        runner.capture(
            dummy,
            plan_memory=True,
            free_bytes=1 << 40,
            measure=failing_measure(Bucket(4), KeyError("x")),
        )
    assert runner.graphs == {}  # the captured buckets were released


def test_measure_must_return_a_bucket_cost():
    runner = make_runner()
    with pytest.raises(CudaGraphsTypeError, match=r"measure\(bucket\(bs=64\)\) must return"):
        runner.capture(dummy, plan_memory=True, free_bytes=1 << 40, measure=lambda b: 3)


def test_memory_plan_off_cuda_needs_measure_and_free_bytes():
    runner = make_runner()
    with pytest.raises(CudaGraphsValueError, match="measure= and free_bytes="):
        runner.capture(dummy, plan_memory=True, measure=synthetic_cost)
    assert isinstance(synthetic_cost(Bucket(1)), BucketCost)


# --------------------------------------------------------------------------- eager runs


def test_batches_larger_than_every_bucket_warn_once_and_count_all(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = small_runner(backend=eager_backend())
    runner.capture(dummy)
    for n in (5, 6, 9):
        assert torch.equal(runner.run(batch(n, seed=n)), forward(**batch(n, seed=n)))
    said = warnings_about(caplog, "fits no captured bucket")
    assert len(said) == 1 and "a batch of 5" in said[0].getMessage()
    assert "bucket(bs=4)" in said[0].getMessage()
    assert runner.stats()["eager_runs"] == {"too_large": 3}
    assert runner.eager_runs["too_large"] == 3


def test_batches_refused_by_max_pad_ratio_warn_once_and_count_all(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = make_runner(BucketConfig(max_pad_ratio=0.3), backend=eager_backend())
    runner.capture(dummy)
    for _ in range(3):
        assert torch.equal(runner.run(batch(5)), forward(**batch(5)))
    said = warnings_about(caplog, "max_pad_ratio=0.3")
    assert len(said) == 1
    assert runner.stats()["eager_runs"] == {"pad_ratio": 3}


def test_a_runner_with_no_bucket_says_so_at_capture_and_counts_its_runs(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = small_runner(backend=eager_backend(fail_on=SMALL.buckets()), require_all_buckets=False)
    runner.capture(dummy)
    said = warnings_about(caplog, "no bucket was captured (3 dropped")
    assert len(said) == 1
    for n in (1, 3, 7):
        assert torch.equal(runner.run(batch(n)), forward(**batch(n)))
    assert len(warnings_about(caplog, "runs eagerly")) == 1
    assert runner.stats()["eager_runs"] == {"no_graphs": 3}


def test_num_tokens_without_token_buckets_is_accepted_and_said_once(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = small_runner(backend=eager_backend())
    runner.capture(dummy)
    for _ in range(3):
        assert torch.equal(runner.run(batch(3), num_tokens=3), forward(**batch(3)))
    said = warnings_about(caplog, "run(num_tokens=3) is ignored")
    assert len(said) == 1
    stats = runner.stats()
    assert stats["ignored_arguments"] == {"num_tokens": 3}
    assert stats["eager_runs"] == {} and stats["replays"]["bucket(bs=4)"] == 3


def test_each_cause_is_said_once_per_runner(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runners = [
        small_runner(backend=eager_backend(), config=BucketConfig((1, 2, 4), max_pad_ratio=0.3))
        for _ in range(2)
    ]
    for runner in runners:
        runner.capture(dummy)
        for n in (5, 3, 5, 3):  # 5: too large; 3 on bucket 4: 25% padding, allowed
            runner.run(batch(n))
        runner.run(batch(1), num_tokens=1)
    assert len(warnings_about(caplog, "fits no captured bucket")) == 2
    assert len(warnings_about(caplog, "is ignored")) == 2
    assert runners[0].stats()["eager_runs"] == {"too_large": 2}


# --------------------------------------------------------------------------- env flags


def test_strict_buckets_env_is_defined_in_settings_and_reexported():
    assert STRICT_BUCKETS_ENV is SETTINGS_STRICT_ENV == "CUDAGRAPHS_REQUIRE_ALL_BUCKETS"


@pytest.mark.parametrize("value", ["on", "yes", "YES"])
def test_strict_buckets_env_accepts_every_true_spelling(monkeypatch, value):
    monkeypatch.setenv(STRICT_BUCKETS_ENV, value)
    with pytest.raises(CudaGraphCaptureError, match=r"bucket\(bs=4\): boom"):
        check_dropped_buckets({Bucket(4): "boom"})


@pytest.mark.parametrize("value", ["off", "no", "False"])
def test_strict_buckets_env_accepts_every_false_spelling(monkeypatch, value):
    monkeypatch.setenv(STRICT_BUCKETS_ENV, value)
    check_dropped_buckets({Bucket(4): "boom"})


@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_strict_buckets_env_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv(STRICT_BUCKETS_ENV, value)
    with pytest.raises(CudaGraphsValueError, match=rf"CUDAGRAPHS_REQUIRE_ALL_BUCKETS='{value}'"):
        check_dropped_buckets({Bucket(4): "boom"})
    runner = small_runner(backend=eager_backend())
    with pytest.raises(CudaGraphsValueError, match="CUDAGRAPHS_REQUIRE_ALL_BUCKETS"):
        runner.capture(dummy)
    assert runner.graphs == {}
