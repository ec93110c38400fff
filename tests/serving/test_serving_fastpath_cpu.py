"""GraphRunner's per-step fast path on the CPU: a batch matching the specs exactly is
staged and returned from what its row count worked out once; it must write and return
what the full path does, and anything else must take the full path (its checks, its
errors, its conversions)."""

import types

import pytest
import torch

from cudagraphs.errors import CudaGraphInputError
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec, StaticInputs, call_path

HIDDEN = 3
MAX = 16


class CountingGraph:
    """An eager stand-in that re-runs forward into the captured output on replay."""

    def __init__(self, run, output):
        self.run, self.output, self.replays = run, output, 0

    def replay(self):
        self.replays += 1
        with torch.no_grad():
            self.output.copy_(self.run())

    def reset(self):
        pass


def backend(run, pool, what):
    out = run()
    return CountingGraph(run, out), out


def forward(x, ids, mask):
    # x: [rows, HIDDEN]; ids: [rows]; mask: [2, rows] (row_dim 1, pad value 1)
    return x * ids.unsqueeze(-1) + mask.sum(0, keepdim=True).T


SPECS = [
    InputSpec("x", (MAX, HIDDEN), torch.float32),
    InputSpec("ids", (MAX,), torch.int64, pad_value=-1),
    InputSpec("mask", (2, MAX), torch.float32, row_dim=1, pad_value=1),
]


def make_runner(config=None, **kw):
    runner = GraphRunner(
        forward,
        SPECS,
        config or BucketConfig(batch_sizes=(1, 2, 4, 8, 16)),
        device="cpu",
        capture_backend=backend,
        **kw,
    )
    runner.capture(lambda b: batch(b.rows, seed=100 + b.rows), warmup=0)
    return runner


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, HIDDEN, generator=g),
        "ids": torch.randint(0, 9, (n,), generator=g),
        "mask": torch.rand(2, n, generator=g),
    }


def storage(runner, slot=0):
    static = runner.slot_inputs[slot]
    return {name: static.view(name, MAX).clone() for name in static.specs}


def test_the_fast_path_writes_and_returns_what_the_full_path_does():
    fast, full = make_runner(), make_runner()
    for n in (3, 16, 1, 3, 5, 8, 2, 3):  # padded, full, repeated row counts
        inputs = batch(n, seed=n)
        got = fast.run(inputs)
        want = full.run(inputs, batch_size=n)  # batch_size= takes the full path
        assert n in fast.replay_steps and not full.replay_steps
        assert torch.equal(got, want) and torch.equal(got, forward(**inputs))
        for name, t in storage(fast).items():
            assert torch.equal(t, storage(full)[name]), (n, name)
    assert without_times(fast.stats()) == without_times(full.stats())


def test_padding_rows_are_reset_on_the_fast_path():
    runner = make_runner()
    runner.run(batch(8, seed=1))  # every row of bucket 8 real
    runner.run(batch(5, seed=2))  # rows 5..7 are padding now
    static = runner.static
    assert torch.equal(static.view("x", 8)[5:], torch.zeros(3, HIDDEN))
    assert torch.equal(static.view("ids", 8)[5:], torch.full((3,), -1))
    assert torch.equal(static.view("mask", 8)[:, 5:], torch.ones(2, 3))
    assert torch.equal(static.view("x", 5), batch(5, seed=2)["x"])
    assert torch.equal(static.view("mask", 5), batch(5, seed=2)["mask"])


def test_the_fast_path_replays_the_tightest_bucket():
    runner = make_runner()
    graphs = {b: entry.graph for b, entry in runner.graphs.items()}
    runner.run(batch(3))
    runner.run(batch(3, seed=1))
    assert graphs[Bucket(4)].replays == 2
    assert sum(g.replays for g in graphs.values()) == 2
    assert runner.stats()["replays"][str(Bucket(4))] == 2


