"""Serving: bucketed graph runners for inference.

:class:`GraphRunner` captures one graph per batch-size (or token-count) bucket over
shared static inputs and replays the tightest bucket that fits each batch; it is
validated on the GPU against eager results (decode steps, piecewise regions, compiled
forwards, rank agreement). The modules follow the data flow:

* policies, pure and tested on the CPU: :mod:`.buckets` (configuration, the choice of
  a bucket, padding ratio), :mod:`.input_specs`, :mod:`.memory` (the memory plan),
  :mod:`.distributed` (rank agreement); the compile options are checked by
  :func:`cudagraphs.compile_watch.check_compile_options`;
* what is captured: :mod:`.static_inputs` (the shared buffers and their input check),
  :mod:`.graphs` (per bucket graphs, and the :class:`CapturedBuckets` value);
* :mod:`.startup`: the capture, which returns that value;
* :mod:`.call_path`: one call, from the batch to the outputs;
* :mod:`.runner`: :class:`GraphRunner`, the life cycle around them.

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
    BucketChoice,
    BucketConfig,
    check_dropped_buckets,
    choose_bucket,
    pad_ratio,
    select_bucket,
)
from .distributed import agree_on_batch_size, agree_on_captured, is_distributed
from .graphs import BucketGraph, CapturedBuckets, CaptureReport, CaptureTime, SlotGraph
from .input_specs import InputSpec, infer_row_dim
from .memory import BucketCost, MemoryPlan, MemoryUse, plan_buckets
from .runner import GraphRunner
from .static_inputs import StaticInputs

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "STRICT_BUCKETS_ENV",
    "Bucket",
    "BucketChoice",
    "BucketConfig",
    "BucketCost",
    "BucketGraph",
    "CaptureReport",
    "CaptureTime",
    "CapturedBuckets",
    "GraphRunner",
    "InputSpec",
    "MemoryPlan",
    "MemoryUse",
    "SlotGraph",
    "StaticInputs",
    "agree_on_batch_size",
    "agree_on_captured",
    "check_dropped_buckets",
    "choose_bucket",
    "infer_row_dim",
    "is_distributed",
    "pad_ratio",
    "plan_buckets",
    "select_bucket",
]
