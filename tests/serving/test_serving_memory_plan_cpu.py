"""The serving memory plan on the CPU: which buckets fit, in what order they are
dropped, and the sizes it counts."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudagraphs import CudaGraphCaptureError, CudaGraphInputError
from cudagraphs.serving import (
    Bucket,
    BucketCost,
    InputSpec,
    MemoryPlan,
    MemoryUse,
    StaticInputs,
    check_dropped_buckets,
    pad_ratio,
    plan_buckets,
)
from cudagraphs.serving.memory import _size

# --------------------------------------------------------------------------- memory plan


def cost(bs, pool_per_row=100, eager_per_row=10, nodes=10, per_node=1.0):
    return BucketCost(Bucket(bs), bs * eager_per_row, bs * pool_per_row, nodes, per_node)


COSTS = [cost(bs) for bs in (1, 2, 4, 8)]  # pool 100..800, exec 10 each, eager 10..80


def test_bucket_cost_exec_bytes():
    assert BucketCost(Bucket(1), 0, 0, 7, 2.5).exec_bytes == 17


def test_plan_everything_fits():
    plan = plan_buckets(COSTS, 10_000)
    assert plan.chosen == (Bucket(8), Bucket(4), Bucket(2), Bucket(1))
    assert plan.dropped == {}
    assert plan.predicted_pool_bytes == 800  # shared pool: the largest
    assert plan.predicted_exec_bytes == 40  # one executable per graph
    assert plan.predicted_bytes == 840
    assert plan.eager_reserve_bytes == 80
    assert plan.budget_bytes == 10_000
    assert "dropped: none" in plan.describe()


def test_plan_exact_fit_keeps_everything():
    assert len(plan_buckets(COSTS, 80 + 840).chosen) == 4
    assert plan_buckets(COSTS, 80 + 839).chosen == (Bucket(4), Bucket(2), Bucket(1))


def test_plan_tight_budget_drops_largest_first():
    plan = plan_buckets(COSTS, 80 + 430)
    assert plan.chosen == (Bucket(4), Bucket(2), Bucket(1))
    assert set(plan.dropped) == {Bucket(8)}
    assert plan.predicted_pool_bytes == 400
    assert plan.predicted_exec_bytes == 30
    text = plan.describe()
    assert "3 bucket(s)" in text
    assert "bucket(bs=8)" in text and "does not fit" in text


def test_plan_drops_most_expensive_not_largest_batch():
    # Bucket 2 has an unusually large pool: it goes before bucket 8.
    costs = [cost(1), BucketCost(Bucket(2), 20, 5_000, 10, 1.0), cost(4), cost(8)]
    plan = plan_buckets(costs, 80 + 830)
    assert plan.chosen == (Bucket(8), Bucket(4), Bucket(1))
    assert set(plan.dropped) == {Bucket(2)}


def test_plan_pool_tie_broken_by_exec_bytes():
    costs = [
        BucketCost(Bucket(1), 0, 100, 10, 1.0),
        BucketCost(Bucket(2), 0, 100, 50, 1.0),
        BucketCost(Bucket(4), 0, 100, 20, 1.0),
    ]
    plan = plan_buckets(costs, 100 + 30)
    assert plan.chosen == (Bucket(4), Bucket(1))
    assert set(plan.dropped) == {Bucket(2)}


def test_plan_subtracts_eager_reserve_and_headroom():
    # Without the reserve 430 would hold bucket 4; one byte of headroom drops it.
    plan = plan_buckets(COSTS, 80 + 430, headroom_bytes=1)
    assert plan.eager_reserve_bytes == 81
    assert plan.chosen == (Bucket(2), Bucket(1))
    assert set(plan.dropped) == {Bucket(8), Bucket(4)}
    # The reserve is the largest eager peak, not the sum.
    assert plan_buckets(COSTS, 10_000, headroom_bytes=5).eager_reserve_bytes == 85


def test_plan_reserve_uses_dropped_buckets_eager_peak():
    # Batches above the largest kept bucket run eagerly: their peak stays reserved.
    plan = plan_buckets(COSTS, 80 + 230)
    assert plan.chosen == (Bucket(2), Bucket(1))
    assert plan.eager_reserve_bytes == 80


@pytest.mark.parametrize("free", [0, 80, 100])
def test_plan_no_budget_drops_everything_with_reasons(free):
    plan = plan_buckets(COSTS, free)
    assert plan.chosen == ()
    assert set(plan.dropped) == {c.bucket for c in COSTS}
    assert all("does not fit" in why for why in plan.dropped.values())
    assert plan.predicted_pool_bytes == 0
    assert plan.predicted_exec_bytes == 0
    assert plan.predicted_bytes == 0
    text = plan.describe()
    assert "0 bucket(s)" in text
    for bs in (1, 2, 4, 8):
        assert f"bucket(bs={bs})" in text


def test_plan_empty_costs():
    plan = plan_buckets([], 0)
    assert plan.chosen == () and plan.dropped == {}
    assert plan.eager_reserve_bytes == 0


def test_plan_duplicate_buckets_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([cost(4), cost(4, pool_per_row=1)], 10_000)


@pytest.mark.parametrize(("free", "headroom"), [(-1, 0), (100, -1)])
def test_plan_negative_budget_rejected(free, headroom):
    with pytest.raises(ValueError, match=">= 0"):
        plan_buckets(COSTS, free, headroom_bytes=headroom)


def test_plan_feeds_check_dropped_buckets():
    plan = plan_buckets(COSTS, 80 + 430)
    check_dropped_buckets(plan.dropped, require_all=False)
    with pytest.raises(CudaGraphCaptureError, match="bucket\\(bs=8\\): does not fit"):
        check_dropped_buckets(plan.dropped, require_all=True)


def test_plan_token_buckets():
    costs = [
        BucketCost(Bucket(4, 64), 10, 640, 10, 1.0),
        BucketCost(Bucket(4, 16), 10, 160, 10, 1.0),
        BucketCost(Bucket(1, 1), 10, 10, 10, 1.0),
    ]
    plan = plan_buckets(costs, 10 + 160 + 20)
    assert plan.chosen == (Bucket(4, 16), Bucket(1, 1))
    assert set(plan.dropped) == {Bucket(4, 64)}


def test_plan_says_what_each_dropped_bucket_needed_and_what_was_free():
    plan = plan_buckets(COSTS, 80 + 430)
    assert plan.dropped == {
        Bucket(8): "does not fit: the plan needed 840 B with it, 430 B are free beside the "
        "eager reserve"
    }
    # Less than the eager reserve: nothing is free (not a negative size). Dropped in
    # order, each with what the plan still needed with it.
    plan = plan_buckets(COSTS, 50)
    assert list(plan.dropped.items()) == [
        (
            Bucket(bs),
            f"does not fit: the plan needed {need} B with it, 0 B are free beside the "
            "eager reserve",
        )
        for bs, need in ((8, 840), (4, 430), (2, 220), (1, 110))
    ]


def costs_strategy():
    one = st.tuples(
        st.integers(0, 2_000),  # eager peak
        st.integers(0, 5_000),  # pool
        st.integers(0, 40),  # nodes
        st.sampled_from([0.0, 0.5, 1.0, 16.0]),  # bytes per node
    )
    return st.lists(one, max_size=8).map(
        lambda rows: [BucketCost(Bucket(i + 1), *row) for i, row in enumerate(rows)]
    )


def need(costs):
    return max((c.pool_bytes for c in costs), default=0) + sum(c.exec_bytes for c in costs)


@given(costs=costs_strategy(), free=st.integers(0, 20_000), headroom=st.integers(0, 500))
def test_plan_property_fits_and_drops_the_most_expensive_only_as_needed(costs, free, headroom):
    plan = plan_buckets(costs, free, headroom_bytes=headroom)
    reserve = max((c.eager_peak_bytes for c in costs), default=0) + headroom
    assert plan.eager_reserve_bytes == reserve
    assert plan.budget_bytes == free
    # Every bucket is either chosen (in capture order) or dropped with a reason.
    assert set(plan.chosen) | set(plan.dropped) == {c.bucket for c in costs}
    assert not set(plan.chosen) & set(plan.dropped)
    assert list(plan.chosen) == sorted(plan.chosen, key=lambda b: (b.rows, b.batch_size))[::-1]
    chosen = [c for c in costs if c.bucket in plan.chosen]
    dropped = [c for c in costs if c.bucket in plan.dropped]
    # The prediction: one shared pool (the largest), one executable per graph.
    assert plan.predicted_pool_bytes == max((c.pool_bytes for c in chosen), default=0)
    assert plan.predicted_exec_bytes == sum(c.exec_bytes for c in chosen)
    assert plan.predicted_bytes == need(chosen)
    # The chosen buckets fit beside the eager reserve.
    assert not chosen or need(chosen) <= free - reserve
    # Nothing is dropped when everything fits.
    assert bool(dropped) == (bool(costs) and need(costs) > free - reserve)
    if dropped:
        # Each dropped bucket costs at least as much as any kept one (pool bytes, then
        # executable bytes, then the bucket), and the cheapest dropped did not fit.
        def key(c):
            return (c.pool_bytes, c.exec_bytes, c.bucket)

        assert all(key(d) >= key(c) for d in dropped for c in chosen)
        cheapest = min(dropped, key=key)
        assert list(plan.dropped)[-1] == cheapest.bucket
        assert need([*chosen, cheapest]) > free - reserve


def test_plan_describe_in_full():
    mib = 1 << 20
    plan = MemoryPlan(
        chosen=(Bucket(8), Bucket(2)),
        dropped={Bucket(16): "does not fit", Bucket(32): "capture failed"},
        predicted_pool_bytes=3 * mib,
        predicted_exec_bytes=mib // 2,
        eager_reserve_bytes=2 * mib,
        budget_bytes=10 * mib,
    )
    assert plan.describe() == (
        "memory plan: 2 bucket(s) predicted to take 3.0 MiB of pool and 0.5 MiB of executable "
        "graphs, beside 2.0 MiB kept for the largest eager step, within 10.0 MiB free; "
        "dropped: bucket(bs=16) (does not fit), bucket(bs=32) (capture failed)"
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        ((1 << 20) - 1, "1024.0 KiB"),
        (1 << 20, "1.0 MiB"),
        (5 << 29, "2.5 GiB"),
        (1 << 40, "1024.0 GiB"),
    ],
)
def test_sizes_are_written_in_binary_units(n, text):
    assert _size(n) == text


def test_pad_ratio_of_a_token_bucket_needs_num_tokens():
    with pytest.raises(ValueError, match="token bucket: pass num_tokens"):
        pad_ratio(Bucket(4, 16), 4)


def test_staging_for_a_bucket_larger_than_the_buffers_is_rejected():
    si = StaticInputs([InputSpec("ids", (8,), torch.int64)], 8, "cpu")
    with pytest.raises(
        CudaGraphInputError,
        match=r"bucket\(bs=16\): rows expected at most 8, the buffers' rows, received 16",
    ) as info:
        si.stage({"ids": torch.arange(4)}, Bucket(16), 4)
    assert [(m.path, m.field, m.received) for m in info.value.mismatches] == [
        ("bucket(bs=16)", "rows", 16)
    ]


def test_memory_use_reports_prediction_against_actual():
    from cudagraphs.serving import MemoryPlan, MemoryUse

    mib = 1 << 20
    plan = MemoryPlan(chosen=(), predicted_pool_bytes=100 * mib, predicted_exec_bytes=0)
    line = MemoryUse(pool_bytes=90 * mib, device_bytes=120 * mib).against(plan)
    assert "pool predicted 100.0 MiB, reserved 90.0 MiB" in line
    assert "actual/predicted 1.20" in line


def test_memory_use_line_in_full_and_without_a_prediction():
    mib = 1 << 20
    plan = MemoryPlan(
        chosen=(Bucket(8),), predicted_pool_bytes=3 * mib // 2, predicted_exec_bytes=mib // 2
    )
    assert MemoryUse(pool_bytes=1000, device_bytes=3 * mib).against(plan) == (
        "memory plan vs capture: pool predicted 1.5 MiB, reserved 1000 B; total predicted "
        "2.0 MiB, device free memory dropped by 3.0 MiB (actual/predicted 1.50)"
    )
    # Nothing predicted (every bucket dropped): no ratio, and no ZeroDivisionError.
    line = MemoryUse(pool_bytes=0, device_bytes=2048).against(MemoryPlan(chosen=()))
    assert line.endswith(
        "total predicted 0 B, device free memory dropped by 2.0 KiB (actual/predicted nan)"
    )
