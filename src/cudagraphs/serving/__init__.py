"""Serving: bucketed graph runners for inference (issue in progress).

Available now: the pure policies a runner is built from (bucket configuration and
choice, padding ratio, shared static input buffers, memory planning, rank
agreement). The runner that captures and replays buckets builds on them.
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
from .memory import BucketCost, MemoryPlan, plan_buckets
from .static_inputs import InputSpec, StaticInputs, infer_row_dim

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "STRICT_BUCKETS_ENV",
    "Bucket",
    "BucketConfig",
    "BucketCost",
    "InputSpec",
    "MemoryPlan",
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
