"""Serving: bucketed graph runners for inference (issue in progress).

The pure policies (bucket configuration and choice, padding ratio, shared static
input buffers, memory planning, rank agreement) and ``GraphRunner``, which captures
one graph per bucket and replays it; the runner's GPU path is not yet validated and
the memory plan is not yet wired into its capture.
"""

from .buckets import (
    DEFAULT_BATCH_SIZES,
    STRICT_BUCKETS_ENV,
    Bucket,
    BucketConfig,
    check_dropped_buckets,
    pad_ratio,
    select_bucket,
)
from .distributed import agree_on_batch_size, agree_on_captured, is_distributed
from .memory import BucketCost, MemoryPlan, MemoryUse, plan_buckets
from .runner import BucketGraph, GraphRunner
from .static_inputs import InputSpec, StaticInputs, infer_row_dim

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "STRICT_BUCKETS_ENV",
    "Bucket",
    "BucketConfig",
    "BucketCost",
    "BucketGraph",
    "GraphRunner",
    "InputSpec",
    "MemoryPlan",
    "MemoryUse",
    "StaticInputs",
    "agree_on_batch_size",
    "agree_on_captured",
    "check_dropped_buckets",
    "infer_row_dim",
    "is_distributed",
    "pad_ratio",
    "plan_buckets",
    "select_bucket",
]
