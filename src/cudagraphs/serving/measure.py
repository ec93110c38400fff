"""Measuring what one bucket costs on the GPU, for the memory plan (:mod:`.memory`).

Kept apart from the plan itself: this needs a device and runs a capture, while the
plan is a pure function of the numbers measured here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..capture import GraphPool, capture_into_graph
from ..introspect import instantiate_measured
from .buckets import Bucket
from .memory import BucketCost

__all__ = ["measure_bucket_cost"]


def measure_bucket_cost(
    bucket: Bucket, run: Callable[[], Any], stream: torch.cuda.Stream | None = None
) -> BucketCost:
    """Measure one bucket on the GPU: the eager step's peak allocation, then a
    thrown-away capture for its pool bytes (reserved memory it added) and, through the
    driver, its executable memory per node. Everything made here is released before
    returning, and the allocator cache is emptied so the next measurement starts clean.

    The eager step and the capture run on ``stream`` (default: a new side stream; the
    runner passes its pool's warmup stream): the stream's cuBLAS workspace is then made
    by the eager step and is not counted as pool bytes. The real captures add one
    workspace to their pool, once (:meth:`~cudagraphs.capture.GraphPool.capture_stream`).

    Raises:
        Whatever the eager step raises, and CudaGraphCaptureError when the thrown-away
        capture fails (a host sync at this size, for example); the runner drops the
        bucket then. The graph is released either way.
    """
    stream = torch.cuda.Stream() if stream is None else stream
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.cuda.stream(stream):
        out = run()
    torch.cuda.synchronize()
    eager_peak = torch.cuda.max_memory_allocated() - base
    del out
    # No empty_cache here: the capture allocates from its own pool, so every segment it
    # adds is new, and emptying the cache could drop the stream's workspace again.
    reserved = torch.cuda.memory_reserved()
    graph, out = capture_into_graph(
        run, GraphPool(), stream=stream, keep_graph=True, what=f"measuring {bucket}"
    )
    try:
        pool_bytes = torch.cuda.memory_reserved() - reserved
        memory = instantiate_measured(graph)
    finally:
        del out
        graph.reset()
        torch.cuda.empty_cache()
    return BucketCost(
        bucket=bucket,
        eager_peak_bytes=max(0, eager_peak),
        pool_bytes=max(0, pool_bytes),
        graph_nodes=memory.nodes or 0,
        exec_bytes_per_node=memory.bytes_per_node,
    )