def test_output_views_are_kept_per_row_count_and_still_borrowed():
    runner = make_runner()
    first = runner.run(batch(3, seed=1))
    kept = first.clone()
    again = runner.run(batch(3, seed=2))
    assert again is first  # the same view object: borrowed, overwritten by the replay
    assert not torch.equal(first, kept)
    assert torch.equal(again, forward(**batch(3, seed=2)))
    owned = runner.run(batch(3, seed=1), copy_output=True)
    assert owned is not first and torch.equal(owned, kept)
    runner.run(batch(3, seed=2))
    assert torch.equal(owned, kept)  # owned copies are not overwritten


def test_a_lossless_dtype_takes_the_full_path_and_is_converted():
    runner = make_runner()
    inputs = batch(3)
    inputs["ids"] = inputs["ids"].int()
    assert runner.static.exact_rows(inputs) is None
    assert torch.equal(runner.run(inputs), forward(**batch(3)))
    assert 3 not in runner.replay_steps


def test_other_mappings_take_the_full_path():
    runner = make_runner()
    inputs = types.MappingProxyType(batch(5))
    assert torch.equal(runner.run(inputs), forward(**batch(5)))
    assert 5 not in runner.replay_steps


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: b.update(extra=torch.zeros(3)), r"Unknown inputs: \['extra'\]"),
        (lambda b: b.pop("mask"), r"Missing inputs: \['mask'\]"),
        (
            lambda b: b.update(x=b["x"].double()),
            r"inputs\['x'\]: dtype expected torch.float32, received torch.float64",
        ),
        (
            lambda b: b.update(x=torch.zeros(3, HIDDEN + 1)),
            r"inputs\['x'\]: shape expected \(3, 3\), received \(3, 4\)",
        ),
        (
            lambda b: b.update(mask=torch.zeros(2, 4)),
            r"row counts expected one count for all",
        ),
        (lambda b: b.update(ids=[1, 2, 3]), r"inputs\['ids'\]: type expected 'Tensor'"),
    ],
)
def test_a_batch_that_does_not_match_gets_the_full_paths_error(change, match):
    runner = make_runner()
    runner.run(batch(3))  # the row count has a fast step already
    before = storage(runner)
    bad = batch(3, seed=1)
    change(bad)
    assert runner.static.exact_rows(bad) is None
    with pytest.raises(CudaGraphInputError, match=match):
        runner.run(bad)
    for name, t in storage(runner).items():
        assert torch.equal(t, before[name]), name  # nothing staged


def test_batches_no_bucket_serves_run_eagerly_and_are_counted():
    runner = make_runner(BucketConfig(batch_sizes=(2, 4, 16), max_pad_ratio=0.3))
    assert torch.equal(runner.run(batch(1)), forward(**batch(1)))  # pads 50%: eager
    assert torch.equal(runner.run(batch(5)), forward(**batch(5)))  # pads 69%: eager
    assert runner.stats()["eager_runs"] == {"pad_ratio": 2}
    assert 1 not in runner.replay_steps and 5 not in runner.replay_steps
    assert torch.equal(runner.run(batch(3)), forward(**batch(3)))  # 25%: replayed
    assert 3 in runner.replay_steps
    assert runner.stats()["replays"][str(Bucket(4))] == 1


def test_token_buckets_take_the_full_path():
    specs = [InputSpec("x", (8, HIDDEN), torch.float32)]
    runner = GraphRunner(
        lambda x: x * 2,
        specs,
        BucketConfig(batch_sizes=(1, 2), token_counts={2: (4, 8)}),
        device="cpu",
        capture_backend=backend,
    )
    runner.capture(lambda b: {"x": torch.ones(b.rows, HIDDEN)}, warmup=0)
    x = torch.randn(3, HIDDEN)
    assert torch.equal(runner.run({"x": x}, batch_size=2, num_tokens=3), x * 2)
    assert not runner.replay_steps


def test_rank_agreement_takes_the_full_path(monkeypatch):
    runner = make_runner()
    monkeypatch.setattr(call_path, "is_distributed", lambda group=None: True)
    monkeypatch.setattr(call_path, "agree_on_batch_size", lambda n, group=None: 7)
    inputs = batch(3)
    assert torch.equal(runner.run(inputs), forward(**inputs))
    assert runner.stats()["replays"][str(Bucket(8))] == 1  # the agreed size's bucket
    assert not runner.replay_steps


