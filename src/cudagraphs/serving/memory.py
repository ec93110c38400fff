"""Memory planning for bucketed capture: which buckets fit in free device memory.

Costs are measured per bucket before the real capture, on the GPU
(:func:`cudagraphs.serving.startup.measure_bucket_cost`: eager warm-up peak, a
thrown-away capture for the pool bytes, and executable memory per graph node through
the driver). Everything here is a pure function of those numbers, tested (and
mutation-tested) on the CPU with synthetic costs.

Model: all buckets share one pool and are captured largest first, so the pool grows
to about the largest chosen bucket's pool bytes; every graph adds its executable
memory; and the largest eager step (batches no bucket fits run eagerly) must still
fit beside all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CudaGraphsValueError
from .buckets import Bucket, size_key

__all__ = ["BucketCost", "MemoryPlan", "MemoryUse", "plan_buckets"]


@dataclass(frozen=True)
class BucketCost:
    """Measured costs of one bucket, in bytes."""

    bucket: Bucket
    eager_peak_bytes: int  # peak allocation of one eager step at this bucket
    pool_bytes: int  # what its capture took from the pool (captured alone)
    graph_nodes: int  # nodes of its graph(s)
    exec_bytes_per_node: float  # driver memory per node of an instantiated graph

    @property
    def exec_bytes(self) -> int:
        return int(self.graph_nodes * self.exec_bytes_per_node)


@dataclass(frozen=True)
class MemoryPlan:
    """The buckets to capture and the prediction to log against the actual figures."""

    chosen: tuple[Bucket, ...]
    dropped: dict[Bucket, str] = field(default_factory=dict)
    predicted_pool_bytes: int = 0
    predicted_exec_bytes: int = 0
    eager_reserve_bytes: int = 0
    budget_bytes: int = 0

    @property
    def predicted_bytes(self) -> int:
        return self.predicted_pool_bytes + self.predicted_exec_bytes

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"memory plan: {len(self.chosen)} bucket(s) predicted to take "
            f"{self.predicted_pool_bytes / mib:.1f} MiB of pool and "
            f"{self.predicted_exec_bytes / mib:.1f} MiB of executable graphs, beside "
            f"{self.eager_reserve_bytes / mib:.1f} MiB kept for the largest eager step, "
            f"within {self.budget_bytes / mib:.1f} MiB free; dropped: "
            + (", ".join(f"{b} ({why})" for b, why in self.dropped.items()) or "none")
        )


@dataclass(frozen=True)
class MemoryUse:
    """What the real captures took, to set beside the plan's prediction."""

    pool_bytes: int  # growth of the allocator's reserved memory across all captures
    device_bytes: int  # drop of the device's free memory (pool, graphs, workspaces)

    def against(self, plan: MemoryPlan) -> str:
        """One log line: predicted against actual, with the ratio of the totals."""
        ratio = self.device_bytes / plan.predicted_bytes if plan.predicted_bytes else float("nan")
        return (
            f"memory plan vs capture: pool predicted {_size(plan.predicted_pool_bytes)}, "
            f"reserved {_size(self.pool_bytes)}; total predicted {_size(plan.predicted_bytes)}"
            f", device free memory dropped by {_size(self.device_bytes)} "
            f"(actual/predicted {ratio:.2f})"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _need(costs: Sequence[BucketCost]) -> tuple[int, int]:
    if not costs:
        return 0, 0
    return max(c.pool_bytes for c in costs), sum(c.exec_bytes for c in costs)


def plan_buckets(
    costs: Sequence[BucketCost], free_bytes: int, *, headroom_bytes: int = 0
) -> MemoryPlan:
    """Choose the buckets that fit in ``free_bytes``.

    The largest eager step's peak (over all buckets' eager peaks) is kept free, plus
    ``headroom_bytes``. While the chosen buckets' predicted pool + executable memory
    does not fit in what is left, the most expensive bucket (largest pool bytes,
    then largest executable memory) is dropped, so a tight budget loses the
    expensive large buckets and keeps the cheap small ones.

    Raises:
        CudaGraphsValueError: negative budgets or duplicate buckets.
    """
    if free_bytes < 0 or headroom_bytes < 0:
        raise CudaGraphsValueError(
            f"free_bytes and headroom_bytes must be >= 0, got {free_bytes} and {headroom_bytes}"
        )
    buckets = [c.bucket for c in costs]
    if len(set(buckets)) != len(buckets):
        raise CudaGraphsValueError(f"duplicate buckets in costs: {buckets}")
    reserve = max((c.eager_peak_bytes for c in costs), default=0) + headroom_bytes
    budget = free_bytes - reserve
    chosen = sorted(costs, key=lambda c: size_key(c.bucket), reverse=True)
    dropped: dict[Bucket, str] = {}
    while chosen:
        pool, execs = _need(chosen)
        if pool + execs <= budget:
            break
        victim = max(chosen, key=lambda c: (c.pool_bytes, c.exec_bytes, c.bucket))
        chosen.remove(victim)
        dropped[victim.bucket] = (
            f"does not fit: the plan needed {_size(pool + execs)} with it, "
            f"{_size(max(budget, 0))} are free beside the eager reserve"
        )
    pool, execs = _need(chosen)
    return MemoryPlan(
        chosen=tuple(c.bucket for c in chosen),
        dropped=dropped,
        predicted_pool_bytes=pool,
        predicted_exec_bytes=execs,
        eager_reserve_bytes=reserve,
        budget_bytes=free_bytes,
    )
