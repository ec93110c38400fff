"""Capture of a runner's buckets: :func:`capture_buckets` takes :class:`CaptureArgs` and
returns the :class:`~cudagraphs.serving.graphs.CapturedBuckets` that a
:class:`~cudagraphs.serving.GraphRunner` holds and replays.

What one capture does, in order:

1. check the device (CUDA, or a stand-in backend, or ``CUDAGRAPHS_DISABLE``);
2. allocate the static inputs of every slot at the largest bucket, and take the pool;
3. with ``plan_memory``, measure every bucket (:func:`measure_bucket_cost`) and keep
   those :func:`~cudagraphs.serving.memory.plan_buckets` fits;
4. per bucket, largest first: stage dummy inputs, warm up on the pool's warmup stream,
   capture every slot, check that each output holds the bucket's rows;
5. account the device memory, agree with the other ranks on the captured set, and
   raise if a dropped bucket was required.

A bucket whose measurement or capture fails is dropped (an ERROR line naming it and the
cause) and the others still capture. What is found along the way goes into the
:class:`~cudagraphs.serving.graphs.CaptureReport` the caller hands in, which the caller
keeps also when the capture raises. Everything said here is said under the runner's
logger, ``cudagraphs.serving.runner``: a runner's lines are filtered by that one name.

It does NOT check the arguments (the runner does, when it is built and when its
``capture()`` is called) and keeps nothing of its own after returning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..capture import GraphMemoryPool, capture_into_graph, gc_paused
from ..capture_state import capture_scope
from ..checks import require_cuda
from ..compile_watch import CompileReport, CompileWatch, warn_failed_compiles
from ..diagnostics import WarnOnce
from ..errors import CudaGraphOutputError, CudaGraphsTypeError, CudaGraphsValueError
from ..introspect import instantiate_measured
from ..memory import MemoryMeter
from ..settings import DISABLE_ENV, graphs_disabled
from .buckets import Bucket, BucketConfig, check_dropped_buckets, warmup_runs
from .distributed import agree_on_captured
from .graphs import (
    BucketBackend,
    BucketGraph,
    CapturedBuckets,
    CaptureReport,
    CaptureTime,
    eager_backend,
    release,
    slot_graph,
)
from .input_specs import InputSpec
from .memory import BucketCost, MemoryUse, plan_buckets
from .static_inputs import StaticInputs

__all__ = [
    "CaptureArgs",
    "capture_buckets",
    "check_device",
    "choose_by_memory",
    "drop_bucket",
    "measure_bucket",
    "measure_bucket_cost",
    "memory_now",
    "progress_bar",
    "warmup_scope",
    "warmup_stream",
]

logger = logging.getLogger("cudagraphs.serving.runner")


@dataclass(frozen=True)
class CaptureArgs:
    """Everything one capture of a runner's buckets is given, each value already
    checked (by :class:`~cudagraphs.serving.GraphRunner`'s constructor and its
    ``capture()``, where each is described).

    Attributes:
        forward: what each bucket warms up and captures, ``forward(**views)``.
        specs, config, device: the inputs at the largest bucket, the buckets, where
            the static inputs live.
        make_inputs: dummy inputs for a bucket, staged before its warmup and capture.
        backend: how a bucket is captured (``backend(run, pool, what)``).
        stand_in: ``backend`` is the caller's stand-in for the CUDA capture, so a device
            other than CUDA is allowed.
        slots, output_row_dim, pool, group, require_all_buckets: as for the runner.
        compiles: every bucket warms up fully (forward compiles per shape).
        warmup, plan_memory, free_bytes, headroom_bytes, measure, progress: as for
            ``GraphRunner.capture()``.
    """

    forward: Callable[..., Any]
    specs: Sequence[InputSpec]
    config: BucketConfig
    device: torch.device
    make_inputs: Callable[[Bucket], Mapping[str, torch.Tensor]]
    backend: BucketBackend
    stand_in: bool = False
    slots: int = 1
    output_row_dim: int = 0
    pool: GraphMemoryPool | None = None
    group: object | None = None
    require_all_buckets: bool | None = None
    compiles: bool = False
    warmup: int = 2
    plan_memory: bool = False
    free_bytes: int | None = None
    headroom_bytes: int = 0
    measure: Callable[[Bucket], BucketCost] | None = None
    progress: bool | None = None


def capture_buckets(args: CaptureArgs, report: CaptureReport, warn: WarnOnce) -> CapturedBuckets:
    """Capture every configured bucket of ``args``, largest first, into one pool.

    A transaction: on any exception every graph it captured is released and the
    exception raised again; ``report`` then says what happened up to there.

    Args:
        args: what to capture (:class:`CaptureArgs`).
        report: a fresh :class:`~cudagraphs.serving.graphs.CaptureReport`, filled here
            (owned by the caller).
        warn: the runner's once-per-cause WARNING (``CUDAGRAPHS_DISABLE`` is said
            through it).

    Returns:
        The :class:`~cudagraphs.serving.graphs.CapturedBuckets`, owned by the caller
        (release its graphs when done); its ``graphs`` are empty when every bucket was
        dropped.

    Raises:
        CudaGraphsValueError: a device that is not CUDA with the real capture (no
            stand-in, not disabled), or ``plan_memory`` off CUDA without ``measure`` and
            ``free_bytes``; a bad ``CUDAGRAPHS_DISABLE`` or
            ``CUDAGRAPHS_REQUIRE_ALL_BUCKETS`` value.
        NoCudaDeviceError: a CUDA device and torch finds none.
        CudaGraphsTypeError: a ``measure`` that returns something other than a
            ``BucketCost``.
        CudaGraphOutputError: an output tensor of some bucket or slot lacks the
            bucket's rows in ``output_row_dim``.
        CudaGraphCaptureError: a bucket was dropped and all are required.
    """
    disabled = graphs_disabled()
    check_device(args, disabled)
    report.disabled = disabled
    if disabled:
        warn(
            "disabled",
            "GraphRunner: %s=1: every bucket runs eagerly through the runner's path (an "
            "eager stand-in per bucket, no graph); warmup%s skipped",
            DISABLE_ENV,
            " and the memory plan" if args.plan_memory else "",
        )
        args = replace(args, backend=eager_backend, warmup=0, plan_memory=False)
    slot_inputs = [
        StaticInputs(args.specs, args.config.largest.rows, args.device) for _ in range(args.slots)
    ]
    captured = CapturedBuckets(
        {}, slot_inputs, GraphMemoryPool() if args.pool is None else args.pool, report
    )
    try:
        with nullcontext() if disabled else capture_scope():
            _capture_all(args, captured)
    except BaseException:
        captured.release()
        raise
    return captured


def check_device(args: CaptureArgs, disabled: bool) -> None:
    """Refuse a capture its device cannot do (see :func:`capture_buckets`)."""
    if args.device.type == "cuda":
        require_cuda("GraphRunner.capture")
        return
    where = f"GraphRunner(device='{args.device}')"
    if not args.stand_in and not disabled:
        raise CudaGraphsValueError(
            f"{where}: CUDA graphs need a CUDA device. Fixes: 1. pass device='cuda' (or "
            f"'cuda:N'); 2. set {DISABLE_ENV}=1 to run eagerly through the runner."
        )
    if args.plan_memory and not disabled and (args.measure is None or args.free_bytes is None):
        raise CudaGraphsValueError(
            f"{where}: capture(plan_memory=True) measures CUDA memory; off CUDA pass "
            "both measure= and free_bytes="
        )


def _capture_all(args: CaptureArgs, captured: CapturedBuckets) -> None:
    report, device = captured.report, args.device
    chosen = set(args.config.buckets())
    if args.plan_memory:
        chosen = choose_by_memory(args, captured)
    # The collector stays off for all warmups and captures, and no collection is forced
    # before or after: with torch.compile or transformers imported a full collection
    # walks hundreds of thousands of tracked objects, and warmups of an HF model
    # allocate enough objects to set off several. Cycles made meanwhile go at the next
    # automatic collection.
    before = memory_now(device) if args.plan_memory else None
    meter = MemoryMeter.start(device) if device.type == "cuda" else None
    bar = progress_bar(args.progress, len(chosen), "capturing buckets")
    local_ok: list[bool] = []
    try:
        with gc_paused():
            _capture_chosen(args, captured, chosen, bar, local_ok)
    finally:
        if bar is not None:
            bar.close()
    if meter is not None and not report.disabled:
        # Warmups after the first capture ran outside the pool: their blocks stay
        # cached on the warmup stream, where nothing reuses them (MemoryMeter.finish).
        report.memory_account = meter.finish(captured.pool.handles(), what="GraphRunner")
    if before is not None:
        after = memory_now(device)
        report.memory_used = MemoryUse(after[0] - before[0], before[1] - after[1])
        logger.info("%s", report.memory_used.against(report.memory_plan))
    _agree(args, captured, local_ok)
    check_dropped_buckets(report.dropped, args.require_all_buckets)


def _capture_chosen(
    args: CaptureArgs,
    captured: CapturedBuckets,
    chosen: set[Bucket],
    bar: Any,
    local_ok: list[bool],
) -> None:
    runs = 0
    for bucket in args.config.buckets():
        # Every rank walks every bucket, also after a local failure, so the agreement
        # afterwards is one collective per rank.
        ok = False
        if bucket in chosen:
            warmup = warmup_runs(runs, args.warmup, args.compiles)
            ok = _capture_bucket(args, captured, bucket, warmup)
            runs += 1
            _said_captured(captured.report, bucket, ok, runs, len(chosen), bar)
        local_ok.append(ok)


def _capture_bucket(
    args: CaptureArgs, captured: CapturedBuckets, bucket: Bucket, warmup: int
) -> bool:
    """Capture ``bucket`` in every slot: True and the bucket in ``captured.graphs``,
    or False and the bucket dropped (its graphs released) when a capture failed."""
    made: list[tuple[Any, Any, str]] = []
    warmup_s = capture_s = 0.0
    compiled = CompileReport()
    device_index = args.device.index if args.device.type == "cuda" else None
    forward, pool = args.forward, captured.pool
    try:
        for slot, static in enumerate(captured.slot_inputs):
            views = static.views(bucket)
            static.stage(args.make_inputs(bucket), bucket, bucket.rows)
            what = str(bucket) if args.slots == 1 else f"{bucket} slot {slot}"
            start = time.perf_counter()
            watch = CompileWatch.start(device_index)
            with warmup_scope(pool, args.device):
                for _ in range(warmup):
                    forward(**views)
            compiled += watch.finish()
            middle = time.perf_counter()
            graph, output = args.backend(lambda v=views: forward(**v), pool, what)
            warmup_s += middle - start
            capture_s += time.perf_counter() - middle
            made.append((graph, output, what))
    except Exception as exc:
        release(graph for graph, _, _ in made)
        drop_bucket(captured.report, bucket, f"{type(exc).__name__}: {exc}", "its capture failed: ")
        return False
    try:
        # A configuration error, not a failure of this bucket: raised, not dropped.
        slots = [
            slot_graph(graph, output, bucket, args.output_row_dim, what)
            for graph, output, what in made
        ]
    except CudaGraphOutputError:
        release(graph for graph, _, _ in made)
        raise
    captured.graphs[bucket] = BucketGraph(bucket, slots)
    warn_failed_compiles(compiled, f"GraphRunner {bucket}", logger)
    captured.report.times[bucket] = CaptureTime(
        warmup, warmup_s, capture_s, compiled.seconds, len(compiled.frames)
    )
    return True


def _said_captured(
    report: CaptureReport, bucket: Bucket, ok: bool, done: int, total: int, bar: Any
) -> None:
    took = report.times.get(bucket)
    if ok and took is not None:
        compiling = (
            f" (compiling {took.compile_s:.3f} s, {took.compiled_frames} frame(s))"
            if took.compiled_frames
            else ""
        )
        logger.info(
            "GraphRunner: captured %s (%d/%d): warmup %.3f s%s, capture %.3f s",
            bucket,
            done,
            total,
            took.warmup_s,
            compiling,
            took.capture_s,
        )
    if bar is not None:
        bar.update(1)


def drop_bucket(report: CaptureReport, bucket: Bucket, reason: str, how: str = "") -> None:
    """Record ``bucket`` as dropped and say so at ERROR."""
    report.dropped[bucket] = reason
    logger.error("GraphRunner: dropping %s: %s%s", bucket, how, reason)


def _agree(args: CaptureArgs, captured: CapturedBuckets, local_ok: list[bool]) -> None:
    agreed = agree_on_captured(local_ok, args.group)
    for bucket, ok, all_ok in zip(args.config.buckets(), local_ok, agreed):
        if ok and not all_ok:
            captured.graphs.pop(bucket).reset()
            drop_bucket(
                captured.report,
                bucket,
                "dropped on another rank",
                "another rank could not capture it: ",
            )


# ---- the memory plan -------------------------------------------------------------------
def choose_by_memory(args: CaptureArgs, captured: CapturedBuckets) -> set[Bucket]:
    """Measure every bucket and keep those the memory plan fits; the others are dropped
    (a failed measurement like a failed capture), and the plan goes into the report
    and into an INFO line.

    Raises:
        CudaGraphsTypeError: ``args.measure`` returned something other than a
            ``BucketCost``.
    """
    report = captured.report
    costs = []
    for bucket in args.config.buckets():
        try:
            cost = measure_bucket(args, captured, bucket)
        except Exception as exc:
            # A sync or a failing step at this size only: the real capture would fail
            # the same way, so the bucket goes and the others are planned.
            drop_bucket(report, bucket, f"memory measurement failed: {type(exc).__name__}: {exc}")
            continue
        if not isinstance(cost, BucketCost):
            raise CudaGraphsTypeError(
                f"measure({bucket}) must return a BucketCost, got {type(cost).__name__}"
            )
        costs.append(cost)
    free_bytes = args.free_bytes
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(args.device)[0]
    report.memory_plan = plan = plan_buckets(costs, free_bytes, headroom_bytes=args.headroom_bytes)
    logger.info("%s", plan.describe())
    for bucket, why in plan.dropped.items():
        drop_bucket(report, bucket, f"memory plan: {why}")
    return set(plan.chosen)


def measure_bucket(args: CaptureArgs, captured: CapturedBuckets, bucket: Bucket) -> BucketCost:
    """Stage ``bucket``'s dummy inputs into the first slot and measure it: with
    ``args.measure`` when given, else :func:`measure_bucket_cost` on the pool's warmup
    stream."""
    static = captured.static
    static.stage(args.make_inputs(bucket), bucket, bucket.rows)
    if args.measure is not None:
        return args.measure(bucket)
    views = static.views(bucket)
    stream = warmup_stream(captured.pool, args.device)
    return measure_bucket_cost(bucket, lambda: args.forward(**views), stream)


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
    workspace to their pool, once (:meth:`~cudagraphs.capture.GraphMemoryPool.capture_stream`).

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
        run, GraphMemoryPool(), stream=stream, keep_graph=True, what=f"measuring {bucket}"
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


def memory_now(device: torch.device) -> tuple[int, int] | None:
    """(reserved bytes, device free bytes) of ``device``, or None off CUDA. Empties the
    cache first, so blocks cached by the eager warmups are not counted as graph memory."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)[0]


