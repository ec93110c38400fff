"""Discovery of partial-graph targets in a training model: from the model's own
metadata where it declares some, from its structure otherwise.

Nothing here looks at model names, and no list of architectures is kept here: class
names come from the model's own declarations, and a model label is produced for
diagnostics only.

1. Metadata (:mod:`.metadata`). A Hugging Face ``PreTrainedModel`` declares its
   decoder-layer classes (``_no_split_modules``) and the classes that produce its
   attention weights and router logits (``_can_record_outputs``). The declaring module
   is the model part passed or any module inside it (``model.model``, a whole
   ``...ForCausalLM``, the language model of a composite); the nearest declaration
   above a module is the one in force, as in transformers' own output hooks. Blocks
   are the outermost modules of a declared layer class. In a block, attention is the
   shallowest descendant of a declared attention class (a direct child first), the
   router the shallowest of a declared router class, and the MoE sublayer is the
   router's parent. Where a model declares attention classes nothing else is
   attention (a linear-attention or Mamba mixer is not), even when no module of those
   classes is left in the model (its blocks are then skipped, saying so); where it
   declares layer classes but no attention or router class, the structural rule finds
   those inside the blocks. Cross-attention is never a target.
2. Structure, for modules no declaration covers (user models; a pipeline stage that
   is a plain ``ModuleList`` of layers) and beneath a declaration whose layer classes
   occur nowhere beneath it (it does not describe those modules): a block is a child
   of a ``ModuleList``/``ModuleDict`` of same-typed modules that each hold an
   attention module; attention is recognized by how it is called (``hidden_states``
   plus an attention mask or position embeddings) and what it owns (projections); an
   MoE sublayer by having a router (a gate with a 2-D weight) beside experts.

Targets are the modules a manager will graph: by default each block's whole attention
module and its MoE router. With ``scopes`` (:mod:`.scopes`), each block is graphed at
the widest requested scope that is graph-safe there (the whole layer, the whole MoE
sublayer, attention, the router, a dense MLP), and each narrowing is reported as a
:class:`NarrowedBlock`. A block that yields no target is reported by
:func:`plan_targets` as a :class:`SkippedBlock` with a reason and the fix, never
dropped silently. Users add targets of their own with ``include``: one glob pattern
over qualified module names (a plain string), a list or tuple of patterns, or a
predicate ``(name, module) -> bool``.

What this module does NOT do: it does not graph MLPs, whole MoE blocks or whole layers
unless ``scopes`` or ``include`` ask for them, nor state-space / linear-attention
mixers unless ``include`` names them; it does not tell
encoder layers from decoder layers (no metadata does: a T5 encoder's self-attention is
a target like its decoder's); beneath a declaration it does not look for structural
stacks the declaration leaves out (``include`` names those); and it does not judge
whether a module is graph-safe (host syncs, data-dependent shapes): the replay
contract and the capture do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from ..checks import check_bool
from ..errors import CudaGraphsTypeError, CudaGraphsValueError, TargetSelectionError
from .kernels import GroupedMMProbe
from .metadata import ModelMetadata, first_declared, read_metadata
from .scopes import SCOPES, Scope, ScopedBlock, check_scopes, forward_parameters, scope_block
from .selectors import Selector, as_model_parts, include_predicate
from .skips import NarrowedBlock, SkippedBlock, block_reports
from .tree import children as _children
from .tree import join_name as _join
from .tree import named_modules as _named_modules
from .tree import unwrap_checkpoint

__all__ = [
    "SCOPES",
    "DiscoveredBlock",
    "NarrowedBlock",
    "Selector",
    "SkippedBlock",
    "Target",
    "TargetPlan",
    "TargetSelectionError",
    "as_model_parts",
    "check_scopes",
    "discover_blocks",
    "find_attention",
    "find_moe",
    "include_predicate",
    "model_label",
    "plan_targets",
    "select_targets",
    "unwrap_checkpoint",
    "why_nothing_found",
]

logger = logging.getLogger(__name__)

TargetKind = Literal["attention", "router", "custom", "layer", "moe", "mlp"]
Source = Literal["metadata", "structure"]
_ROUTER_NAMES = ("gate", "router")  # the router child of an MoE sublayer
_EXPERT_NAMES = ("experts",)
# The Target kind of each scope: the router keeps the kind it has without scopes.
_KIND: dict[Scope, TargetKind] = {
    "attention": "attention",
    "moe_router": "router",
    "mlp": "mlp",
    "moe": "moe",
    "layer": "layer",
}


@dataclass(frozen=True)
class Target:
    """One module to graph."""

    name: str  # qualified name in the model part, wrappers unwrapped
    module: nn.Module = field(compare=False)
    kind: TargetKind
    block: str | None = None  # the block it belongs to, when discovered in one


@dataclass(frozen=True)
class DiscoveredBlock:
    """One transformer block and the graphable pieces found in it."""

    name: str
    module: nn.Module = field(compare=False)
    attention: Target | None
    router: Target | None
    moe: str | None  # qualified name of the MoE sublayer, if any
    source: Source = "structure"  # what named it a block, and the rule used inside it
    # The declaration in force (None for a structural block): skip reports name its classes.
    metadata: ModelMetadata | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TargetPlan:
    """What :func:`plan_targets` found in one model part."""

    targets: list[Target]  # in module order, as select_targets returns them
    skipped: list[SkippedBlock]  # in module order
    source: Source  # "metadata" when any block came from the model's own declarations
    # With scopes: the blocks graphed at narrower scopes than the widest asked for.
    narrowed: list[NarrowedBlock] = field(default_factory=list)


def _is_attention(module: nn.Module) -> bool:
    params = {p.name for p in forward_parameters(module)}
    takes_hidden = "hidden_states" in params or "x" in params
    takes_context = bool({"attention_mask", "position_embeddings", "position_ids"} & params)
    projections = sum(isinstance(m, nn.Linear) for m in module.modules())
    return takes_hidden and takes_context and projections >= 2


def find_attention(block: nn.Module, prefix: str = "") -> tuple[str, nn.Module] | None:
    """The block's whole attention module: a direct child called with hidden states
    and an attention mask or position embeddings, owning at least two projections."""
    found = [(n, m) for n, m in _children(block) if _is_attention(m)]
    if len(found) > 1:
        logger.debug(
            "block %s has several attention-like children %s; taking the first",
            prefix,
            [n for n, _ in found],
        )
    if not found:
        return None
    name, module = found[0]
    return (f"{prefix}.{name}" if prefix else name), module


def _router_of(module: nn.Module) -> tuple[str, nn.Module] | None:
    children = dict(_children(module))
    if not any(n in children for n in _EXPERT_NAMES):
        return None
    for n in _ROUTER_NAMES:
        router = children.get(n)
        weight = getattr(router, "weight", None)
        if router is not None and getattr(weight, "dim", lambda: 0)() == 2:
            return n, router
    return None


def find_moe(block: nn.Module, prefix: str = "") -> tuple[str, nn.Module, str, nn.Module] | None:
    """The block's MoE sublayer (a module with experts and a router that owns a 2-D
    weight) and its router: ``(moe name, moe, router name, router)``."""
    stack = [(prefix, block)]
    while stack:
        name, module = stack.pop(0)
        hit = _router_of(module)
        if hit is not None and module is not block:
            rname, router = hit
            return name, module, f"{name}.{rname}", router
        for child_name, child in _children(module):
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    return None


def _is_block_stack(container: nn.Module) -> bool:
    blocks = [m for _, m in _children(container)]
    if not blocks:
        return False
    return len({type(b) for b in blocks}) == 1 and all(find_attention(b) for b in blocks)


def discover_blocks(model: nn.Module, prefix: str = "") -> list[DiscoveredBlock]:
    """Every transformer block of ``model``, in module order (see the module docstring
    for the two rules): the modules of a declared decoder-layer class beneath a
    declaration, and elsewhere the children of each structural block stack, main stack
    and extra stacks (multi-token-prediction layers) alike."""
    out: list[DiscoveredBlock] = []
    stack: list[tuple[str, nn.Module, ModelMetadata | None]] = [(prefix, model, None)]
    while stack:
        name, module, declared = stack.pop()
        declared = _declaration_in_force(name, module, declared)
        if declared is not None and declared.is_layer(module):
            out.append(_metadata_block(name, module, declared))
            continue  # outermost only: a layer class inside a layer is part of it
        if (
            declared is None
            and isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and _is_block_stack(module)
        ):
            out.extend(_describe_block(_join(name, n), child) for n, child in _children(module))
            continue  # blocks found: do not look for stacks inside them
        children = list(_children(module))
        stack.extend((_join(name, n), child, declared) for n, child in reversed(children))
    return out


def _declaration_in_force(
    name: str, module: nn.Module, inherited: ModelMetadata | None
) -> ModelMetadata | None:
    declared = read_metadata(module)
    if declared is None:
        return inherited
    if any(declared.is_layer(m) for _, m in _named_modules(module)):
        return declared
    # The layers were replaced by classes the declaration does not name (or it belongs
    # to another configuration): it describes nothing here, so it is not trusted here.
    logger.debug(
        "%s (%s) declares decoder layers %s and holds none of them; the rules in force "
        "above it apply beneath it",
        name or "the model part",
        declared.owner,
        list(declared.layer_classes),
    )
    return inherited


def _metadata_block(name: str, block: nn.Module, declared: ModelMetadata) -> DiscoveredBlock:
    if declared.attention and declared.is_attention(name, block):
        attn = (name, block)  # a model that names its attention class as the layer
    elif declared.attention:
        hit = first_declared(block, name, declared.is_attention, "attention")
        attn = (hit[0], hit[1]) if hit else None
    else:  # layer classes but no attention class declared (Falcon): by structure
        attn = find_attention(block, name)
    if declared.router:
        hit = first_declared(block, name, declared.is_router, "router")
        moe = (hit[2], hit[3], hit[0], hit[1]) if hit else None
    else:
        moe = find_moe(block, name)
    return _block_record(name, block, attn, moe, "metadata", declared)


def _describe_block(name: str, block: nn.Module) -> DiscoveredBlock:
    moe = find_moe(block, name)
    return _block_record(name, block, find_attention(block, name), moe, "structure", None)


def _block_record(
    name: str,
    block: nn.Module,
    attn: tuple[str, nn.Module] | None,
    moe: tuple[str, nn.Module, str, nn.Module] | None,
    source: Source,
    declared: ModelMetadata | None,
) -> DiscoveredBlock:
    return DiscoveredBlock(
        name=name,
        module=block,
        attention=Target(attn[0], attn[1], "attention", name) if attn else None,
        router=Target(moe[2], moe[3], "router", name) if moe else None,
        moe=moe[0] if moe else None,
        source=source,
        metadata=declared,
    )


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
            ``moe_router``), ``"mlp"``. ``None`` keeps the ``attention`` / ``router``
            flags.

    Returns:
        A :class:`TargetPlan`: the targets in the order of ``model``'s modules (empty
        when nothing fits); one :class:`SkippedBlock` per block that holds no target
        (reason ``"no_graph_safe_scope"``: it has nothing of the kinds asked for, as a
        Mamba or linear-attention layer without a router; ``"nothing_asked"``:
        attention and router are off, or ``scopes=()``, and ``include`` names nothing
        in it); with ``scopes``, one :class:`NarrowedBlock` per block graphed at
        narrower scopes than the widest asked for; and ``source``, ``"metadata"`` when
        any block came from the model's declarations. Beyond the rules of
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
    named = _named_modules(model)
    if predicate is not None:
        chosen = {t.name for t in targets}
        targets += [Target(n, m, "custom") for n, m in named if n not in chosen and predicate(n, m)]
    _reject_shared(targets)
    order = {name: i for i, (name, _) in enumerate(named)}
    targets.sort(key=lambda t: order[t.name])  # every target is one of named
    skipped, narrowed = block_reports(
        blocks,
        [t.name for t in targets],
        attention=attention,
        router=router,
        requested=requested,
        scoped=scoped or {},
        example_of=_include_example,
    )
    for s in skipped:
        logger.debug("partial graphs: skipped %s (%s): %s", s.name, s.reason, s.detail)
    for n in narrowed:
        logger.debug("partial graphs: narrowed %s (%s): %s", n.name, n.reason, n.detail)
    source: Source = "metadata" if any(b.source == "metadata" for b in blocks) else "structure"
    return TargetPlan(targets=targets, skipped=skipped, source=source, narrowed=narrowed)


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
        Target(name, module, _KIND[scope], b.name)
        for b in blocks
        for name, module, scope in scoped[b.name].pieces
    ]


def _scopes_alone(scopes: object, attention: bool, router: bool) -> tuple[Scope, ...]:
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
        if _is_attention(module):
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
