"""PartialCudaGraphManager: graph attention and MoE routers inside eager training.

Life cycle (the constructor never captures):

1. ``from_model_parts(parts)`` discovers targets structurally (:mod:`.discovery`).
2. ``start_recording()`` installs one-shot recorders; run one eager iteration.
3. ``capture()`` graphs every recorded call in real forward order through the core
   :func:`~cudagraphs.make_graphed_callables`, with the target's parameters passed
   as explicit graph inputs so their gradients reach the real parameters.
4. Later calls replay when they match a recorded contract (:mod:`.contract`) and run
   eagerly otherwise, counted per reason. ``stats()`` / ``log_stats()`` report.
5. ``close()`` (idempotent) restores the eager modules and releases the graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import CudaGraphInputError
from .contract import CallContract, ContractSet, FallbackCounter
from .discovery import Selector, Target, TargetSelectionError, model_label, select_targets
from .fsdp import fsdp_managed_modules

__all__ = ["CaptureBackend", "PartialCudaGraphManager", "PartialGraphEntry"]

logger = logging.getLogger(__name__)

#: ``backend(callables, sample_args, sample_kwargs) -> graphed callables`` (one each).
CaptureBackend = Callable[[tuple, tuple, list], Sequence[Callable[..., Any]]]


def _default_backend(callables: tuple, sample_args: tuple, sample_kwargs: list) -> Sequence[Any]:
    from ..core import make_graphed_callables

    result = make_graphed_callables(callables, sample_args, sample_kwargs=sample_kwargs)
    return result if isinstance(result, tuple) else (result,)


def _detached_clone(value: Any) -> Any:
    """A sample of a recorded argument: same metadata, its own storage, no history."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def _check_parameters(target: Target, fsdp: bool) -> list[tuple[str, nn.Parameter]]:
    params = [(n, p) for n, p in target.module.named_parameters() if p.requires_grad]
    for name, p in target.module.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"{target.name}.{name} is on the meta device (not materialized); "
                "materialize the model (to_empty + init) before recording"
            )
        if not fsdp and (type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor"):
            raise ValueError(
                f"{target.name}.{name} is a DTensor outside FSDP2 (tensor parallelism?); "
                "only FSDP2-sharded parameters (fully_shard) are supported. Leave this "
                "module out of the targets."
            )
    return params


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (where an
    activation-checkpoint recompute calls modules again)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


@dataclass
class PartialGraphEntry:
    """One target: its recorded variants, their graphs, counters and hooks."""

    target: Target
    contracts: ContractSet
    counter: FallbackCounter = field(default_factory=FallbackCounter)
    samples: list[tuple[tuple, dict]] = field(default_factory=list)  # per variant
    graphs: list[Any] = field(default_factory=list)  # per variant (None until captured)
    param_names: tuple[str, ...] = ()
    params: tuple[nn.Parameter, ...] = ()
    # Under FSDP2 (see .fsdp): parameters are fetched at each call and copied into the
    # graph; param_samples holds their recorded values per variant until capture.
    fsdp: bool = False
    param_samples: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    original_forward: Callable[..., Any] | None = None
    instance_forward: Any = None  # a forward the instance had of its own, to restore
    recorder: Any = None  # the one-shot hook handle while recording
    calls_while_recording: int = 0
    bypass: bool = False  # set while the graphed adapter itself runs the module

    @property
    def name(self) -> str:
        return self.target.name

    def record(self, args: tuple, kwargs: dict) -> None:
        self.calls_while_recording += 1
        if self.calls_while_recording > 1:
            return  # reported by capture(): one graph cannot stand for two calls
        contract = CallContract.from_call(args, kwargs, training=self.target.module.training)
        index = self.contracts.add(contract)
        if index is None:
            logger.warning(
                "%s: %d variants recorded already; this call will run eagerly",
                self.name,
                self.contracts.max_variants,
            )
        elif index == len(self.samples):
            self.samples.append(
                (
                    tuple(_detached_clone(a) for a in args),
                    {k: _detached_clone(v) for k, v in kwargs.items()},
                )
            )
            if self.fsdp:
                # Plain tensors, not parameters: the graph copies these inputs per call.
                self.param_samples.append(tuple(_detached_clone(p) for p in self.call_params()))
            self.graphs.append(None)

    def call_params(self) -> tuple[nn.Parameter, ...]:
        """The parameters to pass to the graph now: fixed ones, or under FSDP2 the
        module's current (unsharded, inside forward) parameters."""
        if not self.fsdp:
            return self.params
        module = self.target.module
        return tuple(module.get_parameter(name) for name in self.param_names)

    def capture_params(self, variant: int) -> tuple[torch.Tensor, ...]:
        """The parameter samples to capture ``variant`` with."""
        return self.param_samples[variant] if self.fsdp else self.params

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """The target's forward while graphs exist: replay or fall back, counted."""
        if self.bypass:
            return self.original_forward(*args, **kwargs)
        index, reason, _ = self.contracts.match(args, kwargs, training=self.target.module.training)
        if index is not None and self.graphs[index] is not None:
            try:
                out = self.graphs[index](self.call_params(), *args, **kwargs)
            except CudaGraphInputError:
                # The contract matched, so only the parameters can differ: one was
                # replaced or re-allocated since capture (checked before any replay).
                self.counter.fallback("param_storage")
                return self.original_forward(*args, **kwargs)
            self.counter.replay()
            return out
        self.counter.fallback(reason or "not_captured")
        return self.original_forward(*args, **kwargs)

    def adapter(self) -> Callable[..., Any]:
        """The function graphed for this target: parameters first, as explicit inputs,
        then the recorded call. It runs the module with those tensors bound in place of
        its parameters, so the graph reads its inputs rather than captured state."""
        module, names = self.target.module, self.param_names

        def run(params: tuple, *args: Any, **kwargs: Any) -> Any:
            self.bypass = True
            try:
                return torch.func.functional_call(module, dict(zip(names, params)), args, kwargs)
            finally:
                self.bypass = False

        run.__qualname__ = f"partial[{self.name}]"
        return run


class PartialCudaGraphManager:
    """Graphs for the fixed-shape pieces of a training model (see module docs).

    Args:
        entries: one per target, in module order (built by :meth:`from_model_parts`).
        capture_backend: how recorded calls become graphed callables; the core
            ``make_graphed_callables`` by default (tests substitute an eager one).

    Threading: one training thread drives a manager.
    """

    def __init__(
        self,
        entries: Sequence[PartialGraphEntry],
        *,
        capture_backend: CaptureBackend | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        self.entries = list(entries)
        self._backend = capture_backend or _default_backend
        # Set by the caller, or on seeing a checkpoint recompute while recording.
        self.activation_checkpointing = activation_checkpointing
        self._recording = False
        self._closed = False
        self._order: list[PartialGraphEntry] = []  # first-call order while recording

    @classmethod
    def from_model_parts(
        cls,
        model_parts: Sequence[nn.Module],
        activation_checkpointing: bool = False,
        pipeline_parallel: bool = False,
        *,
        attention: bool = True,
        router: bool = True,
        include: Selector | None = None,
        max_variants: int = 4,
        capture_backend: CaptureBackend | None = None,
    ) -> PartialCudaGraphManager | None:
        """Discover targets in already-built model parts (pipeline stages).

        ``activation_checkpointing``: layers are recomputed in backward, so every
        target replays its forward graph a second time, after later targets' backward
        graphs ran. Each target then gets its own memory pool, so that replay cannot
        overwrite another graph's live output (more memory, never wrong values). A
        recompute seen while recording turns this on by itself. Checkpoint wrapper
        modules are always unwrapped. ``pipeline_parallel`` is accepted for interface
        compatibility: each part is searched on its own.

        Returns:
            A manager, or ``None`` (with the reason logged) when nothing is graphable.

        Raises:
            TargetSelectionError: a module shared under two names, or nested targets.
            ValueError: meta parameters in a target, or DTensor parameters that
                FSDP2 does not manage. Targets under FSDP2 (``fully_shard``) are
                supported: their unsharded parameters are copied into the graph at
                each call (see :mod:`cudagraphs.partial.fsdp`).
        """
        del pipeline_parallel  # see docstring
        entries, seen = [], {}
        for part in model_parts:
            sharded = fsdp_managed_modules(part)
            for target in select_targets(part, attention=attention, router=router, include=include):
                if id(target.module) in seen:
                    raise TargetSelectionError(
                        f"{target.name} is the same module as {seen[id(target.module)]} in "
                        "another model part; one graph cannot stand for both calls"
                    )
                seen[id(target.module)] = target.name
                fsdp = id(target.module) in sharded
                params = _check_parameters(target, fsdp)
                entries.append(
                    PartialGraphEntry(
                        target=target,
                        contracts=ContractSet(max_variants),
                        param_names=tuple(n for n, _ in params),
                        params=() if fsdp else tuple(p for _, p in params),
                        fsdp=fsdp,
                    )
                )
        if not entries:
            labels = ", ".join(model_label(p) for p in model_parts) or "no model parts"
            logger.info("partial graphs: nothing graphable found in %s", labels)
            return None
        logger.info("partial graphs: %d target(s): %s", len(entries), [e.name for e in entries])
        return cls(
            entries,
            capture_backend=capture_backend,
            activation_checkpointing=activation_checkpointing,
        )

    # ---- recording ------------------------------------------------------------------
    def start_recording(self) -> None:
        """Install one-shot recorders on every target; the next forward records each
        target's call (arguments, metadata, aliasing, controls, modes)."""
        self._check_open()
        self._order = []
        for entry in self.entries:
            entry.calls_while_recording = 0
            if entry.recorder is None:
                entry.recorder = entry.target.module.register_forward_pre_hook(
                    self._make_recorder(entry), with_kwargs=True
                )
        self._recording = True

    def _make_recorder(self, entry: PartialGraphEntry) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if entry.bypass:
                return
            if _in_backward():
                # An activation-checkpoint recompute of a call already recorded, not
                # a second call of the forward.
                if not self.activation_checkpointing:
                    logger.info("partial graphs: %s is recomputed in backward", entry.name)
                self.activation_checkpointing = True
                return
            if entry.calls_while_recording == 0:
                self._order.append(entry)
            entry.record(args, kwargs)

        return hook

    def _stop_recording(self) -> None:
        for entry in self.entries:
            if entry.recorder is not None:
                entry.recorder.remove()
                entry.recorder = None
        self._recording = False

    # ---- capture --------------------------------------------------------------------
    def capture(self) -> None:
        """Graph every recorded, not yet graphed call, in real forward order.

        Raises:
            TargetSelectionError: a target ran more than once in the recorded forward.
            RuntimeError: nothing was recorded (run a forward after start_recording).
        """
        self._check_open()
        self._stop_recording()
        repeated = [e.name for e in self.entries if e.calls_while_recording > 1]
        if repeated:
            raise TargetSelectionError(
                f"{repeated} ran more than once in the recorded forward; one graph cannot "
                "stand for several calls. Leave these modules out of the targets."
            )
        todo = [
            (entry, i)
            for entry in self._order
            for i, graph in enumerate(entry.graphs)
            if graph is None
        ]
        if not todo and not any(e.graphs for e in self.entries):
            raise RuntimeError(
                "nothing was recorded: call start_recording(), run one forward, then capture()"
            )
        if todo:
            self._capture_calls(todo)
        for entry in self.entries:
            if entry.original_forward is None and entry.graphs:
                module = entry.target.module
                entry.instance_forward = module.__dict__.get("forward")
                entry.original_forward = module.forward
                module.forward = entry.dispatch

    def _capture_calls(self, todo: list[tuple[PartialGraphEntry, int]]) -> None:
        # One capture (one shared pool) for all calls, replayed in capture order; under
        # activation checkpointing one capture (one pool) per call: see from_model_parts.
        groups = [[call] for call in todo] if self.activation_checkpointing else [todo]
        for group in groups:
            callables, sample_args, sample_kwargs = [], [], []
            for entry, i in group:
                args, kwargs = entry.samples[i]
                callables.append(entry.adapter())
                sample_args.append((tuple(entry.capture_params(i)), *args))
                sample_kwargs.append(kwargs)
            graphed = self._backend(tuple(callables), tuple(sample_args), sample_kwargs)
            for (entry, i), g in zip(group, graphed):
                entry.graphs[i] = g
                if entry.fsdp:
                    entry.param_samples[i] = ()  # the graph holds its own copies now
        logger.info(
            "partial graphs: captured %d call(s)%s",
            len(todo),
            ", one pool each (activation checkpointing)" if self.activation_checkpointing else "",
        )

    # ---- reporting and teardown -------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Totals: captured graphs, replays, fallbacks, and fallbacks per reason."""
        out: dict[str, int] = {
            "captured": sum(g is not None for e in self.entries for g in e.graphs),
            "replayed": 0,
            "fallbacks": 0,
        }
        for entry in self.entries:
            for key, n in entry.counter.as_dict().items():
                out[key] = out.get(key, 0) + n
        return out

    def log_stats(self, phase: str) -> None:
        logger.info("partial graphs [%s]: %s", phase, self.stats())

    def close(self) -> None:
        """Restore every module's eager forward, drop recorders and graphs (idempotent)."""
        if self._closed:
            return
        self._stop_recording()
        for entry in self.entries:
            if entry.original_forward is not None:
                module = entry.target.module
                if entry.instance_forward is not None:
                    module.forward = entry.instance_forward
                else:
                    module.__dict__.pop("forward", None)
                entry.original_forward = None
            for g in entry.graphs:
                reset = getattr(g, "reset", None)
                if reset is not None:
                    reset()
            entry.graphs = []
            entry.samples = []
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this PartialCudaGraphManager was closed; build a new one")
