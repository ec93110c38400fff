"""PartialCudaGraphManager: graph decoder layers (whole, or their attention, MoE,
router or MLP: :mod:`.scopes`) inside eager training.

Life cycle (the constructor never captures):

1. ``from_model_parts(parts)`` discovers targets from the model's metadata or its
   structure (:mod:`.discovery`); blocks with nothing graph-safe are listed in
   ``skipped``.
2. ``start_recording()`` installs recorders; run one eager step (all its
   micro-batches: each forward of the model parts is told apart, :mod:`.recording`).
3. ``capture()`` graphs every recorded call in real forward order through the core
   :func:`~cudagraphs.make_graphed_callables`, with the target's parameters passed
   as explicit graph inputs so their gradients reach the real parameters.
4. Later calls replay when they match a recorded contract (:mod:`.contract`) and run
   eagerly otherwise, counted per reason. The first eager run of each reason is
   logged at WARNING with the target and the call's mismatch report; later ones are
   only counted. ``stats()`` / ``log_stats()`` report.
5. ``close()`` (idempotent) restores the eager modules and releases the graphs.

With ``CUDAGRAPHS_DISABLE=1`` (read by ``capture()``) the same life cycle runs with
no graph: each target's graphed callable is its adapter run eagerly, so recording,
contract matching and counting are those of graphed runs; ``stats()["disabled"]``
is 1 and a WARNING says so once.

Every error raised here derives from :class:`~cudagraphs.errors.CudaGraphsError`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..checks import check_bool, check_callable
from ..diagnostics import WarnOnce
from ..errors import CudaGraphsStateError, CudaGraphsTypeError
from ..forward_swap import swap_forward
from .arguments import RETIRED, Selector, as_model_parts, refuse_retired
from .build import entries_from_model_parts
from .entry import PartialGraphEntry
from .graphing import (
    TargetsBackend,
    _default_backend,
    calls_to_capture,
    capture_calls,
    read_disabled,
    release_cached,
)
from .model_scope import capture_model_first
from .recording import InferenceCalls, Recorder, check_inference_calls
from .speed import SpeedCheck, speed_check_of, turn_off_slower
from .stats import stats_of
from .vocabulary import ModelScopeOff, NarrowedBlock, SkippedBlock

__all__ = ["TargetsBackend", "PartialCudaGraphManager", "PartialGraphEntry"]

logger = logging.getLogger(__name__)


class PartialCudaGraphManager:
    """Graphs for the fixed-shape pieces of a training model.

    Workflow:

    1. ``mgr = PartialCudaGraphManager.from_model_parts(model)`` finds the targets
       (each block's attention, MoE routers, whatever ``include`` names); ``None``
       when there are none.
    2. ``mgr.start_recording()``, then one training step (several micro-batches
       are fine): each target's calls are recorded (arguments, metadata, aliasing,
       controls, grad mode, autocast state, training flag).
    3. ``mgr.capture()`` graphs the recorded calls in forward order and installs a
       dispatching forward on each target.
    4. Train: a call that matches a recorded contract replays; any other call runs
       the module eagerly, counted per reason and said once per reason at WARNING.
       Repeat 2-3 to add variants (another sequence length), up to ``max_variants``.
    5. ``mgr.stats()`` / ``mgr.log_stats(phase)``; ``mgr.close()`` at the end.

    What it does NOT do: graph anything outside the targets (the rest of the step
    stays eager; with the ``"model"`` scope the target is the whole model part, and the
    optimizer step stays eager), graph a target that runs more than once within one
    forward, or re-capture by itself when inputs change. Whether graphs are faster is
    judged against eager only (``speed_check``), not between scopes.

    ``stats()`` keys: ``captured`` (graphs held), ``replayed``, ``fallbacks``,
    ``disabled`` (1 under ``CUDAGRAPHS_DISABLE=1``, else 0), and one
    ``skipped_<reason>`` per reason a block was skipped by discovery (a Mamba or
    linear-attention layer: ``skipped_no_graph_safe_scope``; the blocks and the fixes
    are in :attr:`skipped` and the WARNING logged at construction),
    ``narrowed_<reason>`` per block graphed at narrower scopes than asked for
    (``eager_experts``, ``unknown_experts``, ``host_grouped_mm``, ``no_attention``: see
    :attr:`narrowed`),
    ``off_slower_than_eager`` (targets whose graph was measured slower than eager and
    that run eagerly since: see ``speed_check``), ``off_stateful_argument`` (targets
    called with an object holding tensors, a KV cache), with the ``"model"`` scope
    ``model_refused_<reason>`` per part not made a target, ``off_model_<reason>`` per
    part refused at capture and ``off_in_model_graph`` per target inside a part graphed
    whole (:mod:`.model_scope`), and one
    ``fallback_<reason>`` per reason seen: a name from
    :data:`~cudagraphs.partial.contract.REASONS`, ``not_captured`` (recorded, not
    captured yet), ``param_storage`` (a parameter replaced since capture) or
    ``unchained_input`` (another tensor where the graph reads the previous target's
    output in place: :mod:`.chaining`), and from the core's graphs ``pool_bytes`` /
    ``buffer_bytes`` with one ``pool_bytes_<scope>`` / ``buffer_bytes_<scope>`` per
    scope graphed (what the captures grew reserved memory by; static buffers made
    outside the pool, shared ones once), and after a capture on CUDA the memory
    account (:class:`~cudagraphs.memory.MemoryAccount`) summed over the captures:
    ``pool_reserved_bytes``, ``pool_allocated_bytes``, ``unused_cache_bytes``,
    ``driver_bytes`` and ``released_bytes`` (with what :meth:`capture` itself gave
    back). Under
    ``CUDAGRAPHS_DISABLE=1`` no graph exists (``captured`` is 0) and ``replayed``
    counts the calls that matched a recorded contract and ran eagerly in its place.

    Args:
        entries: one per target, in module order (built by :meth:`from_model_parts`).
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
        speed_check: see :meth:`from_model_parts`.

    Raises:
        CudaGraphsTypeError: an entry that is not a :class:`PartialGraphEntry`, a
            ``capture_backend`` that is not callable, ``activation_checkpointing``
            that is not a bool, or ``model_parts`` that are not modules.
        CudaGraphsValueError: ``inference_calls`` not ``"ignore"`` / ``"record"``.

    Threading: one training thread drives a manager.
    """

    def __init__(
        self,
        entries: Sequence[PartialGraphEntry],
        *,
        capture_backend: TargetsBackend | None = None,
        activation_checkpointing: bool = False,
        model_parts: Sequence[nn.Module] = (),
        inference_calls: InferenceCalls = "ignore",
        skipped: Sequence[SkippedBlock] = (),
        speed_check: bool | SpeedCheck = True,
        narrowed: Sequence[NarrowedBlock] = (),
        model_off: Sequence[ModelScopeOff] = (),
    ) -> None:
        self.entries = list(entries)
        #: Parts not graphed whole although the ``"model"`` scope was asked for.
        self.model_off = list(model_off)
        #: Blocks discovery found but took no target from (see :class:`SkippedBlock`).
        self.skipped = list(skipped)
        #: Blocks graphed at narrower scopes than asked for (see :class:`NarrowedBlock`).
        self.narrowed = list(narrowed)
        for i, entry in enumerate(self.entries):
            if not isinstance(entry, PartialGraphEntry):
                raise CudaGraphsTypeError(
                    f"entries[{i}] must be a PartialGraphEntry (build the manager with "
                    f"from_model_parts), got {type(entry).__name__}"
                )
        if capture_backend is not None:
            check_callable("capture_backend", capture_backend)
        self._backend = capture_backend or _default_backend
        # Set by the caller, or on seeing a checkpoint recompute while recording.
        self.activation_checkpointing = check_bool(
            "activation_checkpointing", activation_checkpointing
        )
        self.inference_calls = check_inference_calls(inference_calls)
        self._speed_check = speed_check_of(speed_check)
        # Forwards of the parts told apart while recording (see .recording); without
        # parts, any second call of a target while recording counts as a reuse.
        self._recorder = Recorder(
            self.entries,
            as_model_parts(model_parts) if model_parts else [],
            self.inference_calls,
            self._saw_recompute,
            logger,
        )
        self._closed = False
        self._disabled: bool | None = None  # fixed by the first capture()
        self._released_bytes = 0  # given back to the driver after captures
        self._warn_once = WarnOnce(logger)
        for entry in self.entries:
            entry.warn_once = self._warn_once

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
                is graphed as widely as is safe (said at INFO where a layer narrows);
                :func:`~cudagraphs.partial.plan_targets` previews it per part. ``"model"``
                (:data:`~cudagraphs.partial.MODEL_SCOPE`, never a default) graphs
                each part whole, its layers kept in reserve should it not capture
                (:mod:`.model_scope`; refusals in :attr:`model_off`).
            experts_implementation: switch the Hugging Face MoE model(s) in the parts
                to this experts implementation first (``"grouped_mm"``: static shapes,
                so whole MoE blocks and layers are graph-safe), with the model's own
                ``set_experts_implementation``. ``None`` (default) leaves the model as
                it is; an MoE layer whose experts run the ``eager`` loop is then
                graphed at narrower scopes, said in the log.
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
                (named): model parts that are not modules, a non-bool flag, ``max_variants`` that is not
                an int (``True`` included), an ``include`` of an unusable type, a
                ``capture_backend`` that is not callable.
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
        found = entries_from_model_parts(
            model_parts,
            activation_checkpointing=activation_checkpointing,
            include=include,
            max_variants=max_variants,
            capture_backend=capture_backend,
            inference_calls=inference_calls,
            speed_check=speed_check,
            experts_implementation=experts_implementation,
            scopes=scopes,
            logger=logger,
        )
        if found is None:
            return None
        parts, built = found
        return cls(
            built.entries,
            skipped=built.skipped,
            narrowed=built.narrowed,
            model_off=built.model_off,
            capture_backend=capture_backend,
            activation_checkpointing=activation_checkpointing,
            model_parts=parts,
            inference_calls=inference_calls,
            speed_check=speed_check,
        )

    # ---- recording ------------------------------------------------------------------
    def start_recording(self) -> None:
        """Install recorders on every target; the forwards that follow record each
        target's calls (arguments, metadata, aliasing, controls, modes) until
        :meth:`stop_recording` or :meth:`capture`.

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

    def _saw_recompute(self, entry: PartialGraphEntry) -> None:
        if not self.activation_checkpointing:
            logger.info("partial graphs: %s is recomputed in backward", entry.name)
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

    # ---- capture --------------------------------------------------------------------
    def capture(self) -> None:
        """Graph every recorded, not yet graphed call, in real forward order, and
        install the dispatching forward on each target that has a graph.

        Before and after, on CUDA, the memory the caching allocator keeps cached and
        no tensor uses is given back to the driver (:func:`~cudagraphs.memory.release_unused_cache`;
        ``CUDAGRAPHS_KEEP_CACHE=1`` keeps it): the eager steps before the capture
        cached the graphed targets' activations too, which now live in the graphs'
        pools. The next step's eager allocations come from the driver once.

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
        todo = calls_to_capture(self.entries, self._recorder, logger)
        self._disabled = disabled

        def capture(calls: list) -> list:
            return capture_calls(
                calls,
                self._backend,
                disabled=disabled,
                pooled=self.activation_checkpointing,
                speed_check=self._speed_check,
                targets=len(self.entries),
                warn_once=self._warn_once,
                logger=logger,
            )

        # Around the captures, the eager steps' unused cache goes back to the driver
        # (release_cached): the pools take its place instead of adding to it.
        release = bool(todo) and not disabled
        self._released_bytes += release_cached(release)
        # Whole parts first: the layers inside one graphed whole are not captured.
        todo = capture_model_first(
            todo,
            self.entries,
            capture,
            activation_checkpointing=self.activation_checkpointing,
            logger=logger,
        )
        verdicts = capture(todo)
        for entry in self.entries:
            if entry.swap is None and entry.graphs():
                entry.swap = swap_forward(entry.target.module, entry.dispatch)
        turn_off_slower(verdicts, logger)
        self._released_bytes += release_cached(release)

    # ---- reporting and teardown -------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Totals over all targets (keys: see the class docs)."""
        return stats_of(
            self.entries,
            self.skipped,
            self.narrowed,
            self._disabled,
            self.model_off,
            self._released_bytes,
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
        for entry in self.entries:
            if entry.swap is not None:
                entry.swap.restore()
                entry.swap = None
            entry.release_graphs()
            entry.variants = []
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CudaGraphsStateError(
                "this PartialCudaGraphManager was closed (its modules run eagerly again); "
                "build a new one with from_model_parts"
            )