def test_double_buffered_slots_alternate_on_the_fast_path():
    planned = []
    runner = make_runner(
        BucketConfig(batch_sizes=(4, 16)), slots=2, plan=lambda b, s: planned.append(s)
    )
    for seed in range(3):
        assert torch.equal(runner.run(batch(3, seed=seed)), forward(**batch(3, seed=seed)))
    assert planned == [0, 1, 0]
    assert torch.equal(runner.slot_inputs[1].view("x", 3), batch(3, seed=1)["x"])
    assert torch.equal(runner.slot_inputs[0].view("x", 3), batch(3, seed=2)["x"])


def test_close_forgets_the_steps_and_a_new_capture_serves():
    runner = make_runner()
    runner.run(batch(3))
    runner.close()
    assert not runner.replay_steps
    runner.capture(lambda b: batch(b.rows), warmup=0)
    assert torch.equal(runner.run(batch(3, seed=4)), forward(**batch(3, seed=4)))


def test_exact_rows_recognises_only_exact_batches():
    static = StaticInputs(SPECS, MAX, "cpu")
    assert static.exact_rows(batch(5)) == 5
    assert static.exact_rows(batch(MAX)) == MAX
    for bad in (
        batch(MAX + 1),  # more rows than the buffers
        {"x": torch.zeros(0, HIDDEN), "ids": torch.zeros(0).long(), "mask": torch.zeros(2, 0)},
        {**batch(2), "x": torch.zeros(2, HIDDEN, device="meta")},  # another device
        {**batch(2), "ids": torch.zeros(2, 1).long()},  # another rank
        {**batch(2), "x": "not a tensor"},
        {"x": batch(2)["x"], "ids": batch(2)["ids"], "other": torch.zeros(2, 2)},
        [batch(2)],
        None,
    ):
        assert static.exact_rows(bad) is None


def test_staging_plans_are_made_once_and_write_what_stage_writes():
    a, b = StaticInputs(SPECS, MAX, "cpu"), StaticInputs(SPECS, MAX, "cpu")
    assert a.staging(Bucket(8), 5) is a.staging(Bucket(8), 5)
    inputs = batch(5, seed=3)
    a.stage(inputs, Bucket(8), 5)
    b.staging(Bucket(8), 5).write(inputs)
    for name in a.specs:
        assert torch.equal(a.view(name, MAX), b.view(name, MAX)), name
    assert torch.equal(a.view("ids", 8)[5:], torch.full((3,), -1))


def test_exact_rows_builds_what_a_row_count_must_match_once():
    # Nothing per call that could be done once: the expected shapes of a row count are
    # built on its first batch and reused by every later one.
    static = StaticInputs(SPECS, MAX, "cpu")
    assert static.exact_rows(batch(5)) == 5
    first = static._exact[5]
    assert static.exact_rows(batch(5, seed=1)) == 5
    assert static._exact[5] is first


def test_an_exact_fit_pads_nothing_and_the_plan_cache_is_bounded(monkeypatch):
    from cudagraphs.serving import static_inputs

    static = StaticInputs(SPECS, MAX, "cpu")
    plan = static.staging(Bucket(8), 8)
    assert plan.zeros == () and plan.fills == (), "a full bucket has no padding rows"
    padded = static.staging(Bucket(8), 5)
    assert len(padded.zeros) + len(padded.fills) == len(SPECS)
    monkeypatch.setattr(static_inputs, "PLAN_CACHE_SIZE", 3)
    fresh = StaticInputs(SPECS, MAX, "cpu")
    for rows in range(1, 7):
        fresh.staging(Bucket(8), rows)
    assert len(fresh._plans) == 3, "at most PLAN_CACHE_SIZE plans are kept"
    assert fresh.staging(Bucket(8), 6) is not fresh.staging(Bucket(8), 6), "past the bound"
    with pytest.raises(AssertionError):
        fresh.staging(Bucket(8), 0)  # rows are 1..bucket.rows (validate checks first)


def without_times(stats):
    """Stats without the capture seconds (host wall time, different in every run)."""
    return {k: v for k, v in stats.items() if k != "capture_seconds"}
