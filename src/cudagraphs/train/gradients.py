"""Gradient all-reduce in buckets, written so that it can be captured.

DDP reduces gradients from autograd hooks as backward produces them; inside a graph
that machinery is replaced by what it amounts to once the backward is done: the
gradients, packed into flat buckets of one dtype, one ``all_reduce`` per bucket, then
divided by the world size and unpacked. Every op runs on the current stream (the
capture stream inside a graph), with no host sync, so NCCL records into the graph.

The same function runs eagerly (:func:`all_reduce_gradients`), so an eager reference
loop can do exactly what the graph does and be compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checks import check_number
from ..errors import CudaGraphsValueError

__all__ = [
    "DEFAULT_BUCKET_MB",
    "GradientBucket",
    "GradientReducer",
    "all_reduce_gradients",
    "plan_buckets",
]

#: Bucket size as DDP's default (``bucket_cap_mb=25``): large enough that a bucket's
#: all-reduce runs at bandwidth, small enough that the flat copy stays a small
#: fraction of the gradients' memory.
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class GradientBucket:
    """Gradients reduced by one collective: same device and dtype, in parameter order."""

    grads: tuple[torch.Tensor, ...]
    numels: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.numels) * self.grads[0].element_size()


def plan_buckets(
    grads: list[torch.Tensor], bucket_mb: float = DEFAULT_BUCKET_MB
) -> list[GradientBucket]:
    """Group ``grads`` into buckets: consecutive gradients of one device and dtype,
    each bucket at most ``bucket_mb`` MiB unless one gradient alone is larger
    (``float("inf")``: one bucket per device and dtype).

    Pure (reads shapes only); the order is the parameters' order, so every rank with
    the same model builds the same buckets.

    Raises:
        CudaGraphsValueError: ``bucket_mb`` is not positive.
    """
    bucket_mb = check_number("bucket_mb", bucket_mb)
    if not bucket_mb > 0:  # NaN included
        raise CudaGraphsValueError(f"bucket_mb must be positive, got {bucket_mb}")
    # float("inf") asks for one bucket per device and dtype.
    cap = bucket_mb * 2**20 if bucket_mb == float("inf") else int(bucket_mb * 2**20)
    buckets: list[GradientBucket] = []
    current: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        same_kind = current and (g.device, g.dtype) == (current[0].device, current[0].dtype)
        if current and (not same_kind or size + nbytes > cap):
            buckets.append(_bucket(current))
            current, size = [], 0
        current.append(g)
        size += nbytes
    if current:
        buckets.append(_bucket(current))
    return buckets


def _bucket(grads: list[torch.Tensor]) -> GradientBucket:
    return GradientBucket(tuple(grads), tuple(g.numel() for g in grads))


class GradientReducer:
    """Averages gradients over the ranks of ``group`` (a ``torch.distributed`` process
    group; ``None`` for the default group), one ``all_reduce`` per bucket.

    The buckets hold the gradient tensors themselves, so build the reducer once the
    gradients exist (and, in a graph, once they sit at their captured addresses).
    """

    def __init__(
        self, grads: list[torch.Tensor], group: object = None, bucket_mb: float = DEFAULT_BUCKET_MB
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.buckets = plan_buckets(grads, bucket_mb)

    def __call__(self) -> None:
        with torch.no_grad():
            for bucket in self.buckets:
                flat = torch.cat([g.reshape(-1) for g in bucket.grads])
                dist.all_reduce(flat, group=self.group)
                # SUM then divide: every backend has SUM (gloo has no AVG), and the
                # eager function does the same, so both round alike.
                flat.div_(self.world_size)
                parts = [p.view_as(g) for p, g in zip(flat.split(bucket.numels), bucket.grads)]
                torch._foreach_copy_(list(bucket.grads), parts)


def all_reduce_gradients(
    parameters: Iterable[torch.Tensor],
    *,
    group: object = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> None:
    """Average the ``.grad`` of ``parameters`` over the ranks of ``group`` in place,
    exactly as :func:`~cudagraphs.graph_train_step` does inside its graph.

    For an eager loop to compare with the graphed step (or to train without DDP's
    hooks). Parameters without a gradient are skipped; every rank must pass the same
    parameters with the same gradients present.

    Raises:
        ValueError: ``torch.distributed`` is not initialized (torch's error).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        GradientReducer(grads, group, bucket_mb)()
