"""Serving: bucketed graph runners for inference.

:class:`GraphRunner` captures one graph per batch-size (or token-count) bucket over
shared static inputs and replays the tightest bucket that fits each batch; it is
validated on the GPU against eager results (decode steps, piecewise regions, compiled
forwards, rank agreement). The pure policies it uses live beside it and are tested on
the CPU: bucket configuration and choice, padding ratio, the shared static input
buffers with their input check, the memory plan (wired into ``capture(plan_memory=
True)``) and rank agreement.

The contract: every error is a :class:`~cudagraphs.errors.CudaGraphsError`; arguments
are checked when objects are built; outputs the runner cannot cut to the real rows are
refused at capture; a bucket that fails to capture or to be measured is dropped and
logged at ERROR (an error with ``CUDAGRAPHS_REQUIRE_ALL_BUCKETS=1``); every eager run
is counted per cause and said once at WARNING; ``CUDAGRAPHS_DISABLE=1`` runs the same
path eagerly.
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
from .graphs import BucketGraph, SlotGraph
from .input_specs import InputSpec, infer_row_dim
from .memory import BucketCost, MemoryPlan, MemoryUse, plan_buckets
from .runner import GraphRunner
from .static_inputs import StaticInputs

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
    "SlotGraph",
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
