"""The manager of partial graphs: one object that drives the phases of
:mod:`cudagraphs.partial` over a training model's targets (select, record, capture,
replay) and holds their life cycle; its class docs give the workflow.

Every error raised here derives from :class:`~cudagraphs.errors.CudaGraphsError`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ..checks import check_bool, check_callable
from ..compile_watch import check_compile_options
from ..diagnostics import WarnOnce
from ..errors import CudaGraphsStateError, CudaGraphsTypeError
from ..memory import RecordingSegments
from ..optimizer_state import SteppedOptimizers
from .arguments import RETIRED, Selector, as_model_parts, refuse_retired
from .build import recordings_from_model_parts
from .graphing import (
    TargetCompile,
    TargetsBackend,
    calls_to_capture,
    capture_calls,
    capture_model_first,
    compact_stepped,
    place_workspaces,
    read_disabled,
    release_cached,
)
from .recording import InferenceCalls, Recorder, TargetRecording, check_inference_calls
from .replay import PartialGraphEntry, TargetDispatcher, dispatch_paused
from .speed import SpeedCheck, speed_check_of, turn_off_slower
from .stats import stats_of
from .vocabulary import ModelScopeOff, NarrowedBlock, SkippedBlock

__all__ = ["PartialCudaGraphManager", "PartialGraphEntry", "TargetsBackend"]

logger = logging.getLogger(__name__)


class PartialCudaGraphManager:
    """Graphs for the fixed-shape pieces of a training model.

    Workflow (the constructor never captures):

    1. ``mgr = PartialCudaGraphManager.from_model_parts(model)`` plans the targets of
       each part (:func:`~.planning.plan_targets`: per decoder layer the widest
       graph-safe scope, plus whatever ``include`` names; blocks with none are in
       :attr:`skipped`, those graphed narrower in :attr:`narrowed`); ``None`` when
       there are none.
    2. ``mgr.start_recording()``, then one training step (several micro-batches are
       fine: each forward of the model parts is told apart): each target's calls are
       recorded (arguments, metadata, aliasing, controls, grad mode, autocast state,
       training flag; :mod:`.recording`).
    3. ``mgr.capture()`` graphs the recorded calls in forward order through the core
       :func:`~cudagraphs.make_graphed_callables`, with each target's parameters as
       explicit graph inputs so their gradients reach the real parameters
       (:mod:`.graphing`), times each graph against eager (:mod:`.speed`), and
       installs a dispatching forward on each graphed target (:mod:`.replay`).
    4. Train: a call that matches a recorded contract replays; any other call runs
       the module eagerly, counted per reason and said once per reason at WARNING
       with the call's mismatch report. Repeat 2-3 to add variants (another sequence
       length), up to ``max_variants``.
    5. ``mgr.stats()`` / ``mgr.log_stats(phase)``; ``mgr.close()`` (idempotent) at the
       end restores the eager modules and releases the graphs.

    What it does NOT do: graph anything outside the targets (the rest of the step
    stays eager; with the ``"model"`` scope the target is the whole model part, and the
    optimizer step stays eager), graph a target that runs more than once within one
    forward, or re-capture by itself when inputs change. Whether graphs are faster is
    judged against eager only (``speed_check``), not between scopes.

    With ``CUDAGRAPHS_DISABLE=1`` (read by ``capture()``) the same life cycle runs with
    no graph: each target's graphed function runs eagerly in place of its graph, so
    recording, contract matching and counting are those of graphed runs;
    ``stats()["disabled"]`` is 1, ``captured`` is 0, ``replayed`` counts the calls that
    matched a recorded contract and ran eagerly in its place, and a WARNING says so
    once.

    ``stats()`` keys: ``captured`` (graphs held), ``replayed``, ``fallbacks``,
    ``disabled``; one key per reason seen, each reason of
    :data:`~.vocabulary.REASON_FAMILIES` (what it means is written there) keyed by its
    family: ``fallback_<reason>`` per call run eagerly instead of replaying,
    ``skipped_<reason>`` per block discovery found and took no target from (see
    :attr:`skipped`), ``narrowed_<reason>`` per block graphed at narrower scopes than
    asked for (:attr:`narrowed`), ``model_refused_<reason>`` per part not graphed
    whole at planning although the ``"model"`` scope was asked for
    (:attr:`model_off`), ``off_<reason>`` per target turned off (a graph slower than
    eager, a stateful argument, a part graphed whole around it, a part refused at
    capture); from the core's graphs ``pool_bytes`` / ``buffer_bytes`` with one
    ``pool_bytes_<scope>`` / ``buffer_bytes_<scope>`` per scope graphed (what the
    captures grew reserved memory by; static buffers made outside the pool, shared
    ones once), and after a capture on CUDA the memory account
    (:class:`~cudagraphs.memory.MemoryAccount`) summed over the captures:
    ``pool_reserved_bytes``, ``pool_allocated_bytes``, ``unused_cache_bytes``,
    ``driver_bytes`` and ``released_bytes`` (with what :meth:`capture` itself gave
    back); ``compacted_state_bytes`` where a capture packed optimizer state; and the
    set-up time of the captures, summed in whole milliseconds: ``warmup_ms``,
    ``compile_ms`` (the part of the warmup ``torch.compile`` spent compiling, with
    ``compile_options``), ``capture_ms``, with ``compiled_frames``.

    Args:
        dispatchers: one per target, in module order, each around the target's
            recording store (built by :meth:`from_model_parts`).
        capture_backend: how recorded calls become graphed callables; the core
            ``make_graphed_callables`` by default (tests substitute an eager one).
            Called as ``backend(callables, sample_args, sample_kwargs)`` and must
            return one callable per call. Replaced by an eager one under
            ``CUDAGRAPHS_DISABLE=1``. Only the default one shares static buffers
            between the graphs of one capture (:mod:`.chaining`).
        activation_checkpointing: give each target its own memory pool (see
            :meth:`from_model_parts`).
        model_parts: the modules whose forwards recording tells apart (gradient
            accumulation). Without them any second call of a target while recording
            counts as a reuse, refused by :meth:`capture`.
        inference_calls: see :meth:`from_model_parts`.
        skipped: the blocks discovery skipped, reported by :meth:`stats`.
        narrowed: the blocks discovery narrowed, reported by :meth:`stats`.
        model_off: the parts not graphed whole, reported by :meth:`stats`.
        speed_check: see :meth:`from_model_parts`.
        compile_options: see :meth:`from_model_parts` (held as
            :attr:`compile_options`, a checked copy).

    Raises:
        CudaGraphsTypeError: a dispatcher that is not a :class:`TargetDispatcher`, a
            ``capture_backend`` that is not callable, ``activation_checkpointing``
            that is not a bool, or ``model_parts`` that are not modules.
        CudaGraphsValueError: ``inference_calls`` not ``"ignore"`` / ``"record"``.

    Threading: one training thread drives a manager.
    """

    def __init__(
        self,
        dispatchers: Sequence[TargetDispatcher],
        *,
        capture_backend: TargetsBackend | None = None,
        activation_checkpointing: bool = False,
        model_parts: Sequence[nn.Module] = (),
        inference_calls: InferenceCalls = "ignore",
        skipped: Sequence[SkippedBlock] = (),
        speed_check: bool | SpeedCheck = True,
        narrowed: Sequence[NarrowedBlock] = (),
        model_off: Sequence[ModelScopeOff] = (),
        compile_options: Mapping[str, Any] | None = None,
    ) -> None:
        #: One per target: its dispatching forward around its recording store.
        self.dispatchers = list(dispatchers)
        #: Parts not graphed whole although the ``"model"`` scope was asked for.
        self.model_off = list(model_off)
        #: Blocks discovery found but took no target from (see :class:`SkippedBlock`).
        self.skipped = list(skipped)
        #: Blocks graphed at narrower scopes than asked for (see :class:`NarrowedBlock`).
        self.narrowed = list(narrowed)
        for i, d in enumerate(self.dispatchers):
            if not isinstance(d, TargetDispatcher):
                raise CudaGraphsTypeError(
                    f"dispatchers[{i}] must be a TargetDispatcher (build the manager with "
                    f"from_model_parts), got {type(d).__name__}"
                )
        if capture_backend is not None:
            check_callable("capture_backend", capture_backend)
        self._backend = capture_backend  # None: the core's
        # Set by the caller, or on seeing a checkpoint recompute while recording.
        self.activation_checkpointing = check_bool(
            "activation_checkpointing", activation_checkpointing
        )
        self.inference_calls = check_inference_calls(inference_calls)
        self._speed_check = speed_check_of(speed_check)
        self.compile_options = check_compile_options("partial graphs", compile_options)
        self._compile = (
            None if self.compile_options is None else TargetCompile(self.compile_options)
        )
        self._warn_once = WarnOnce(logger)
        for d in self.dispatchers:
            d.warn_once = self._warn_once
        # Forwards of the parts told apart while recording (see .recording); without
        # parts, any second call of a target while recording counts as a reuse.
        self._recorder = Recorder(
            self.recordings,
            as_model_parts(model_parts) if model_parts else [],
            self.inference_calls,
            self._saw_recompute,
            logger,
            self._warn_once,
        )
        self._closed = False
        self._disabled: bool | None = None  # fixed by the first capture()
        self._released_bytes = 0  # given back to the driver after captures
        # The recording step's eager segments (see RecordingSegments: why).
        self._recording_segments = RecordingSegments()
        # The optimizers that step while recording, whose state a capture packs.
        self._stepped = SteppedOptimizers()
        self._compacted_bytes = 0

    @property
    def recordings(self) -> list[TargetRecording]:
        """The targets' recording stores, in the order of :attr:`dispatchers`."""
        return [d.recording for d in self.dispatchers]

    @property
    def entries(self) -> list[TargetDispatcher]:
        """Deprecated: :attr:`dispatchers`, by its former name, kept for one release."""
        return self.dispatchers

    @classmethod
    def from_model_parts(
        cls,
        model_parts: nn.Module | Sequence[nn.Module],
        activation_checkpointing: bool = False,
        pipeline_parallel: Any = RETIRED,
        *,
        include: Selector | None = None,
        max_variants: int = 4,
        capture_backend: TargetsBackend | None = None,
        inference_calls: InferenceCalls = "ignore",
        speed_check: bool | SpeedCheck = True,
        experts_implementation: str | None = None,
        scopes: Sequence[str] | None = None,
        compile_options: Mapping[str, Any] | None = None,
        attention: Any = RETIRED,
        router: Any = RETIRED,
    ) -> PartialCudaGraphManager | None:
        """Discover targets in already-built model parts (pipeline stages).

        Args:
            model_parts: one ``nn.Module`` or a sequence of them (pipeline stages);
                borrowed: their target modules get a dispatching ``forward`` from
                ``capture()`` until ``close()``.
            activation_checkpointing: layers are recomputed in backward, so every
                target replays its forward graph a second time, after later targets'
                backward graphs ran. Each target then gets its own memory pool, so
                that replay cannot overwrite another graph's live output (more memory,
                never wrong values). A recompute seen while recording turns this on by
                itself. Checkpoint wrapper modules are always unwrapped.
            include: more targets: one glob pattern over qualified names (a plain
                string such as ``"model.layers.*.mlp"``), a list or tuple of
                patterns, or a predicate ``(name, module) -> bool``.
            max_variants: recorded variants per target (for example sequence lengths,
                inference variants included).
            capture_backend: see the class docs.
            inference_calls: what recording does with a target call made under
                ``torch.no_grad()`` or in eval mode (an evaluation during the
                recorded step): ``"ignore"`` (default) leaves it unrecorded, so such
                calls run eagerly later, counted as fallbacks; ``"record"`` records
                it as an inference variant, captured forward-only in a memory pool of
                its own (replaying it never touches the training graphs' memory).
            speed_check: right after capture, time each target's graph against its
                eager forward+backward on the recorded inputs (interleaved rounds,
                :mod:`.speed`) and give a target whose graph is slower its eager
                forward back, counted in ``stats()['off_slower_than_eager']`` and
                logged. ``True`` (default) checks targets on a CUDA device; ``False``
                never; a :class:`~cudagraphs.partial.speed.SpeedCheck` sets rounds and
                calls (and checks on any device).
            scopes: what to graph in each decoder layer, from
                :data:`~cudagraphs.partial.SCOPES`: ``"attention"``, ``"moe_router"``,
                ``"mlp"`` (a dense MLP), ``"moe"`` (the whole MoE sublayer: router,
                experts, shared experts, combine) and ``"layer"`` (the whole block).
                Per layer the widest requested scope that is graph-safe is taken: a
                whole layer needs an attention and static experts (``grouped_mm`` /
                ``batched_mm``, as the model says). A layer that gets less than asked
                for is listed in :attr:`narrowed` (``stats()['narrowed_<reason>']``,
                one WARNING). ``None`` (default): all of :data:`SCOPES`, so each layer
                is graphed as widely as is safe (said at INFO where a layer narrows).
                :func:`~cudagraphs.partial.plan_targets` with the same ``scopes`` and
                ``include`` previews what is graphed in each part. ``"model"``
                (:data:`~cudagraphs.partial.MODEL_SCOPE`, never a default) graphs
                each part whole, its layers kept in reserve should it not capture
                (:mod:`.model_scope`; refusals in :attr:`model_off`).
            experts_implementation: switch the Hugging Face MoE model(s) in the parts
                to this experts implementation first (``"grouped_mm"``: static shapes,
                so whole MoE blocks and layers are graph-safe), with the model's own
                ``set_experts_implementation``. ``None`` (default) leaves the model as
                it is; an MoE layer whose experts run the ``eager`` loop is then
                graphed at narrower scopes, said in the log.
            compile_options: keywords for ``torch.compile`` (``{}``: its defaults):
                each target's graph records its compiled forward and backward,
                inductor's fused kernels in place of the eager ones. The capture's
                warmup compiles; a compile in its last iteration or in the capture
                (a recompile, a graph break) is refused with
                :class:`~cudagraphs.errors.CompiledCaptureError`. Modes that make
                inductor record CUDA graphs of its own (``"reduce-overhead"``,
                ``"max-autotune"``) are refused. Calls that fall back run the
                module's own, uncompiled forward. Compile the model this way, not
                with ``torch.compile(model)`` or ``module.compile()``, which are
                refused here: the compiled model would trace the targets'
                dispatching forwards. ``None`` (default): eager kernels.
            pipeline_parallel, attention, router: retired; passing any of them raises
                :class:`~cudagraphs.errors.CudaGraphsTypeError` naming what to pass
                instead (each part is graphed on its own; ``scopes=`` says what is
                graphed).

        Targets under FSDP2 (``fully_shard``) are supported: their unsharded
        parameters are copied into the graph at each call (:mod:`.fsdp`).

        Returns:
            A manager, or ``None`` when nothing is graphable (said at WARNING, with
            the reason: the model trains eagerly).

        Raises:
            CudaGraphsTypeError: a retired argument, or an argument of the wrong type
                (named): model parts that are not modules, a non-bool flag,
                ``max_variants`` that is not an int (``True`` included), an
                ``include`` of an unusable type, a ``capture_backend`` that is not
                callable.
            CudaGraphsValueError: ``max_variants`` < 1, ``inference_calls`` not one of
                ``"ignore"`` / ``"record"``, or meta-device parameters in a target.
            TargetSelectionError: a module shared under two names, nested targets, or
                DTensor parameters that FSDP2 does not manage.
        """
        refuse_retired(
            "from_model_parts",
            pipeline_parallel=pipeline_parallel,
            attention=attention,
            router=router,
        )
        found = recordings_from_model_parts(
            model_parts,
            activation_checkpointing=activation_checkpointing,
            include=include,
            max_variants=max_variants,
            capture_backend=capture_backend,
            inference_calls=inference_calls,
            speed_check=speed_check,
            experts_implementation=experts_implementation,
            scopes=scopes,
            compile_options=compile_options,
            logger=logger,
        )
        if found is None:
            return None
        parts, built = found
        return cls(
            [TargetDispatcher(rec) for rec in built.recordings],
            skipped=built.skipped,
            narrowed=built.narrowed,
            model_off=built.model_off,
            capture_backend=capture_backend,
            activation_checkpointing=activation_checkpointing,
            model_parts=parts,
            inference_calls=inference_calls,
            speed_check=speed_check,
            compile_options=compile_options,
        )

    def start_recording(self) -> None:
        """Install recorders on every target; the forwards that follow record each
        target's calls (arguments, metadata, aliasing, controls, modes) until
        :meth:`stop_recording` or :meth:`capture`.

        Until then the caching allocator makes expandable segments, so that the
        release before the capture gives back the memory the step's activations
        leave between the state it keeps (:class:`~cudagraphs.memory.RecordingSegments`;
        ``CUDAGRAPHS_EXPANDABLE_RECORDING=0`` turns it off).

        Several forwards may run while recording (the micro-batches of one step under
        gradient accumulation): a target's calls with equal contracts are recorded
        once, distinct ones as variants, up to ``max_variants``. A target called twice
        within ONE forward is refused by :meth:`capture`. Calls under
        ``torch.no_grad()`` or in eval mode follow ``inference_calls``.

        Raises:
            CudaGraphsStateError: the manager was closed.
        """
        self._check_open()
        self._recorder.start()
        self._recording_segments.enter()
        self._stepped.enter()

    def _saw_recompute(self, rec: TargetRecording) -> None:
        if not self.activation_checkpointing:
            logger.info("partial graphs: %s is recomputed in backward", rec.name)
        self.activation_checkpointing = True

    @property
    def recording(self) -> bool:
        """Whether recorders are installed (between start_recording and
        stop_recording / capture)."""
        return self._recorder.active

    def stop_recording(self) -> None:
        """Remove the recorders; what was recorded is kept for :meth:`capture` (which
        calls this itself). Calls made after it are not recorded. A no-op when not
        recording, and after :meth:`close`."""
        self._recorder.stop()
        self._recording_segments.leave()
        self._stepped.leave()

    def capture(self) -> None:
        """Graph every recorded, not yet graphed call, in real forward order
        (:mod:`.graphing`), then install the dispatching forward
        (:class:`~.replay.TargetDispatcher`) on each target that holds a graph and give
        each target turned off its own forward back.

        Before and after, on CUDA, the memory the caching allocator keeps cached and
        no tensor uses is given back to the driver
        (:func:`~cudagraphs.memory.release_unused_cache`; ``CUDAGRAPHS_KEEP_CACHE=1``
        keeps it): the eager steps before the capture
        cached the graphed targets' activations too, which now live in the graphs'
        pools. The next step's eager allocations come from the driver once.

        In order, on CUDA: drop the eager cuBLAS workspaces, whose blocks each pin a
        segment of the eager working set, and release (:func:`.graphing.release_cached`);
        pack the scattered state of the optimizers that
        stepped while recording and give its segments back, never above the peak
        reserved so far (:mod:`cudagraphs.optimizer_state`;
        ``CUDAGRAPHS_COMPACT_STATE=0`` turns it off); the captures; release; pack
        again (the recorded calls' tensors that shared segments with the state are
        gone now); and, where eager model code remains beside the graphs, make the
        eager cuBLAS workspaces (:func:`.graphing.place_workspaces`), so the next
        backward does not cut its workspace out of the loss's freed blocks.

        Reads ``CUDAGRAPHS_DISABLE`` (:func:`cudagraphs.settings.graphs_disabled`):
        when set, the eager backend stands in for the graphing one (see the class
        docs) and a WARNING says so once. The first capture fixes the mode for the
        manager's life.

        Raises:
            CudaGraphsStateError: the manager was closed; nothing was recorded (run a
                forward after start_recording); or ``CUDAGRAPHS_DISABLE`` changed since
                this manager's first capture.
            CudaGraphsValueError: ``CUDAGRAPHS_DISABLE`` is not a boolean, or the
                capture backend returned the wrong number of callables.
            TargetSelectionError: a target ran more than once in the recorded forward.

        An error of the capture backend (the core's ``CudaGraphCaptureError``, say)
        propagates; the recorded calls are kept, so ``capture()`` can run again.
        """
        self._check_open()
        disabled = read_disabled(self._disabled)
        self.stop_recording()
        recordings = self.recordings
        todo = calls_to_capture(recordings, self._recorder, logger)
        self._disabled = disabled

        def capture(calls: list) -> list:
            return capture_calls(
                calls,
                self._backend,
                disabled=disabled,
                pooled=self.activation_checkpointing,
                speed_check=self._speed_check,
                targets=len(recordings),
                warn_once=self._warn_once,
                logger=logger,
                compiler=self._compile,
            )

        # Around the captures, the eager steps' unused cache goes back to the driver
        # (release_cached): the pools take its place instead of adding to it.
        release = bool(todo) and not disabled
        self._released_bytes += release_cached(release, drop_workspaces=True)
        # Before the pools grow: the recording step's state, packed, gives its
        # segments back under the peak that step set (compact_stepped).
        self._compact(release, recordings)
        # The captures and speed checks run the targets' own forwards.
        with dispatch_paused(self.dispatchers):
            # Whole parts first: the layers inside one graphed whole are not captured.
            todo = capture_model_first(
                todo,
                recordings,
                capture,
                activation_checkpointing=self.activation_checkpointing,
                logger=logger,
            )
            turn_off_slower(capture(todo), logger)
        for d in self.dispatchers:
            if d.recording.off_reason is not None:
                d.restore()
            elif d.recording.graphs():
                d.install()
        self._released_bytes += release_cached(release)
        # Again: the segments the recorded calls' tensors shared with the state are
        # held by the state alone once the captures are done with those tensors.
        self._compact(release, recordings)
        place_workspaces(release, recordings)

    def _compact(self, release: bool, recordings: Sequence[TargetRecording]) -> None:
        moved, freed = compact_stepped(release, self._stepped.optimizers(), recordings)
        self._compacted_bytes += moved
        self._released_bytes += freed

    def stats(self) -> dict[str, int]:
        """Totals over all targets (keys: see the class docs)."""
        return stats_of(
            self.dispatchers,
            self.skipped,
            self.narrowed,
            self._disabled,
            self.model_off,
            self._released_bytes,
            self._compacted_bytes,
        )

    def log_stats(self, phase: str) -> None:
        """Log :meth:`stats` at INFO, labelled with ``phase``."""
        logger.info("partial graphs [%s]: %s", phase, self.stats())

    def close(self) -> None:
        """Restore every module's eager forward, drop recorders and graphs (idempotent).
        Counters are kept: ``stats()`` still reports replays and fallbacks."""
        if self._closed:
            return
        self.stop_recording()
        for d in self.dispatchers:
            d.restore()
            d.recording.release_graphs()
            d.recording.variants = []
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CudaGraphsStateError(
                "this PartialCudaGraphManager was closed (its modules run eagerly again); "
                "build a new one with from_model_parts"
            )