# ---- streams and progress --------------------------------------------------------------
def warmup_stream(pool: GraphMemoryPool, device: torch.device) -> torch.cuda.Stream | None:
    """The stream a bucket is measured on: the pool's warmup stream (None off CUDA).

    Every bucket warms up (and is measured) on the pool's warmup stream and is captured
    on its capture stream, so the cuBLAS workspace of the graphs is made once, inside
    the pool (:meth:`~cudagraphs.capture.GraphMemoryPool.capture_stream`).
    """
    if device.type != "cuda":
        return None
    return pool.warmup_stream(device)


def warmup_scope(pool: GraphMemoryPool, device: torch.device) -> AbstractContextManager:
    """Where a bucket's warmup runs: inside the pool while no graph is in it, else on
    its warmup stream (:meth:`~cudagraphs.capture.GraphMemoryPool.warmup_scope`); nothing off
    CUDA."""
    if device.type != "cuda":
        return nullcontext()
    return pool.warmup_scope(device)


def progress_bar(progress: bool | None, total: int, what: str) -> Any:
    """A tqdm bar over ``total`` steps, or ``None`` (``progress=False``, nothing to
    capture, or tqdm not installed). With ``progress=None`` the bar is tqdm's
    ``disable=None``: it draws only when stderr is a terminal."""
    if progress is False or total == 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=what, unit="bucket", disable=None if progress is None else False)
