"""Projection groups: sibling linears' weights laid back to back in one buffer.

Why: a GEMM over a group's rows does the work of one GEMM per projection
(:mod:`.gemms`), and rows that already lie back to back need no copy per step to be
read so. :func:`stack_projections` lays the weights of sibling ``nn.Linear`` modules
(same parent, same input width, dtype, device and bias or none: q/k/v, gate/up) back
to back in one buffer per group, the biases in another. Each ``Parameter`` stays the
same object, its ``.data`` re-pointed at its rows, so the memory is not doubled and
in-place updates, ``state_dict``, optimizers (and their state, which follows the
object) and gradients keep working; :meth:`StackedGroups.unstack` gives every weight
its own memory back.

A compiled training step reads the parameters themselves (their gradients must land
on them), and the pass sees their shared storage in the trace. A decode step reads
the group's buffer instead (:meth:`StackedGroups.reading`): inside a nested compile
region, which the generator's decoder layers are, inputs that alias each other are
refused (dynamo's "Higher order ops do not support aliasing").
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ProjectionGroup",
    "StackedGroups",
    "forwards_set",
    "plan_projections",
    "stack_projections",
]

logger = logging.getLogger(__name__)


@contextmanager
def forwards_set(
    modules: Sequence[nn.Module], forwards: Sequence[Callable[..., Any]]
) -> Iterator[None]:
    """Each module's ``forward`` its own of ``forwards`` inside the block (set on the
    instance), and what the instance held before (usually nothing: the class's) after
    it, an error included."""
    before = [module.__dict__.get("forward") for module in modules]
    for module, forward in zip(modules, forwards):
        module.forward = forward
    try:
        yield
    finally:
        for module, old in zip(modules, before):
            if old is None:
                del module.forward
            else:
                module.forward = old


def _sliced_linear(
    weights: torch.Tensor,
    biases: torch.Tensor | None,
    start: int,
    stop: int,
    x: torch.Tensor,
) -> torch.Tensor:
    bias = None if biases is None else biases[start:stop]
    return F.linear(x, weights[start:stop], bias)


@dataclass
class ProjectionGroup:
    """Sibling linears whose weights lie back to back in :attr:`weights` (their biases
    in :attr:`biases`).

    Attributes:
        names: the modules' names in the model, in buffer order.
        modules: the modules.
        weights: the buffer their weights are the rows of.
        biases: the buffer their biases are the parts of (``None``: unbiased).
        forwards: per module, its ``forward`` while a decode step is traced (made once:
            a compiled step's guards see the same objects at every call).
        addresses: per module, where its weight and bias (``None``: none) were laid.
        places: per module, its parent and its name there (a module set in its place
            since reads memory the compiled code does not know).
    """

    names: tuple[str, ...]
    modules: tuple[nn.Linear, ...]
    weights: torch.Tensor
    biases: torch.Tensor | None
    forwards: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = field(repr=False)
    addresses: tuple[tuple[int, int | None], ...] = field(repr=False, default=())
    places: tuple[tuple[nn.Module, str], ...] = field(repr=False, default=())

    @classmethod
    def stack(
        cls,
        names: tuple[str, ...],
        modules: tuple[nn.Linear, ...],
        places: tuple[tuple[nn.Module, str], ...] = (),
    ) -> ProjectionGroup:
        """Move the modules' weights (and biases) into one buffer each; ``places``:
        each module's parent and its name there."""
        weights = _stack_rows([m.weight for m in modules])
        biased = modules[0].bias is not None
        biases = _stack_rows([m.bias for m in modules]) if biased else None
        forwards, start = [], 0
        for module in modules:
            stop = start + module.weight.shape[0]
            forwards.append(partial(_sliced_linear, weights, biases, start, stop))
            start = stop
        addresses = tuple(
            (m.weight.data_ptr(), None if m.bias is None else m.bias.data_ptr()) for m in modules
        )
        return cls(names, modules, weights, biases, tuple(forwards), addresses, places)

    def moved(self) -> list[str]:
        """The names of the group's weights and biases that are no longer where they
        were laid (re-pointed since: ``module.to()``, ``param.data = ...``, a new
        ``Parameter`` set on the module), and those of a module another was set in
        place of (``parent.q_proj = nn.Linear(...)``)."""
        out = []
        places = self.places or [(None, "")] * len(self.modules)
        for name, module, (weight, bias), (parent, attr) in zip(
            self.names, self.modules, self.addresses, places
        ):
            if parent is not None and getattr(parent, attr, None) is not module:
                out.extend(
                    f"{name}.{kind}" for kind in ("weight", "bias")[: 1 + (bias is not None)]
                )
                continue
            for kind, address in (("weight", weight), ("bias", bias)):
                tensor = getattr(module, kind)
                if address is not None and (tensor is None or tensor.data_ptr() != address):
                    out.append(f"{name}.{kind}")
        return out

    def unstack(self) -> None:
        """Give each module's weight (and bias) memory of its own again."""
        for module in self.modules:
            for p in (module.weight, module.bias):
                if p is not None:
                    p.data = p.data.clone()


def _back_to_back(params: list[nn.Parameter]) -> bool:
    """Whether ``params`` are already one storage's consecutive rows (a generator
    stacked them before)."""
    first = params[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in params:
        if p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def _stack_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """The buffer whose rows ``params`` are: made, and each re-pointed at its rows;
    or, where they already are one storage's consecutive rows, a view of those (so
    that the graphs of another generator that stacked them keep reading them)."""
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    if _back_to_back(params):
        return first.data.as_strided((rows, *first.shape[1:]), first.stride())
    buffer = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = buffer[start : start + p.shape[0]]
        start += p.shape[0]
    return buffer


@dataclass
class StackedGroups:
    """The projection groups :func:`stack_projections` laid back to back.

    Attributes:
        groups: the groups, in module order.
        modules, forwards: every grouped module and its ``forward`` while a decode
            step is traced, flattened once (entered at every decode step run in
            Python).
    """

    groups: tuple[ProjectionGroup, ...] = ()
    modules: tuple[nn.Linear, ...] = field(init=False, repr=False)
    forwards: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.modules = tuple(m for g in self.groups for m in g.modules)
        self.forwards = tuple(f for g in self.groups for f in g.forwards)

    @property
    def names(self) -> list[tuple[str, ...]]:
        """Per group, the modules' names in buffer order."""
        return [g.names for g in self.groups]

    def reading(self) -> AbstractContextManager[None]:
        """Each grouped module's ``forward`` its slice of the group's buffers inside
        the block (:func:`~.regions.forwards_set`)."""
        return forwards_set(self.modules, self.forwards)

    def moved(self) -> list[str]:
        """The names of grouped weights and biases no longer where they were laid
        (:meth:`ProjectionGroup.moved`)."""
        return [name for group in self.groups for name in group.moved()]

    def unstack(self) -> None:
        """Give every moved weight memory of its own again (idempotent)."""
        with torch.no_grad():
            for group in self.groups:
                group.unstack()
        self.groups, self.modules, self.forwards = (), (), ()


def _tied(model: nn.Module) -> set[int]:
    """The data pointers of the model's parameters and buffers whose memory another
    one's overlaps, or that are held under two names: tied weights (one starting
    inside another too), never moved. (Weights a generator laid back to back share a
    storage, not memory.)"""
    spans: dict[tuple[int, int], int] = defaultdict(int)
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for _, t in named:
        if t.numel():
            start = t.data_ptr()
            spans[(start, start + _extent(t))] += 1
    tied = {start for (start, _), n in spans.items() if n > 1}
    # Sorted by start, a span overlaps another exactly when it starts before the
    # furthest end of those before it.
    furthest, owner = -1, None
    for start, stop in sorted(spans):
        if start < furthest:
            tied.update((start, owner))
        if stop > furthest:
            furthest, owner = stop, start
    return tied


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to past its last (any strides, none negative)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _movable(module: Any, tied: set[int]) -> bool:
    # A forward of its own (on the instance, or a subclass's) may compute something
    # else than its rows of the group's GEMM, which the decode step reads it as.
    if not isinstance(module, nn.Linear) or "forward" in module.__dict__:
        return False
    if type(module).forward is not nn.Linear.forward:
        return False
    tensors = [module.weight] + ([] if module.bias is None else [module.bias])
    return all(
        type(t) is nn.Parameter
        and type(t.data) is torch.Tensor
        and t.is_contiguous()
        and t.data_ptr() not in tied
        for t in tensors
    )


def _group_key(linear: nn.Linear) -> tuple[Any, ...]:
    weight, bias = linear.weight, linear.bias
    # The biases go in one buffer too: of one dtype and device (torch.cat would promote).
    biases = None if bias is None else (bias.dtype, bias.device)
    return (weight.shape[1], weight.dtype, weight.device, biases)


@dataclass(frozen=True)
class _Run:
    """Sibling linears that :func:`stack_projections` lays back to back."""

    names: tuple[str, ...]
    modules: tuple[nn.Linear, ...]
    places: tuple[tuple[nn.Module, str], ...]


def _runs(model: nn.Module) -> list[_Run]:
    tied = _tied(model)
    out: list[_Run] = []
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        run: list[tuple[str, nn.Linear]] = []
        for name, child in [*parent.named_children(), ("", None)]:
            movable = _movable(child, tied)
            if movable and run and _group_key(child) == _group_key(run[0][1]):
                run.append((name, child))
                continue
            if len(run) > 1:
                out.append(
                    _Run(
                        tuple(prefix + n for n, _ in run),
                        tuple(m for _, m in run),
                        tuple((parent, n) for n, _ in run),
                    )
                )
            run = [(name, child)] if movable else []
    return out


def plan_projections(model: nn.Module) -> list[tuple[str, ...]]:
    """The projection groups :func:`stack_projections` would lay, by their modules'
    names, moving nothing."""
    return [run.names for run in _runs(model)]


def stack_projections(model: nn.Module) -> StackedGroups:
    """Lay the weights of each run of sibling ``nn.Linear`` modules (children of one
    module, next to each other in its order, with one input width, dtype, device and
    bias or none) back to back in one buffer, their biases in another; each
    ``Parameter`` keeps its object and is re-pointed at its rows. Runs already back to
    back (stacked by another generator) stay where they are, so that its graphs still
    read them. Tied weights (memory another parameter or buffer overlaps), tensor
    subclasses, non-contiguous weights and modules with a ``forward`` of their own (set
    on the instance, or a subclass's) are left as they are. Returns the groups."""
    with torch.no_grad():
        groups = [ProjectionGroup.stack(r.names, r.modules, r.places) for r in _runs(model)]
    if groups:
        logger.info(
            "GraphedGenerator: %d projection groups laid back to back (the first: %s)",
            len(groups),
            ", ".join(groups[0].names),
        )
    return StackedGroups(tuple(groups))
