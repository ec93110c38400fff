"""The record phase: each target's recording store and the hooks that fill it.

* :class:`RecordedVariant`: one recorded call of a target (a variant): the samples its
  capture needs, then the graph captured from them.
* :class:`TargetRecording`: one target's recording store: its variants (one
  :class:`~.contract.CallContract` each, in a :class:`~.contract.ContractSet`), the
  parameters its graphs take as inputs, and whether it was turned off.
* :class:`Recorder`: one manager's recording: a hook on every target, the forward
  clock over the model parts, the order in which targets were first called (the
  capture order), and the links between one target's output and the next one's input
  (:mod:`.chaining`).

Why forwards must be told apart: a target called twice within ONE forward is a real
reuse (one graph's static outputs and saved activations would be overwritten by the
second call before the first one's backward), while a target called once in each of
several forwards of the recorded step is gradient accumulation, which is safe. Only
the model's own forward boundaries separate the two, so the recorder counts the
forwards of the model parts with a pair of hooks on each part (:class:`ForwardClock`).

What this module does NOT do: it captures nothing (:mod:`.graphing` does) and replays
nothing (:mod:`.replay` does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..diagnostics import WarnOnce
from ..errors import CudaGraphInputError, CudaGraphsValueError
from ..torch_private import current_graph_task_id, parameter_table
from .chaining import Link, OutputLinks
from .contract import CallContract, ContractSet
from .vocabulary import MODEL_KIND, OffReason, Target

__all__ = [
    "INFERENCE_CALLS",
    "Call",
    "ForwardClock",
    "InferenceCalls",
    "RecordedVariant",
    "Recorder",
    "TargetRecording",
    "check_inference_calls",
    "in_backward",
    "is_inference_call",
]

#: What recording does with a call made under ``torch.no_grad()`` or in eval mode:
#: ``"ignore"`` leaves it unrecorded (it runs eagerly later, counted as a fallback);
#: ``"record"`` records it as an inference variant, captured forward-only in a pool of
#: its own so that replaying it never touches the training graphs' memory.
InferenceCalls = Literal["ignore", "record"]
INFERENCE_CALLS: tuple[str, ...] = ("ignore", "record")


def check_inference_calls(value: Any) -> InferenceCalls:
    """``value`` as an :data:`InferenceCalls`.

    Raises:
        CudaGraphsValueError: ``value`` is not one of :data:`INFERENCE_CALLS`.
    """
    if value not in INFERENCE_CALLS:
        raise CudaGraphsValueError(
            f"inference_calls must be one of {INFERENCE_CALLS}, got {value!r}. 'ignore' "
            "leaves no_grad / eval-mode calls made while recording unrecorded (they run "
            "eagerly); 'record' graphs them as inference variants."
        )
    return value


def is_inference_call(module: nn.Module) -> bool:
    """Whether a call of ``module`` now is an evaluation-style call: grad disabled or
    the module in eval mode."""
    return not torch.is_grad_enabled() or not module.training


def _detached_clone(value: Any) -> Any:
    """A sample of a recorded argument: same metadata, its own storage, no history."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


