"""Startup of a GraphRunner: what ``GraphRunner.capture()`` does once its arguments are
checked (device check, static inputs, warmups, the memory plan, each bucket's capture,
dropped buckets and rank agreement). Separate from the runner's per-step path, which
reads only what this leaves on the runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..capture import GraphPool, gc_paused
from ..capturing import capture_scope
from ..checks import require_cuda
from ..errors import CudaGraphOutputError, CudaGraphsTypeError, CudaGraphsValueError
from ..memory import MemoryMeter
from ..settings import DISABLE_ENV, graphs_disabled
from .buckets import Bucket, check_dropped_buckets, warmup_runs
from .distributed import agree_on_captured
from .graphs import BucketBackend, BucketGraph, eager_backend, release, slot_graph
from .measure import measure_bucket_cost
from .memory import BucketCost, MemoryUse, plan_buckets
from .static_inputs import StaticInputs

if TYPE_CHECKING:  # the runner imports this module
    from .runner import GraphRunner

__all__ = ["BucketCapture", "CaptureArgs", "CaptureTime", "progress_bar"]

# The runner's logger: what startup says (captured buckets, dropped ones, the memory
# plan) is filtered and captured under the runner's name, as before this module existed.
logger = logging.getLogger("cudagraphs.serving.runner")


@dataclass(frozen=True)
class CaptureArgs:
    """What one ``GraphRunner.capture()`` was asked, its arguments already checked (see
    that method for each)."""

    make_inputs: Callable[[Bucket], Mapping[str, torch.Tensor]]
    warmup: int
    plan_memory: bool = False
    free_bytes: int | None = None
    headroom_bytes: int = 0
    measure: Callable[[Bucket], BucketCost] | None = None
    progress: bool | None = None


@dataclass(frozen=True)
class CaptureTime:
    """How long one bucket took to capture (host wall time, seconds)."""

    warmup_runs: int
    warmup_s: float
    capture_s: float  # recording and instantiation


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


class BucketCapture:
    """One ``GraphRunner.capture()`` after its arguments are checked.

    It keeps no state of its own: the graphs, ``capture_times``, ``dropped_buckets``,
    ``memory_plan``, ``memory_used`` and the static inputs it makes live on the runner
    (whose ``close()`` releases them), and the runner's WARNINGs go through its
    once-per-cause ``_warn``. It does NOT check ``capture()``'s arguments (the runner
    does, before building this) or reset the runner's per-row-count replay steps.

    Args:
        runner: the :class:`~cudagraphs.serving.runner.GraphRunner` to capture.
            Borrowed.
    """

    def __init__(self, runner: GraphRunner) -> None:
        self.runner = runner

    def capture(self, args: CaptureArgs) -> None:
        """Capture every configured bucket, largest first, into the runner's pool.

        A transaction: on any exception the runner is closed and the exception raised
        again. ``args`` are ``GraphRunner.capture()``'s, already checked.

        Raises:
            As ``GraphRunner.capture()`` past its argument checks: a device that is not
            CUDA (or no CUDA device), an output without the bucket's rows, a dropped
            bucket when all are required.
        """
        runner = self.runner
        disabled = graphs_disabled()
        self._check_device(disabled, args)
        runner.disabled = disabled
        runner.dropped_buckets = {}
        runner.capture_times = {}
        runner.memory_plan = runner.memory_used = None
        if disabled:
            runner._warn(
                "disabled",
                "GraphRunner: %s=1: every bucket runs eagerly through the runner's path (an "
                "eager stand-in per bucket, no graph); warmup%s skipped",
                DISABLE_ENV,
                " and the memory plan" if args.plan_memory else "",
            )
            args = replace(args, warmup=0, plan_memory=False)
        largest = runner.config.largest
        runner.slot_inputs = [
            StaticInputs(runner.specs, largest.rows, runner.device) for _ in range(runner.slots)
        ]
        runner.static = runner.slot_inputs[0]
        if runner._pool is None:
            runner._pool = GraphPool()
        try:
            with nullcontext() if disabled else capture_scope():
                self._capture_all(args)
        except BaseException:
            runner.close()
            raise

    def _check_device(self, disabled: bool, args: CaptureArgs) -> None:
        runner = self.runner
        if runner.device.type == "cuda":
            require_cuda("GraphRunner.capture")
            return
        where = f"GraphRunner(device='{runner.device}')"
        if runner._capture_backend is None and not disabled:
            raise CudaGraphsValueError(
                f"{where}: CUDA graphs need a CUDA device. Fixes: 1. pass device='cuda' (or "
                f"'cuda:N'); 2. set {DISABLE_ENV}=1 to run eagerly through the runner."
            )
        if args.plan_memory and not disabled and (args.measure is None or args.free_bytes is None):
            raise CudaGraphsValueError(
                f"{where}: capture(plan_memory=True) measures CUDA memory; off CUDA pass "
                "both measure= and free_bytes="
            )

    def _capture_all(self, args: CaptureArgs) -> None:
        runner = self.runner
        chosen = set(runner.config.buckets())
        if args.plan_memory:
            chosen = self._plan(args)
        backend = eager_backend if runner.disabled else runner._backend
        local_ok = []
        # The collector stays off for all warmups and captures, and no collection is
        # forced before or after: with torch.compile or transformers imported a full
        # collection takes 70-210 ms (measured on the H200 host), a tenth of a 16-layer
        # decoder's whole startup, and warmups of an HF model allocate enough objects
        # to set off several. Cycles made meanwhile go at the next automatic one.
        before = self._memory_now() if args.plan_memory else None
        meter = MemoryMeter.start(runner.device) if runner.device.type == "cuda" else None
        bar = progress_bar(args.progress, len(chosen), "capturing buckets")
        try:
            with gc_paused():
                self._capture_chosen(chosen, args, backend, bar, local_ok)
        finally:
            if bar is not None:
                bar.close()
        if meter is not None and not runner.disabled:
            # Warmups after the first capture ran outside the pool: their blocks stay
            # cached on the warmup stream, where nothing reuses them (MemoryMeter.finish).
            runner.memory_account = meter.finish(runner._pool.handles(), what="GraphRunner")
        if before is not None:
            after = self._memory_now()
            runner.memory_used = MemoryUse(after[0] - before[0], before[1] - after[1])
            logger.info("%s", runner.memory_used.against(runner.memory_plan))
        self._agree(local_ok)
        check_dropped_buckets(runner.dropped_buckets, runner.require_all_buckets)

    def _capture_chosen(
        self,
        chosen: set[Bucket],
        args: CaptureArgs,
        backend: BucketBackend,
        bar: Any,
        local_ok: list[bool],
    ) -> None:
        runner = self.runner
        runs = 0
        for bucket in runner.config.buckets():
            # Every rank walks every bucket, also after a local failure, so the
            # agreement below is one collective per rank.
            ok = False
            if bucket in chosen:
                runs_here = warmup_runs(runs, args.warmup, runner.compiles)
                ok = self._capture_bucket(bucket, args.make_inputs, runs_here, backend)
                runs += 1
                self._said_captured(bucket, ok, runs, len(chosen), bar)
            local_ok.append(ok)

    def _memory_now(self) -> tuple[int, int] | None:
        """(reserved bytes, device free bytes), or None off CUDA. Empties the cache
        first, so blocks cached by the eager warmups are not counted as graph memory."""
        runner = self.runner
        if runner.device.type != "cuda":
            return None
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(runner.device), torch.cuda.mem_get_info(runner.device)[0]

    def _plan(self, args: CaptureArgs) -> set[Bucket]:
        runner = self.runner
        costs = []
        for bucket in runner.config.buckets():
            try:
                cost = self._measure(bucket, args)
            except Exception as exc:
                # A sync or a failing step at this size only: the real capture would
                # fail the same way, so the bucket goes and the others are planned.
                self._drop(bucket, f"memory measurement failed: {type(exc).__name__}: {exc}")
                continue
            if not isinstance(cost, BucketCost):
                raise CudaGraphsTypeError(
                    f"measure({bucket}) must return a BucketCost, got {type(cost).__name__}"
                )
            costs.append(cost)
        free_bytes = args.free_bytes
        if free_bytes is None:
            free_bytes = torch.cuda.mem_get_info(runner.device)[0]
        runner.memory_plan = plan = plan_buckets(
            costs, free_bytes, headroom_bytes=args.headroom_bytes
        )
        logger.info("%s", plan.describe())
        for bucket, why in plan.dropped.items():
            self._drop(bucket, f"memory plan: {why}")
        return set(plan.chosen)

    def _measure(self, bucket: Bucket, args: CaptureArgs) -> BucketCost:
        runner = self.runner
        runner.static.stage(args.make_inputs(bucket), bucket, bucket.rows)
        if args.measure is not None:
            return args.measure(bucket)
        views = runner.static.views(bucket)
        return measure_bucket_cost(bucket, lambda: runner.forward(**views), self._warmup_stream())

    def _warmup_stream(self) -> torch.cuda.Stream | None:
        runner = self.runner
        # Every bucket warms up (and is measured) on the pool's warmup stream and is
        # captured on its capture stream, so the cuBLAS workspace of the graphs is made
        # once, inside the pool (GraphPool.capture_stream). None on the CPU (tests).
        if runner.device.type != "cuda":
            return None
        return runner._pool.warmup_stream(runner.device)

    def _warmup_scope(self) -> AbstractContextManager:
        """Where a bucket's warmup runs: inside the pool while no graph is in it, else
        on its warmup stream (``GraphPool.warmup_scope``); nothing on the CPU."""
        runner = self.runner
        if runner.device.type != "cuda":
            return nullcontext()
        return runner._pool.warmup_scope(runner.device)

    def _said_captured(self, bucket: Bucket, ok: bool, done: int, total: int, bar: Any) -> None:
        runner = self.runner
        took = runner.capture_times.get(bucket)
        if ok and took is not None:
            logger.info(
                "GraphRunner: captured %s (%d/%d): warmup %.3f s, capture %.3f s",
                bucket,
                done,
                total,
                took.warmup_s,
                took.capture_s,
            )
        if bar is not None:
            bar.update(1)

    def _capture_bucket(
        self, bucket: Bucket, make_inputs: Callable, warmup: int, backend: BucketBackend
    ) -> bool:
        runner = self.runner
        captured: list[tuple[Any, Any, str]] = []
        warmup_s = capture_s = 0.0
        try:
            for slot, static in enumerate(runner.slot_inputs):
                views = static.views(bucket)
                static.stage(make_inputs(bucket), bucket, bucket.rows)
                what = str(bucket) if runner.slots == 1 else f"{bucket} slot {slot}"
                start = time.perf_counter()
                with self._warmup_scope():
                    for _ in range(warmup):
                        runner.forward(**views)
                middle = time.perf_counter()
                graph, output = backend(lambda v=views: runner.forward(**v), runner._pool, what)
                warmup_s += middle - start
                capture_s += time.perf_counter() - middle
                captured.append((graph, output, what))
        except Exception as exc:
            release(graph for graph, _, _ in captured)
            self._drop(bucket, f"{type(exc).__name__}: {exc}", "its capture failed: ")
            return False
        try:
            # A configuration error, not a failure of this bucket: raised, not dropped.
            slots = [
                slot_graph(graph, output, bucket, runner.output_row_dim, what)
                for graph, output, what in captured
            ]
        except CudaGraphOutputError:
            release(graph for graph, _, _ in captured)
            raise
        runner.graphs[bucket] = BucketGraph(bucket, slots)
        runner.capture_times[bucket] = CaptureTime(warmup, warmup_s, capture_s)
        return True

    def _drop(self, bucket: Bucket, reason: str, how: str = "") -> None:
        runner = self.runner
        runner.dropped_buckets[bucket] = reason
        logger.error("GraphRunner: dropping %s: %s%s", bucket, how, reason)

    def _agree(self, local_ok: list[bool]) -> None:
        runner = self.runner
        agreed = agree_on_captured(local_ok, runner.group)
        for bucket, ok, all_ok in zip(runner.config.buckets(), local_ok, agreed):
            if ok and not all_ok:
                runner.graphs.pop(bucket).reset()
                self._drop(bucket, "dropped on another rank", "another rank could not capture it: ")
