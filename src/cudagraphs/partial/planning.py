"""Planning partial-graph targets, the decision of the select phase: from the blocks
:mod:`.discovery` finds, the scopes asked for (:mod:`.scopes`) and the user's
``include``, the targets a manager graphs, the blocks that yield none
(:class:`SkippedBlock`) and those graphed narrower than asked (:class:`NarrowedBlock`),
each with the reason; and, when nothing is found, why. :func:`plan_targets` is the
preview of what :class:`~.manager.PartialCudaGraphManager` graphs: the manager plans
each model part through it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import CudaGraphsTypeError, TargetSelectionError
from ..moe_kernels import GroupedMMProbe
from .arguments import RETIRED, Selector, include_predicate, refuse_retired
from .discovery import discover_blocks, is_attention
from .model_scope import model_scope_refusal
from .scopes import requested_scopes, scope_block
from .skips import block_reports
from .tree import children as _children
from .tree import join_name as _join
from .tree import named_modules as _named_modules
from .vocabulary import (
    KIND_OF_SCOPE,
    MODEL_KIND,
    MODEL_SCOPE,
    DiscoveredBlock,
    ModelScopeOff,
    NarrowedBlock,
    SkippedBlock,
    Source,
    Target,
)

__all__ = ["TargetPlan", "model_label", "plan_targets", "select_targets", "why_nothing_found"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetPlan:
    """What :func:`plan_targets` found in one model part."""

    targets: list[Target]  # in module order, as select_targets returns them
    skipped: list[SkippedBlock]  # in module order
    source: Source  # "metadata" when any block came from the model's own declarations
    # The blocks graphed at narrower scopes than the widest asked for.
    narrowed: list[NarrowedBlock] = field(default_factory=list)
    # With the "model" scope asked for and refused: why the part is not graphed whole.
    model_off: ModelScopeOff | None = None


def model_label(model: nn.Module) -> str:
    """A short label for logs (class name and block count); never used to decide."""
    return f"{type(model).__name__} with {len(discover_blocks(model))} block(s)"


def plan_targets(
    model: nn.Module,
    *,
    include: Selector | None = None,
    scopes: Sequence[str] | None = None,
    attention: Any = RETIRED,
    router: Any = RETIRED,
) -> TargetPlan:
    """The targets to graph in ``model`` and the blocks that yield none, with why:
    what :meth:`~.manager.PartialCudaGraphManager.from_model_parts` graphs in this
    part, given the same ``include`` and ``scopes``.

    Args:
        model: the model (or one pipeline stage) to search; borrowed, not modified.
        include: extra user-chosen targets (see :func:`include_predicate`): one glob
            pattern over qualified names (``"model.layers.*.mlp.shared_experts"``),
            a list or tuple of patterns, or a predicate ``(name, module) -> bool``.
            A module already chosen is not added twice.
        scopes: names from :data:`SCOPES` (:func:`~.scopes.requested_scopes`; ``None``
            is every one of them); per block the widest requested one that is
            graph-safe is taken (:func:`~.scopes.choose_scopes`): target kinds
            ``"layer"``, ``"moe"``, ``"attention"``, ``"router"`` (scope
            ``moe_router``), ``"mlp"``. With :data:`~.scopes.MODEL_SCOPE` too, the
            part itself is one more target (kind ``"model"``, named ``""``, first)
            when :func:`~.model_scope.model_scope_refusal` allows it; the per-layer
            targets are kept beside it for the capture to fall back on.
        attention, router: retired; passing either raises (see
            :func:`~.arguments.refuse_retired`).

    Returns:
        A :class:`TargetPlan`: the targets in the order of ``model``'s modules (empty
        when nothing fits); one :class:`SkippedBlock` per block that holds no target
        (reason ``"no_graph_safe_scope"``: no requested scope fits it, as a Mamba or
        linear-attention layer asked for attention alone; ``"nothing_asked"``:
        ``scopes=()`` and ``include`` names nothing in it); one
        :class:`NarrowedBlock` per block graphed at narrower scopes than the widest
        asked for; ``source``, ``"metadata"`` when any block came from the model's
        declarations; and ``model_off``, why the part is not a ``"model"`` target when
        that scope was asked for. Beyond the rules of :mod:`.scopes`, it does not
        judge whether a target is graph-safe.

    Raises:
        CudaGraphsTypeError: ``model`` is not an ``nn.Module``, ``include`` /
            ``scopes`` has an unusable type, or a retired switch was passed.
        CudaGraphsValueError: ``scopes`` names an unknown scope or one twice.
        TargetSelectionError: the same physical module would be graphed under two
            names (a shared layer runs more than once per forward), or one target
            contains another.
    """
    refuse_retired("plan_targets", attention=attention, router=router)
    if not isinstance(model, nn.Module):
        raise CudaGraphsTypeError(f"model must be an nn.Module, got {type(model).__name__}")
    requested = requested_scopes(scopes)
    predicate = include_predicate(include)
    blocks = discover_blocks(model)
    probe = GroupedMMProbe()  # asks torch once per (dtype, device) in this pass
    scoped = {b.name: scope_block(b, model, requested, probe) for b in blocks}
    targets = [
        Target(name, module, KIND_OF_SCOPE[scope], b.name)
        for b in blocks
        for name, module, scope in scoped[b.name].pieces
    ]
    model_off = None
    if MODEL_SCOPE in requested:
        model_off = model_scope_refusal(
            model, blocks, include_given=predicate is not None, probe=probe
        )
    named = _named_modules(model)
    if predicate is not None:
        chosen = {t.name for t in targets}
        targets += [Target(n, m, "custom") for n, m in named if n not in chosen and predicate(n, m)]
    _reject_shared(targets)
    order = {name: i for i, (name, _) in enumerate(named)}
    targets.sort(key=lambda t: order[t.name])  # every target is one of named
    whole = MODEL_SCOPE in requested and model_off is None
    if whole:
        targets.insert(0, Target("", model, MODEL_KIND))  # the part itself, first
    skipped, narrowed = block_reports(
        blocks,
        # Every block lies in a part graphed whole; the scopes named are per block.
        [t.name for t in targets] + ([b.name for b in blocks] if whole else []),
        requested=tuple(s for s in requested if s != MODEL_SCOPE),
        scoped=scoped,
        example_of=_include_example,
    )
    for s in skipped:
        logger.debug("partial graphs: skipped %s (%s): %s", s.name, s.reason, s.detail)
    for n in narrowed:
        logger.debug("partial graphs: narrowed %s (%s): %s", n.name, n.reason, n.detail)
    source: Source = "metadata" if any(b.source == "metadata" for b in blocks) else "structure"
    if model_off is not None:
        logger.debug("partial graphs: %s not graphed whole: %s", model_off.part, model_off.detail)
    return TargetPlan(
        targets=targets, skipped=skipped, source=source, narrowed=narrowed, model_off=model_off
    )


def select_targets(
    model: nn.Module,
    *,
    include: Selector | None = None,
    scopes: Sequence[str] | None = None,
    attention: Any = RETIRED,
    router: Any = RETIRED,
) -> list[Target]:
    """The targets to graph in ``model``, in module order: :func:`plan_targets`'s
    ``targets`` (same arguments, same errors), without the skipped blocks."""
    refuse_retired("select_targets", attention=attention, router=router)
    return plan_targets(model, include=include, scopes=scopes).targets


def _reject_shared(targets: list[Target]) -> None:
    by_module: dict[int, str] = {}
    for t in targets:
        other = by_module.setdefault(id(t.module), t.name)
        if other != t.name:
            raise TargetSelectionError(
                f"{t.name} and {other} are the same module object: it runs more than once "
                "per forward, and one graph cannot stand for several calls with different "
                "inputs. Fixes: 1. untie the modules (one object per position); 2. leave "
                "them out of the targets (scopes= without their scope, or an include= "
                "that does not name them)."
            )
    names = {t.name for t in targets}
    for inner in sorted(names):
        parts = inner.split(".")
        for k in range(1, len(parts)):
            outer = ".".join(parts[:k])
            if outer in names:
                raise TargetSelectionError(
                    f"target {inner} lies inside target {outer}; graph one of them, not "
                    "both (narrow include= or scopes=)"
                )


def _include_example(block: DiscoveredBlock) -> str:
    # The block's mixer (a Mamba or linear-attention module is called like attention)
    # is the module a user most likely wants to name; the block itself otherwise.
    for name, module in _children(block.module):
        if is_attention(module):
            return _join(block.name, name)
    return block.name


def why_nothing_found(
    parts: Sequence[nn.Module], *, include: Selector | None, scopes: Sequence[str]
) -> str:
    """Why no target was found in ``parts`` with ``include`` and the ``scopes`` asked
    for (:func:`~.scopes.requested_scopes`), with the fixes (for a log line)."""
    if not parts:
        return "no model parts were given"
    searched = ", ".join(model_label(p) for p in parts)
    asked = [f"scopes {', '.join(scopes)}"] if scopes else []
    if include is not None:
        asked.append(f"include={include!r}")
    if not asked:
        return f"in {searched}: scopes=() and no include: nothing asked for"
    declared = any(b.source == "metadata" for p in parts for b in discover_blocks(p))
    rule = _METADATA_RULE if declared else _STRUCTURE_RULE
    return (
        f"in {searched}, looking for {', '.join(asked)}; {rule}. Fixes: 1. pass include= "
        "naming the modules to graph; 2. pass the model parts that hold the decoder layers"
    )


_STRUCTURE_RULE = (
    "blocks are found in a ModuleList/ModuleDict of same-typed modules that each hold an "
    "attention module"
)
_METADATA_RULE = (
    "blocks are the decoder-layer classes the model declares (_no_split_modules), and "
    "plan_targets reports each block that yields no target with the reason"
)
