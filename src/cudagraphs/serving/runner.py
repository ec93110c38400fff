"""GraphRunner: one graph per batch-size bucket over shared static inputs.

The runner owns the life cycle: it checks its arguments when built, captures on
``capture()`` (:func:`~cudagraphs.serving.startup.capture_buckets`, which returns the
:class:`~cudagraphs.serving.graphs.CapturedBuckets` the runner then holds), serves each
``run()`` through its :class:`~cudagraphs.serving.call_path.CallPath` (bucket choice,
fast or full path, staging, replay, output rows), reports what happened, and releases
everything on ``close()``. A bucket whose capture (or memory measurement) fails is
dropped (logged at ERROR with its cause) and the others still capture; ranks then agree
on the captured set. A batch no bucket serves runs eagerly: counted per cause and said
once at WARNING. ``CUDAGRAPHS_DISABLE=1`` replaces each graph by an eager stand-in on
the same path.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..capture import GraphMemoryPool
from ..checks import check_callable, check_device, check_instance, check_int
from ..compile_watch import check_compile_options
from ..diagnostics import WarnOnce
from ..errors import CudaGraphsStateError, CudaGraphsTypeError
from .buckets import Bucket, BucketConfig
from .call_path import CallPath
from .graphs import (
    BucketBackend,
    BucketGraph,
    CapturedBuckets,
    CaptureReport,
    CaptureTime,
    ReplayStep,
    default_backend,
    static_outputs_backend,
)
from .input_specs import InputSpec, check_specs
from .memory import BucketCost, MemoryPlan, MemoryUse
from .startup import CaptureArgs, capture_buckets
from .static_inputs import StaticInputs

__all__ = ["GraphRunner"]

logger = logging.getLogger(__name__)


class GraphRunner:
    """A bucketed CUDA-graph runner for a fixed forward function.

    Workflow:

    1. ``GraphRunner(forward, inputs, config, ...)`` checks every argument and
       allocates nothing.
    2. ``capture(make_inputs)`` allocates the static inputs at the largest bucket and
       captures every bucket largest first into one pool (optionally only those a
       memory plan fits). A bucket whose capture or measurement fails is dropped and
       said at ERROR; outputs without the bucket's rows in ``output_row_dim`` are an
       error. Under ``CUDAGRAPHS_DISABLE=1`` every bucket gets an
       :class:`~cudagraphs.capture.EagerGraph` instead of a graph. The runner holds
       what it made in ``captured`` and what it found in ``report``.
    3. ``run(inputs)`` validates the batch, picks the tightest captured bucket, stages
       and pads, calls ``plan``, replays and returns the real rows. A batch no bucket
       serves runs ``forward`` eagerly, counted per cause in ``eager_runs`` and said
       once per cause at WARNING.
    4. ``stats()`` says what it did; ``close()`` releases the graphs and buffers
       (``report`` stays); ``capture()`` may then run again.

    It does NOT: capture in the constructor; graph batches larger than the largest
    captured bucket; check that forward's rows are independent of each other (padding
    rows must not change the real ones); let several threads drive one runner; notice
    changes to ``graphs`` made from outside (read it, don't edit it); time its steps
    (time ``run()`` from outside: nothing is measured or logged per step).

    Args:
        forward: ``forward(**inputs) -> output tree`` of tensors whose row dimension
            (``output_row_dim``) grows with the bucket; runs eagerly for warmup, for
            capture and for batches no bucket serves.
        inputs: a sequence of :class:`InputSpec`, the named inputs at the largest
            bucket (each with the largest bucket's rows in its row_dim).
        config: the buckets (:class:`BucketConfig`; default: batch sizes 1 to 64).
        device: where the static inputs live; graphs need a CUDA device.
        output_row_dim: the row dimension of every output tensor (negative values
            count from the end of each tensor); checked against every output at
            capture.
        require_all_buckets: make any dropped bucket a startup error (``None``: the
            ``CUDAGRAPHS_REQUIRE_ALL_BUCKETS`` environment variable decides).
        group: process group for rank agreement (default group when distributed).
        capture_backend: replaces the CUDA capture (tests use an eager stand-in).
        static_outputs: end each graph with a copy of its outputs into buffers outside
            the pool (piecewise regions: several runners share a pool and replay in
            any order, with eager code between them).
        pool: the :class:`GraphMemoryPool` to capture into (share one between the runners of
            piecewise regions); a new one by default. Borrowed.
        slots: input/graph sets per bucket, used in turn by consecutive steps (2 for
            double buffering: host-side planning of step N+1 writes the other slot's
            buffers while step N replays).
        plan: ``plan(bucket, slot)``, called after staging and before each replay,
            outside the graph (per-step metadata that the graph reads from buffers).
        compile_options: compile ``forward`` with ``torch.compile(**compile_options)``
            once, before capture; warmup compiles each bucket's shapes, and a
            recompilation inside a capture fails that capture early with torch's
            account of the guard that broke (the capture runs under the
            ``fail_on_recompile`` stance). Not the modes that record CUDA graphs of
            their own (``reduce-overhead``, ``max-autotune``).
        compiled_inside: ``forward`` calls a ``torch.compile``-d function itself (a
            compiled model inside a forward that also does eager work): as with
            ``compile_options``, every bucket runs the full warmup, since each
            bucket's shape compiles in its first run.

    Raises:
        CudaGraphsTypeError: an argument of the wrong type (naming it): ``forward`` or
            ``plan`` not callable, ``config`` not a ``BucketConfig``, ``inputs`` not a
            sequence of ``InputSpec``, ``output_row_dim`` or ``slots`` not an int,
            ``compile_options`` not a mapping, ``pool`` not a ``GraphMemoryPool``.
        CudaGraphsValueError: ``compile_options`` whose mode records CUDA graphs of
            its own, ``slots`` below 1, a device torch does not know, input
            specs that repeat names or lack the largest bucket's rows.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        inputs: Sequence[InputSpec],
        config: BucketConfig | None = None,
        *,
        device: torch.device | str = "cuda",
        output_row_dim: int = 0,
        require_all_buckets: bool | None = None,
        group: object | None = None,
        capture_backend: BucketBackend | None = None,
        static_outputs: bool = False,
        pool: GraphMemoryPool | None = None,
        slots: int = 1,
        plan: Callable[[Bucket, int], None] | None = None,
        compile_options: Mapping[str, Any] | None = None,
        compiled_inside: bool = False,
    ) -> None:
        self.eager_forward = check_callable("forward", forward)
        self.config = _checked_config(config)
        self.slots = check_int("slots", slots, minimum=1)
        self.output_row_dim = check_int("output_row_dim", output_row_dim)
        self.plan = None if plan is None else check_callable("plan", plan)
        self.device = check_device("device", device)
        check_instance(
            "require_all_buckets", require_all_buckets, (bool, type(None)), "a bool or None"
        )
        check_instance("static_outputs", static_outputs, bool, "a bool")
        check_instance("pool", pool, (GraphMemoryPool, type(None)), "a GraphMemoryPool or None")
        self.compile_options = check_compile_options("GraphRunner", compile_options)
        check_instance("compiled_inside", compiled_inside, bool, "a bool")
        if capture_backend is not None:
            check_callable("capture_backend", capture_backend)
        self.specs = check_specs(inputs, self.config.largest.rows)
        # Compiled once per runner (torch.compile itself compiles per bucket shape, in
        # warmup, never inside a capture).
        self.forward = (
            forward if compile_options is None else torch.compile(forward, **compile_options)
        )
        self.require_all_buckets = require_all_buckets
        self.group = group
        self.pool = pool
        #: The caller's stand-in for the CUDA capture, or ``None``.
        self.capture_backend = capture_backend
        #: How each bucket is captured: ``capture_backend``, else a graph (with static
        #: outputs when ``static_outputs``).
        self.backend: BucketBackend = capture_backend or (
            static_outputs_backend if static_outputs else default_backend
        )
        #: Every bucket warms up fully: forward is compiled here or compiles inside.
        self.compiles = compile_options is not None or compiled_inside
        #: What the last capture made (``None`` before capture and after close).
        self.captured: CapturedBuckets | None = None
        #: What the last capture found; kept after close and after a failed capture.
        self.report = CaptureReport()
        self._warn = WarnOnce(logger)
        self._path = CallPath(
            self.eager_forward, self.config, self.slots, self.plan, group, self._warn
        )

    # ---- capture ---------------------------------------------------------------------
    def capture(
        self,
        make_inputs: Callable[[Bucket], Mapping[str, torch.Tensor]],
        warmup: int = 2,
        *,
        plan_memory: bool = False,
        free_bytes: int | None = None,
        headroom_bytes: int = 0,
        measure: Callable[[Bucket], BucketCost] | None = None,
        progress: bool | None = None,
    ) -> None:
        """Capture every configured bucket, largest first, into one pool.

        A transaction: if it raises, every graph it captured is released and the
        runner holds none; ``report`` (and ``dropped_buckets``) says why buckets went.

        Args:
            make_inputs: dummy inputs for a bucket (all its rows real), staged before
                its warmup and capture.
            warmup: eager runs before the first bucket's capture; later buckets run
                ``min(warmup, 1)``: one-time costs (library handles, workspaces, lazy
                state) fall on the first, and one run per shape still meets anything
                made per shape. With ``compile_options`` or ``compiled_inside`` every
                bucket runs ``warmup`` (each compiles its own shape).
            plan_memory: first measure every bucket (``measure``; by default an eager
                step's peak, a thrown-away capture and the driver's executable memory)
                and capture only the buckets :func:`plan_buckets` fits into
                ``free_bytes`` (default: the device's free memory); the others are
                dropped with the plan's reason, and a bucket whose measurement fails
                is dropped like a failed capture. ``memory_plan`` keeps the plan, and
                ``memory_used`` what the captures then took (both logged at INFO).
            headroom_bytes: memory the plan keeps free besides the largest eager step.

        Under ``CUDAGRAPHS_DISABLE=1`` (read now) each bucket gets an
        :class:`~cudagraphs.capture.EagerGraph` instead of a graph; warmup and the memory plan are
        skipped, and a WARNING says so.

        Raises:
            CudaGraphsTypeError, CudaGraphsValueError: a bad argument (naming it), a
                bad environment flag, or a device that is not CUDA with the real
                capture (no ``capture_backend``, not disabled).
            NoCudaDeviceError: a CUDA device and torch finds none (before any CUDA
                call).
            CudaGraphsStateError: the runner is captured already (``close()`` first).
            CudaGraphOutputError: an output tensor of some bucket or slot lacks the
                bucket's rows in ``output_row_dim`` (naming its path and shape).
            CudaGraphCaptureError: a bucket was dropped and all are required.

        Each bucket's warmup and capture seconds are in ``stats()["capture_seconds"]``
        and said in an INFO line per bucket; ``progress`` shows a tqdm bar as well
        (``None``: when tqdm is installed and stderr is a terminal).
        """
        check_callable("make_inputs", make_inputs)
        warmup = check_int("warmup", warmup, minimum=0)
        if free_bytes is not None:
            check_int("free_bytes", free_bytes, minimum=0)
        headroom_bytes = check_int("headroom_bytes", headroom_bytes, minimum=0)
        if measure is not None:
            check_callable("measure", measure)
        if self.captured is not None:
            raise CudaGraphsStateError(
                "GraphRunner.capture() on a runner that is captured already; close() it first"
            )
        args = CaptureArgs(
            forward=self.forward,
            specs=self.specs,
            config=self.config,
            device=self.device,
            make_inputs=make_inputs,
            backend=self.backend,
            stand_in=self.capture_backend is not None,
            slots=self.slots,
            output_row_dim=self.output_row_dim,
            pool=self.pool,
            group=self.group,
            require_all_buckets=self.require_all_buckets,
            compiles=self.compiles,
            warmup=warmup,
            plan_memory=plan_memory,
            free_bytes=free_bytes,
            headroom_bytes=headroom_bytes,
            measure=measure,
            progress=progress,
        )
        self.report = CaptureReport()
        self.captured = capture_buckets(args, self.report, self._warn)
        self._path.serve(self.captured)
        if not self.captured.graphs:
            self._warn(
                "no_graphs",
                "GraphRunner: no bucket was captured (%d dropped, see the ERROR lines): every "
                "batch runs eagerly, counted in stats()['eager_runs']['no_graphs']",
                len(self.report.dropped),
            )

    # ---- run -------------------------------------------------------------------------
    def select(self, batch_size: int, num_tokens: int | None = None) -> Bucket | None:
        """The captured bucket a batch would replay on (``None``: eager).

        Raises:
            CudaGraphsValueError: as :func:`~cudagraphs.serving.buckets.choose_bucket`.
        """
        return self._path.choose(batch_size, num_tokens).bucket

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        *,
        batch_size: int | None = None,
        num_tokens: int | None = None,
        copy_output: bool = False,
    ) -> Any:
        """Run one step: replay the tightest captured bucket, or eagerly
        (:class:`~cudagraphs.serving.call_path.CallPath` shows each step of it).

        Args:
            inputs: the real rows of every named input (a tensor of another dtype is
                converted when that loses nothing).
            batch_size: sequences in the batch (default: the inputs' row count).
            num_tokens: packed tokens, for token buckets (ignored, with a WARNING
                once, by a config without token buckets).
            copy_output: return owned copies instead of borrowed views.

        Returns:
            forward's output tree with every tensor cut to the batch's rows in
            ``output_row_dim``: views of the graph's outputs, overwritten by the next
            replay of the bucket, unless ``copy_output``; the views (and their
            containers) are the same objects at every step with this row count, so
            read them, don't modify them. An eager run (counted in ``eager_runs`` by
            cause, said once per cause at WARNING) returns forward's own output.

        Raises:
            CudaGraphsStateError: before :meth:`capture` or after :meth:`close`.
            CudaGraphInputError: inputs that differ from the specs (every difference,
                naming the input and the bucket); nothing is staged then.
            CudaGraphsTypeError, CudaGraphsValueError: a bad ``batch_size``, or token
                buckets without ``num_tokens``.
        """
        return self._path.run(inputs, batch_size, num_tokens, copy_output)

    # ---- what the runner holds -------------------------------------------------------
    @property
    def graphs(self) -> dict[Bucket, BucketGraph]:
        """Captured bucket -> its graphs, in capture order (empty before capture and
        after close). Read it, don't edit it."""
        return {} if self.captured is None else self.captured.graphs

    @property
    def slot_inputs(self) -> list[StaticInputs]:
        """The static inputs of every slot (empty before capture and after close)."""
        return [] if self.captured is None else self.captured.slot_inputs

    @property
    def static(self) -> StaticInputs | None:
        """The first slot's static inputs (``None`` before capture and after close)."""
        return None if self.captured is None else self.captured.static

    @property
    def disabled(self) -> bool:
        """``CUDAGRAPHS_DISABLE`` was set at the last capture."""
        return self.report.disabled

    @property
    def dropped_buckets(self) -> dict[Bucket, str]:
        """Bucket -> why the last capture dropped it."""
        return self.report.dropped

    @property
    def capture_times(self) -> dict[Bucket, CaptureTime]:
        """Per captured bucket: warmup runs and the seconds its warmup and capture took."""
        return self.report.times

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The last capture's memory plan (with ``plan_memory``)."""
        return self.report.memory_plan

    @property
    def memory_used(self) -> MemoryUse | None:
        """With ``plan_memory``: what the captures actually took (logged beside the plan)."""
        return self.report.memory_used

    @property
    def memory_account(self) -> Any:
        """Where the last capture's device memory went
        (:class:`~cudagraphs.memory.MemoryAccount`; ``None`` off CUDA or when disabled)."""
        return self.report.memory_account

    @property
    def eager_runs(self) -> Counter[str]:
        """Eager runs per cause: "no_graphs", "too_large", "pad_ratio"."""
        return self._path.eager_runs

    @property
    def ignored_arguments(self) -> Counter[str]:
        """Arguments ``run()`` accepted and ignored, per name ("num_tokens")."""
        return self._path.ignored_arguments

    @property
    def replay_steps(self) -> Mapping[int, ReplayStep]:
        """Row count -> the replay its exactly matching batches take (the fast path),
        made on first use and forgotten at capture and close. Read it, don't edit it."""
        return self._path.steps

    # ---- reporting and teardown ------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the runner did, for logs and tests.

        Returns:
            ``disabled`` (``CUDAGRAPHS_DISABLE`` was set at capture), ``captured``
            (buckets with a graph; none when disabled), ``dropped`` (bucket -> why),
            ``replays`` (per bucket: replays, or eager stand-in runs when disabled),
            ``eager_runs`` (per cause: ``no_graphs``, ``too_large``, ``pad_ratio``,
            and ``disabled`` for stand-in runs) and ``ignored_arguments`` (per
            argument ``run()`` ignored: ``num_tokens``), ``capture_seconds`` (per
            captured bucket: warmup runs, warmup and capture seconds, host wall time;
            a capture's seconds include its instantiation; ``compile``: of the
            warmup's seconds, what ``torch.compile`` spent compiling for this bucket,
            and ``compiled_frames``, the frames it compiled, both 0 for eager code and
            for a bucket that reused a compile), and ``memory`` (where
            the capture's device memory went, in bytes:
            :class:`~cudagraphs.memory.MemoryAccount` as a dict; ``None`` off CUDA
            or when disabled).
        """
        replays = {str(b): g.replays for b, g in self.graphs.items()}
        eager = dict(self.eager_runs)
        if self.disabled and sum(replays.values()):
            eager["disabled"] = sum(replays.values())
        return {
            "disabled": self.disabled,
            "captured": [] if self.disabled else [str(b) for b in self.graphs],
            "dropped": {str(b): why for b, why in self.dropped_buckets.items()},
            "replays": replays,
            "eager_runs": eager,
            "ignored_arguments": dict(self.ignored_arguments),
            "capture_seconds": {
                str(b): {
                    "warmup_runs": t.warmup_runs,
                    "warmup": t.warmup_s,
                    "capture": t.capture_s,
                    "compile": t.compile_s,
                    "compiled_frames": t.compiled_frames,
                }
                for b, t in self.capture_times.items()
            },
            "memory": None if self.memory_account is None else self.memory_account.as_dict(),
        }

    def close(self) -> None:
        """Release every graph and the static buffers (idempotent); a given pool is
        kept for the next :meth:`capture`, and ``report`` keeps what the capture found."""
        captured, self.captured = self.captured, None
        self._path.serve(None)
        if captured is not None:
            captured.release()


def _checked_config(config: Any) -> BucketConfig:
    if config is None:
        return BucketConfig()
    if isinstance(config, BucketConfig):
        return config
    hint = "BucketConfig(batch_sizes=(1, 2, 4))"
    if isinstance(config, (list, tuple)) and all(isinstance(n, int) for n in config):
        hint = f"BucketConfig(batch_sizes={tuple(config)!r})"
    raise CudaGraphsTypeError(
        f"config must be a BucketConfig, got {type(config).__name__} {config!r}; pass {hint}"
    )