@dataclass
class RecordedVariant:
    """One recorded call of a target (a variant): the samples its capture needs, and
    its graph once captured. The samples are dropped after capture (the graph holds
    inputs of its own); until then a failed capture can be retried from them."""

    args: tuple | None
    kwargs: dict | None
    # Under FSDP2 (see .fsdp) the recorded values of the unsharded parameters, which
    # the graph copies in at each call; empty otherwise.
    params: tuple[torch.Tensor, ...] = ()
    graph: Any = None
    # The graph's replay from the call's tensors alone, when the graph flattens its
    # call exactly as the contract does behind the parameters (.graphing sets it): the
    # call is then flattened and checked once, by the contract.
    replay_checked: Callable[[list], Any] | None = None
    # While recording: tensor input index -> the output it was in every recorded call
    # of this variant (.chaining); None before the first.
    chained: dict[int, Link] | None = None
    # While recording a whole model part: the positions among its tensor outputs that
    # required grad, and those a backward of a recorded call gave a gradient (None
    # until one did). See unreached_outputs.
    grad_outputs: frozenset[int] = frozenset()
    reached: set[int] | None = None

    def watch_gradients(self, output: Any) -> Any:
        """``output`` for the caller, each tensor that requires grad replaced by a
        view of itself hooked to note when a backward gives it a gradient; and which
        positions (among the tensor outputs) those are.

        Why a view: a loss the part computes from its own logits sends a gradient
        through the logits tensor inside the part; only through the view does a
        gradient arrive from the caller's code, which is what the graph's output
        gets."""
        leaves, spec = pytree.tree_flatten(output)
        position = 0
        for k, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                continue
            if x.requires_grad:
                view = x.view_as(x)
                view.register_hook(self._reached_hook(position))
                self.grad_outputs |= {position}
                leaves[k] = view
            position += 1
        return pytree.tree_unflatten(leaves, spec)

    def _reached_hook(self, position: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.reached is None:
                self.reached = set()
            self.reached.add(position)

        return hook

    def unreached_outputs(self) -> frozenset[int]:
        """The outputs that required grad and that no recorded backward reached, once
        some recorded backward reached another; empty when none ran (nothing is known).

        Why: an HF model's loss-only step never reaches the logits beside its loss,
        and a graph captured with them would hold an incoming-gradient buffer of the
        logits' size (0.13 GB for a 32000-word vocabulary at batch 4, seq 512) that
        each backward only zeroes, and add it in."""
        if self.reached is None:
            return frozenset()
        return self.grad_outputs - self.reached

    def captured(self, graph: Any, replay_checked: Callable[[list], Any] | None) -> None:
        """Hold ``graph`` (and its checked replay, if any); drop the samples."""
        self.graph = graph
        self.replay_checked = replay_checked
        self.args = self.kwargs = None
        self.params = ()
        self.chained = None

    def release(self) -> None:
        """Forget the graph and the samples."""
        self.graph = self.args = self.kwargs = self.replay_checked = None
        self.params = ()


@dataclass
class TargetRecording:
    """One target's recording store: ``variants[i]`` records the call of
    ``contracts.variants[i]`` (the matcher's view of it) and, once captured, holds its
    graph. Owned by the manager; the target's module is borrowed.

    A target turned off (``off_reason`` set: a graph slower than eager, a stateful
    argument, a part graphed whole around it) is no longer recorded or captured and
    holds no graph; the manager gives its module its own forward back.
    """

    target: Target
    contracts: ContractSet
    param_names: tuple[str, ...] = ()
    # (owner's parameter table, attribute, owner) of each of param_names, found at the
    # first call.
    params_at: tuple[tuple[dict[str, Any], str, nn.Module], ...] | None = field(
        default=None, repr=False
    )
    # Under FSDP2 (see .fsdp): parameters are fetched at each call and copied into the
    # graph rather than read in place.
    fsdp: bool = False
    variants: list[RecordedVariant] = field(default_factory=list)
    off_reason: OffReason | None = None
    # While recording: calls recorded, the forward of the model the last one belonged
    # to, and whether a call was seen again within one forward (a real reuse, refused by
    # capture()).
    recorded_calls: int = 0
    last_forward: int | None = None
    repeated: bool = False

    @property
    def name(self) -> str:
        """The target's qualified name; a whole model part (named ``""``) by its class."""
        return self.target.name or type(self.target.module).__name__

    def begin(self) -> None:
        """Start a recording: no call of it seen yet."""
        self.recorded_calls = 0
        self.repeated = False

    def note_call(self, forward: int | None) -> bool:
        """Count a call made within the model's forward number ``forward``; ``False``
        when it repeats a call of that forward, which is only noted (``repeated``:
        capture() refuses it, naming the target) and not recorded.

        ``forward`` is ``None`` when forwards cannot be told apart (a manager built
        without its model parts): then any second call counts as a repeat. Calls from
        different forwards (micro-batches of one step, gradient accumulation) are
        recorded.
        """
        if self.recorded_calls and (forward is None or forward == self.last_forward):
            self.repeated = True
            return False
        self.recorded_calls += 1
        self.last_forward = forward
        return True

    def record(self, args: tuple, kwargs: dict) -> int | None:
        """Record a call as a variant: the index of the variant it is (an identical
        contract adds nothing, a new one is another variant), or ``None`` when
        ``max_variants`` variants are recorded already and this one is new."""
        contract = CallContract.from_call(args, kwargs, training=self.target.module.training)
        index = self.contracts.add(contract)
        if index == len(self.variants):
            self.variants.append(
                RecordedVariant(
                    args=tuple(_detached_clone(a) for a in args),
                    kwargs={k: _detached_clone(v) for k, v in kwargs.items()},
                    # Plain tensors, not parameters: the graph copies these per call.
                    params=tuple(_detached_clone(p) for p in self.call_params())
                    if self.fsdp
                    else (),
                )
            )
        return index

    def call_params(self) -> tuple[torch.Tensor, ...]:
        """The module's parameters now, read by the names taken at build (under FSDP2
        its current unsharded parameters, inside forward).

        Read at each call, not kept: a parameter replaced since capture
        (``load_state_dict(assign=True)``, ``layer.weight = nn.Parameter(...)``) is
        then the new one, which the graph's check of its parameters refuses, and the
        call runs eagerly (``param_storage``) instead of reading the old weights and
        leaving the new one without a gradient.

        Raises:
            CudaGraphInputError: a name no longer holds a parameter (deleted, or
                replaced by a plain tensor or another kind of object).
        """
        slots = self._param_slots()
        params = tuple([table.get(attr) for table, attr, _ in slots])  # the hot path
        for p, (_, attr, owner) in zip(params, slots):
            if not isinstance(p, torch.Tensor):
                self._refuse_missing(owner, attr)
        return params

    def capture_params(self, variant: int) -> tuple[torch.Tensor, ...]:
        """The parameter samples to capture ``variant`` with."""
        return self.variants[variant].params if self.fsdp else self.call_params()

    def _param_slots(self) -> tuple[tuple[dict[str, Any], str, nn.Module], ...]:
        if self.params_at is None:
            module = self.target.module
            slots = []
            for name in self.param_names:
                path, _, attr = name.rpartition(".")
                owner = module.get_submodule(path) if path else module
                slots.append((parameter_table(owner), attr, owner))
            self.params_at = tuple(slots)
        return self.params_at

    def _refuse_missing(self, owner: nn.Module, attr: str) -> None:
        value = getattr(owner, attr, None)
        raise CudaGraphInputError(
            f"{self.name}: its parameter {attr!r} of {type(owner).__name__} is no longer "
            f"a parameter (now {type(value).__name__}) since the graph was captured; the "
            "call runs eagerly. Fix: build the manager again for the changed model"
        )

    def graphs(self) -> list[Any]:
        """The graphs held, one per captured variant."""
        return [v.graph for v in self.variants if v.graph is not None]

    def release_graphs(self) -> None:
        """Reset every graph held (a graph with a ``reset`` releases its memory) and
        forget the variants' graphs and samples."""
        for g in self.graphs():
            reset = getattr(g, "reset", None)
            if reset is not None:
                reset()
        for v in self.variants:
            v.release()

    def turn_off(self, reason: OffReason) -> None:
        """Take the target out for good: its graphs released, recording and capture
        skip it from now on, counted in ``stats()`` as ``off_<reason>``."""
        self.release_graphs()
        self.off_reason = reason

    def start_afresh(self) -> None:
        """Make a target turned off a target again, with nothing recorded."""
        self.off_reason = None
        self.variants = []
        self.contracts = ContractSet(self.contracts.max_variants)


#: One recorded call to capture: a target's recording and the index of its variant.
Call = tuple[TargetRecording, int]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (where an
    activation-checkpoint recompute calls modules again)."""
    # Private torch API, checked at import (see ..torch_private): without it a
    # recompute would be taken for a second call.
    return current_graph_task_id() != -1


class ForwardClock:
    """Numbers the forwards of the model parts while recording.

    A forward starts when the outermost part's forward starts (nested part calls do
    not start another one) and ends when it returns or raises (the end hook is
    registered with ``always_call=True``, so an exception does not leave the clock
    inside a forward that is over).
    """

    def __init__(self) -> None:
        self.serial = 0
        self.depth = 0
        self._handles: list[Any] = []

    def install(self, parts: Sequence[nn.Module]) -> None:
        self.remove()
        for part in parts:
            self._handles.append(part.register_forward_pre_hook(self._begin))
            self._handles.append(part.register_forward_hook(self._end, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _begin(self, module: nn.Module, args: tuple) -> None:
        if self.depth == 0:
            self.serial += 1
        self.depth += 1

    def _end(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def current(self) -> int:
        """The number of the forward running now. A call made outside any part's
        forward (the target called directly) is a forward of its own."""
        if self.depth == 0:
            self.serial += 1
        return self.serial


class Recorder:
    """One manager's recording: a hook on every target, the forward clock over the
    model parts, the order in which targets were first called (the capture order),
    and what recording noticed on the way (an activation-checkpoint recompute, calls
    left unrecorded by ``inference_calls`` or by a full set of variants).

    Args:
        recordings: the targets' recording stores (borrowed; filled by the hooks).
        parts: the model parts whose forwards are told apart; empty when unknown.
        inference_calls: see :data:`InferenceCalls`.
        on_recompute: called once per target recomputed in backward.
        logger: where the one-time notes go.
        warn_once: the manager's once-per-cause warnings.
    """

    def __init__(
        self,
        recordings: Sequence[TargetRecording],
        parts: Sequence[nn.Module],
        inference_calls: InferenceCalls,
        on_recompute: Callable[[TargetRecording], None],
        logger: logging.Logger,
        warn_once: WarnOnce,
    ) -> None:
        self.recordings = recordings
        self.parts = list(parts)
        self.inference_calls = inference_calls
        self.clock = ForwardClock() if self.parts else None
        self.order: list[TargetRecording] = []
        self.active = False
        self._on_recompute = on_recompute
        self._logger = logger
        self._warn_once = warn_once
        self._said_ignored = False
        # Which calls feed on another target's output (see .chaining), and the call
        # of each target whose output is awaited: id(recording) -> (variant, forward).
        self.links = OutputLinks()
        self._awaited: dict[int, tuple[int, int | None]] = {}
        self._hooks: list[Any] = []

    def start(self) -> None:
        self.stop()
        self.order = []
        self._awaited = {}
        for rec in self.recordings:
            rec.begin()
            module = rec.target.module
            self._hooks.append(module.register_forward_pre_hook(self._hook(rec), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._output_hook(rec)))
        if self.clock is not None:
            self.clock.install(self.parts)
        self.active = True

    def stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.links.clear()  # drops the outputs it held
        if self.clock is not None:
            self.clock.remove()
        self.active = False

    def _hook(self, rec: TargetRecording) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if rec.off_reason is not None:
                return
            if in_backward():
                # An activation-checkpoint recompute of a call already recorded, not
                # a second call of the forward.
                self._on_recompute(rec)
                return
            if self.inference_calls == "ignore" and is_inference_call(module):
                self._say_ignored(rec)
                return
            if rec.recorded_calls == 0:
                self.order.append(rec)
            forward = self.clock.current() if self.clock else None
            if not rec.note_call(forward):
                return
            index = rec.record(args, kwargs)
            if index is None:
                self._say_full(rec)
                return
            self.links.note_call(rec, rec.variants[index], rec.call_params(), args, kwargs, forward)
            self._awaited[id(rec)] = (index, forward)

        return hook

    def _output_hook(self, rec: TargetRecording) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            awaited = self._awaited.pop(id(rec), None)
            if awaited is None:
                return None
            if rec.target.kind == MODEL_KIND:
                # What the caller gets: views that say whether its backward used them.
                output = rec.variants[awaited[0]].watch_gradients(output)
            self.links.note_output(rec, awaited[0], output, awaited[1])
            return output

        return hook

    def _say_full(self, rec: TargetRecording) -> None:
        self._warn_once(
            "variants_full",
            "partial graphs: %s already has max_variants=%d recorded variants; this "
            "new call is not recorded and will run eagerly. Fix: pass a larger "
            "max_variants to from_model_parts, or keep fewer distinct input shapes. "
            "Later refusals (any target) are not logged again.",
            rec.name,
            rec.contracts.max_variants,
        )

    def _say_ignored(self, rec: TargetRecording) -> None:
        if not self._said_ignored:
            self._said_ignored = True
            self._logger.info(
                "partial graphs: %s was called under torch.no_grad() or in eval mode while "
                "recording (an evaluation, say); such calls are not recorded "
                "(inference_calls='ignore') and run eagerly, counted as fallbacks. Pass "
                "inference_calls='record' to graph them as inference variants.",
                rec.name,
            )
