"""Planning partial-graph targets: from the blocks :mod:`.discovery` finds, the scopes
asked for (:mod:`.scopes`) and the user's ``include``, the targets a manager graphs,
the blocks that yield none (:class:`SkippedBlock`) and those graphed narrower than
asked (:class:`NarrowedBlock`), each with the reason; and, when nothing is found, why.

Split from :mod:`.discovery`, which only finds blocks and their pieces: this module
decides; that one describes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from ..checks import check_bool
from ..errors import CudaGraphsTypeError, CudaGraphsValueError, TargetSelectionError
from ..moe_kernels import GroupedMMProbe
from .discovery import (
    KIND_OF_SCOPE,
    DiscoveredBlock,
    Source,
    Target,
    discover_blocks,
    is_attention,
)
from .model_scope import MODEL_KIND, ModelScopeOff, model_scope_refusal
from .scopes import MODEL_SCOPE, ScopedBlock, check_scopes, scope_block
from .selectors import Selector, include_predicate
from .skips import NarrowedBlock, SkippedBlock, block_reports
from .tree import children as _children
from .tree import join_name as _join
from .tree import named_modules as _named_modules

__all__ = ["TargetPlan", "model_label", "plan_targets", "select_targets", "why_nothing_found"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetPlan:
    """What :func:`plan_targets` found in one model part."""

    targets: list[Target]  # in module order, as select_targets returns them
    skipped: list[SkippedBlock]  # in module order
    source: Source  # "metadata" when any block came from the model's own declarations
    # With scopes: the blocks graphed at narrower scopes than the widest asked for.
    narrowed: list[NarrowedBlock] = field(default_factory=list)
    # With the "model" scope asked for and refused: why the part is not graphed whole.
    model_off: ModelScopeOff | None = None


def model_label(model: nn.Module) -> str:
    """A short label for logs (class name and block count); never used to decide."""
    return f"{type(model).__name__} with {len(discover_blocks(model))} block(s)"


def plan_targets(
    model: nn.Module,
    *,
    attention: bool = True,
    router: bool = True,
    include: Selector | None = None,
    scopes: Sequence[str] | None = None,
) -> TargetPlan:
    """The targets to graph in ``model`` and the blocks that yield none, with why.

    Args:
        model: the model (or one pipeline stage) to search; borrowed, not modified.
        attention, router: take the discovered attention modules / MoE routers (used
            when ``scopes`` is None; leave them at their defaults with ``scopes``).
        include: extra user-chosen targets (see :func:`include_predicate`): one glob
            pattern over qualified names (``"model.layers.*.mlp.shared_experts"``),
            a list or tuple of patterns, or a predicate ``(name, module) -> bool``.
            A module already chosen is not added twice.
        scopes: names from :data:`SCOPES`; per block the widest requested one that is
            graph-safe is taken (:func:`~.scopes.choose_scopes`): target kinds
            ``"layer"``, ``"moe"``, ``"attention"``, ``"router"`` (scope
            ``moe_router``), ``"mlp"``. With :data:`~.scopes.MODEL_SCOPE` too, the
            part itself is one more target (kind ``"model"``, named ``""``, first)
            when :func:`~.model_scope.model_scope_refusal` allows it; the per-layer
            targets are kept beside it for the capture to fall back on. ``None``
            keeps the ``attention`` / ``router`` flags.

    Returns:
        A :class:`TargetPlan`: the targets in the order of ``model``'s modules (empty
        when nothing fits); one :class:`SkippedBlock` per block that holds no target
        (reason ``"no_graph_safe_scope"``: it has nothing of the kinds asked for, as a
        Mamba or linear-attention layer without a router; ``"nothing_asked"``:
        attention and router are off, or ``scopes=()``, and ``include`` names nothing
        in it); with ``scopes``, one :class:`NarrowedBlock` per block graphed at
        narrower scopes than the widest asked for; and ``source``, ``"metadata"`` when
        any block came from the model's declarations; ``model_off``, why the part is
        not a ``"model"`` target when that scope was asked for. Beyond the rules of
        :mod:`.scopes`, it does not judge whether a target is graph-safe.

    Raises:
        CudaGraphsTypeError: ``model`` is not an ``nn.Module``, ``attention`` /
            ``router`` is not a bool, or ``include`` / ``scopes`` has an unusable type.
        CudaGraphsValueError: ``scopes`` names an unknown scope or one twice, or comes
            with ``attention`` / ``router`` switched off.
        TargetSelectionError: the same physical module would be graphed under two
            names (a shared layer runs more than once per forward), or one target
            contains another.
    """
    if not isinstance(model, nn.Module):
        raise CudaGraphsTypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_bool("attention", attention)
    check_bool("router", router)
    requested = None if scopes is None else _scopes_alone(scopes, attention, router)
    predicate = include_predicate(include)
    blocks = discover_blocks(model)
    probe = GroupedMMProbe()  # asks torch once per (dtype, device) in this pass
    scoped = (
        None
        if requested is None
        else {b.name: scope_block(b, model, requested, probe) for b in blocks}
    )
    targets = _block_targets(blocks, scoped, attention=attention, router=router)
    model_off = None
    if requested is not None and MODEL_SCOPE in requested:
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
    whole = requested is not None and MODEL_SCOPE in requested and model_off is None
    if whole:
        targets.insert(0, Target("", model, MODEL_KIND))  # the part itself, first
    skipped, narrowed = block_reports(
        blocks,
        # Every block lies in a part graphed whole; the scopes named are per block.
        [t.name for t in targets] + ([b.name for b in blocks] if whole else []),
        attention=attention,
        router=router,
        requested=None if requested is None else tuple(s for s in requested if s != MODEL_SCOPE),
        scoped=scoped or {},
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


def _block_targets(
    blocks: list[DiscoveredBlock],
    scoped: dict[str, ScopedBlock] | None,
    *,
    attention: bool,
    router: bool,
) -> list[Target]:
    if scoped is None:  # no scopes: the flags pick the attention and router targets
        pairs = [p for b in blocks for p in ((b.attention, attention), (b.router, router))]
        return [t for t, wanted in pairs if wanted and t is not None]
    return [
        Target(name, module, KIND_OF_SCOPE[scope], b.name)
        for b in blocks
        for name, module, scope in scoped[b.name].pieces
    ]


def _scopes_alone(scopes: object, attention: bool, router: bool) -> tuple[str, ...]:
    requested = check_scopes(scopes)
    off = [f"{n}=False" for n, on in (("attention", attention), ("router", router)) if not on]
    if off:
        raise CudaGraphsValueError(
            f"plan_targets got scopes={requested!r} and {' and '.join(off)}: the flags and "
            "scopes both choose what is graphed; use one or the other. Fixes: 1. keep "
            "scopes and drop the flags (scopes=('attention',) takes attention only); "
            "2. drop scopes and keep the flags"
        )
    return requested


def select_targets(
    model: nn.Module,
    *,
    attention: bool = True,
    router: bool = True,
    include: Selector | None = None,
    scopes: Sequence[str] | None = None,
) -> list[Target]:
    """The targets to graph in ``model``, in module order: :func:`plan_targets`'s
    ``targets`` (same arguments, same errors), without the skipped blocks."""
    plan = plan_targets(model, attention=attention, router=router, include=include, scopes=scopes)
    return plan.targets


def _reject_shared(targets: list[Target]) -> None:
    by_module: dict[int, str] = {}
    for t in targets:
        other = by_module.setdefault(id(t.module), t.name)
        if other != t.name:
            raise TargetSelectionError(
                f"{t.name} and {other} are the same module object: it runs more than once "
                "per forward, and one graph cannot stand for several calls with different "
                "inputs. Fixes: 1. untie the modules (one object per position); 2. leave "
                "them out of the targets (attention=False / router=False, narrower scopes, "
                "or an include that does not name them)."
            )
    names = {t.name for t in targets}
    for inner in sorted(names):
        parts = inner.split(".")
        for k in range(1, len(parts)):
            outer = ".".join(parts[:k])
            if outer in names:
                raise TargetSelectionError(
                    f"target {inner} lies inside target {outer}; graph one of them, not "
                    "both (narrow include, narrow scopes, or turn attention / router off)"
                )


def _include_example(block: DiscoveredBlock) -> str:
    # The block's mixer (a Mamba or linear-attention module is called like attention)
    # is the module a user most likely wants to name; the block itself otherwise.
    for name, module in _children(block.module):
        if is_attention(module):
            return _join(block.name, name)
    return block.name


def why_nothing_found(
    parts: Sequence[nn.Module],
    *,
    attention: bool,
    router: bool,
    include: Selector | None,
    scopes: Sequence[str] | None = None,
) -> str:
    """Why no target was found in ``parts``, with the fixes (for a log line). With
    ``scopes``, the flags are not consulted."""
    if not parts:
        return "no model parts were given"
    searched = ", ".join(model_label(p) for p in parts)
    if scopes is not None:
        asked = [f"scopes {', '.join(scopes)}"] if scopes else []
        nothing = "scopes=() and no include"
    else:
        asked = [w for w, on in (("attention", attention), ("MoE routers", router)) if on]
        nothing = "attention=False, router=False and no include"
    if include is not None:
        asked.append(f"include={include!r}")
    if not asked:
        return f"in {searched}: {nothing}: nothing asked for"
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
