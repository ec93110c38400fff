"""What recording needs beyond one call: telling forwards of the model apart, the
policy for inference calls, and the modes a recorded variant is captured in.

Why forwards must be told apart: a target called twice within ONE forward is a real
reuse (one graph's static outputs and saved activations would be overwritten by the
second call before the first one's backward), while a target called once in each of
several forwards of the recorded step is gradient accumulation, which is safe. Only
the model's own forward boundaries separate the two, so the manager counts the
forwards of its model parts with a pair of hooks on each part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ..errors import CudaGraphsValueError
from ..torch_private import current_graph_task_id
from .chaining import OutputLinks
from .contract import AutocastState

if TYPE_CHECKING:
    from .entry import PartialGraphEntry

#: One recorded call to capture: a target and the index of its variant.
Call = tuple["PartialGraphEntry", int]

__all__ = [
    "INFERENCE_CALLS",
    "ForwardClock",
    "Recorder",
    "InferenceCalls",
    "capture_groups",
    "capture_modes",
    "check_inference_calls",
    "is_inference_call",
]

#: What recording does with a call made under ``torch.no_grad()`` or in eval mode:
#: ``"ignore"`` leaves it unrecorded (it runs eagerly later, counted as a fallback);
#: ``"record"`` records it as an inference variant, captured forward-only in a pool of
#: its own so that replaying it never touches the training graphs' memory.
InferenceCalls = Literal["ignore", "record"]
INFERENCE_CALLS: tuple[str, ...] = ("ignore", "record")


def check_inference_calls(value: Any) -> InferenceCalls:
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


@contextmanager
def capture_modes(
    grad_enabled: bool,
    training: bool,
    modules: Sequence[nn.Module],
    autocast: AutocastState = (),
) -> Iterator[None]:
    """Grad mode, autocast state and the training flag of ``modules`` as they were
    when a variant was recorded.

    A module already in that mode is left alone (submodules may hold a mode of their
    own, such as frozen norms in eval); one that is not is switched with
    ``train(training)``, as ``model.eval()`` did, and every flag is restored after.
    Autocast is entered with its weight cache off: cast weights cached during capture
    would be freed and replayed stale (the core refuses the cache for that reason),
    and the cache changes no value, only how often weights are cast.
    """
    saved = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            if module.training != training:
                module.train(training)
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad_enabled))
            for device, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
            yield
    finally:
        for m, flag in saved:
            m.training = flag


def capture_groups(todo: Sequence[Call], one_pool_per_call: bool) -> list[list[Call]]:
    """The recorded calls to capture together (one backend call, one pool, replayed in
    capture order), in order.

    Training calls (grad on, training flag set) form the first group. Inference
    variants (grad off or eval mode) are captured apart, one group per mode, in pools
    of their own: they run between steps, in an order of their own, and must not
    reuse the training graphs' memory. Calls recorded under different autocast
    states are captured apart too (one state per capture). With ``one_pool_per_call`` (activation
    checkpointing: a recompute replays a forward after later graphs ran) every call
    is a group of its own.
    """
    by_mode: dict[tuple[bool, bool, AutocastState], list[Call]] = {}
    for entry, i in todo:
        v = entry.contracts.variants[i]
        by_mode.setdefault((v.grad_enabled, v.training, v.autocast), []).append((entry, i))
    groups: list[list[Call]] = []
    # Training first; otherwise in the order the modes were first recorded.
    for mode in sorted(by_mode, key=lambda m: m[:2] != (True, True)):
        calls = by_mode[mode]
        groups += [[call] for call in calls] if one_pool_per_call else [calls]
    return groups


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (where an
    activation-checkpoint recompute calls modules again)."""
    # Private torch API, checked at import (see ..torch_private): without it a
    # recompute would be taken for a second call.
    return current_graph_task_id() != -1


class Recorder:
    """One manager's recording: a hook on every target, the forward clock over the
    model parts, the order in which targets were first called (the capture order),
    and what recording noticed on the way (an activation-checkpoint recompute, calls
    left unrecorded by ``inference_calls``).

    Args:
        entries: the targets (:class:`~.entry.PartialGraphEntry`).
        parts: the model parts whose forwards are told apart; empty when unknown.
        inference_calls: see :data:`InferenceCalls`.
        on_recompute: called once per target recomputed in backward.
        logger: where the one-time notes go.
    """

    def __init__(
        self,
        entries: Sequence[PartialGraphEntry],
        parts: Sequence[nn.Module],
        inference_calls: InferenceCalls,
        on_recompute: Callable[[PartialGraphEntry], None],
        logger: logging.Logger,
    ) -> None:
        self.entries = entries
        self.parts = list(parts)
        self.inference_calls = inference_calls
        self.clock = ForwardClock() if self.parts else None
        self.order: list[PartialGraphEntry] = []
        self.active = False
        self._on_recompute = on_recompute
        self._logger = logger
        self._said_ignored = False
        # Which calls feed on another target's output (see .chaining), and the call
        # of each target whose output is awaited: id(entry) -> (variant, forward).
        self.links = OutputLinks()
        self._awaited: dict[int, tuple[int, int | None]] = {}
        self._output_hooks: list[Any] = []

    def start(self) -> None:
        self.order = []
        self.links.clear()
        self._awaited = {}
        for entry in self.entries:
            entry.begin_recording()
            if entry.recorder is None:
                entry.recorder = entry.target.module.register_forward_pre_hook(
                    self._hook(entry), with_kwargs=True
                )
                self._output_hooks.append(
                    entry.target.module.register_forward_hook(self._output_hook(entry))
                )
        if self.clock is not None:
            self.clock.install(self.parts)
        self.active = True

    def stop(self) -> None:
        for entry in self.entries:
            if entry.recorder is not None:
                entry.recorder.remove()
                entry.recorder = None
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = []
        self.links.clear()  # drops the outputs it held
        if self.clock is not None:
            self.clock.remove()
        self.active = False

    def _hook(self, entry: PartialGraphEntry) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if entry.bypass or entry.off_reason is not None:
                return
            if in_backward():
                # An activation-checkpoint recompute of a call already recorded, not
                # a second call of the forward.
                self._on_recompute(entry)
                return
            if self.inference_calls == "ignore" and is_inference_call(module):
                self._say_ignored(entry)
                return
            if entry.recorded_calls == 0:
                self.order.append(entry)
            forward = self.clock.current() if self.clock else None
            variant = entry.record(args, kwargs, forward)
            if variant is not None:
                self.links.note_call(entry, variant, entry.call_params(), args, kwargs, forward)
                self._awaited[id(entry)] = (variant, forward)

        return hook

    def _output_hook(self, entry: PartialGraphEntry) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            awaited = self._awaited.pop(id(entry), None)
            if awaited is not None:
                self.links.note_output(entry, awaited[0], output, awaited[1])

        return hook

    def _say_ignored(self, entry: PartialGraphEntry) -> None:
        if not self._said_ignored:
            self._said_ignored = True
            self._logger.info(
                "partial graphs: %s was called under torch.no_grad() or in eval mode while "
                "recording (an evaluation, say); such calls are not recorded "
                "(inference_calls='ignore') and run eagerly, counted as fallbacks. Pass "
                "inference_calls='record' to graph them as inference variants.",
                entry.name,
            )
