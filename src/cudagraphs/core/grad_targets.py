"""In-graph gradient accumulation: the backward graph adds parameter gradients into
pre-allocated tensors (``param.grad``, or an attribute such as Megatron's
``main_grad``), so no per-parameter kernel runs outside the graph.

Contract: the graph writes to the tensors it was captured with. Each backward replay
checks that every parameter still holds exactly those tensors (same object, same
storage). A ``.grad`` set to ``None`` (``zero_grad(set_to_none=True)``) is bound
again to its zeroed tensor, one fused kernel for all of them; a tensor that was
replaced raises with the fix, so a replay never writes into memory it does not own.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import torch

from ..errors import CudaGraphInputError, CudaGraphsValueError

__all__ = ["GradTargets", "prepare_grad_targets"]


@dataclass
class GradTargets:
    """Where one callable's backward graphs add the gradients of its parameters."""

    owner: str  # the callable's name, for messages
    attr: str  # "grad" or another attribute of each parameter
    params: tuple[torch.nn.Parameter, ...]
    names: tuple[str, ...]
    targets: tuple[torch.Tensor, ...]
    data_ptrs: tuple[int, ...]
    # Per parameter: whether its target was allocated here (its .grad was None).
    allocated: tuple[bool, ...] = ()
    # Per parameter: whether some backward graph adds into its target (None: not known
    # yet, before the captures; see keep_written).
    written: list[bool] | None = None

    def note_written(self, grads: Sequence[torch.Tensor | None]) -> None:
        """A backward capture computed ``grads`` (one per parameter, ``None`` for an
        unused one): which targets its graph adds into."""
        got = [g is not None for g in grads]
        self.written = got if self.written is None else [a or b for a, b in zip(self.written, got)]

    def keep_written(self) -> None:
        """After the captures: drop the parameters no backward graph writes (unused,
        ``allow_unused_input=True``) and give back ``.grad = None`` where it was
        allocated here, as eager leaves an unused parameter's gradient: a zero tensor
        there would let a weight-decaying optimizer move it, and the re-binding after
        ``zero_grad(set_to_none=True)`` would bring it back at every step."""
        if self.written is None or all(self.written):
            return
        keep = self.written
        allocated = self.allocated or (False,) * len(self.params)
        for p, t, made, w in zip(self.params, self.targets, allocated, keep):
            if not w and made and getattr(p, self.attr, None) is t:
                setattr(p, self.attr, None)
        self.params = tuple(x for x, w in zip(self.params, keep) if w)
        self.names = tuple(x for x, w in zip(self.names, keep) if w)
        self.targets = tuple(x for x, w in zip(self.targets, keep) if w)
        self.data_ptrs = tuple(x for x, w in zip(self.data_ptrs, keep) if w)
        self.allocated = tuple(x for x, w in zip(allocated, keep) if w)
        self.written = [True] * len(self.params)

    def check_and_rebind(self) -> None:
        """Before a backward replay: every target in place, ``None`` ones re-bound."""
        n = len(self.params)
        current = list(map(getattr, self.params, repeat(self.attr, n), repeat(None, n)))
        # The common case, everything in place, in C-level loops (this runs per replay).
        if all(map(operator.is_, current, self.targets)) and (
            list(map(torch.Tensor.data_ptr, self.targets)) == list(self.data_ptrs)
        ):
            return
        attr, unbound = self.attr, []
        for p, t, ptr, name in zip(self.params, self.targets, self.data_ptrs, self.names):
            current = getattr(p, attr, None)
            if current is t and t.data_ptr() == ptr:
                continue
            if current is None:
                unbound.append((p, t))
                continue
            raise CudaGraphInputError(
                f"{self.owner}: parameter {name}.{attr} is not the tensor the backward graph "
                f"accumulates into (it was replaced or re-allocated after capture). Zero "
                f"gradients in place (zero_grad(set_to_none=False)) or set them to None; "
                f"do not assign new tensors. To change them, graph again."
            )
        if unbound:
            # set_to_none means "the gradient is zero": bind the zeroed target again.
            torch._foreach_zero_([t for _, t in unbound])
            for p, t in unbound:
                setattr(p, attr, t)


def prepare_grad_targets(
    owner: str,
    params: tuple[torch.nn.Parameter, ...],
    names: tuple[str, ...],
    attr: str,
) -> GradTargets:
    """The accumulation targets of one callable's parameters, allocated before capture.

    With ``attr="grad"`` a missing ``.grad`` is allocated (zeros). Another attribute
    must already hold a tensor of the parameter's shape on its device.

    Raises:
        ValueError: an attribute other than ``grad`` is missing or has the wrong shape
            or device (naming the parameter).
    """
    targets, allocated = [], []
    for p, name in zip(params, names):
        t = getattr(p, attr, None)
        allocated.append(t is None and attr == "grad")
        if t is None and attr == "grad":
            p.grad = t = torch.zeros_like(p)
        if not isinstance(t, torch.Tensor):
            raise CudaGraphsValueError(
                f"{owner}: parameter {name} has no tensor attribute {attr!r} to accumulate "
                f"its gradient into; allocate it (same shape, on {p.device}) before graphing"
            )
        if t.shape != p.shape or t.device != p.device:
            raise CudaGraphsValueError(
                f"{owner}: {name}.{attr} has shape {tuple(t.shape)} on {t.device}; the "
                f"parameter has shape {tuple(p.shape)} on {p.device}"
            )
        targets.append(t)
    return GradTargets(
        owner=owner,
        attr=attr,
        params=tuple(params),
        names=tuple(names),
        targets=tuple(targets),
        data_ptrs=tuple(t.data_ptr() for t in targets),
        allocated=tuple(allocated),
    )
