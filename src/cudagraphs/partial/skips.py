"""Why a discovered block yields no target, or a narrower one than asked: one
:class:`~.vocabulary.SkippedBlock` per block with no target and one
:class:`~.vocabulary.NarrowedBlock` per block graphed at narrower scopes, each with a
reason a program can count (from :data:`~.vocabulary.SKIPPED` and
:data:`~.vocabulary.NARROWED`) and a detail a user can act on: what the block holds,
what was looked for and why each scope was refused (by the rules of :mod:`.scopes`),
and the fixes as numbered options.

What this module does NOT do: it decides no target (:mod:`.discovery` and
:mod:`.scopes` do) and does not log; the caller reports the records.
"""

from __future__ import annotations

from collections.abc import Callable

from .scopes import ScopedBlock
from .tree import children, names_overlap
from .vocabulary import (
    ClassSpec,
    DiscoveredBlock,
    ModelMetadata,
    NarrowedBlock,
    NarrowReason,
    Scope,
    SkippedBlock,
)

__all__ = [
    "block_reports",
    "narrow_record",
    "scoped_skip_record",
]

_NOT_ATTENTION = (
    "no attention-like child (called with hidden_states plus an attention mask or "
    "positions, owning two or more projections)"
)
_NOT_ROUTER = "no MoE router (a gate or router with a 2-D weight beside experts)"


def _head(block: DiscoveredBlock) -> tuple[str, str]:
    """The block's class name, and what the block is and holds (a detail's opening)."""
    block_type = type(block.module).__name__
    held = ", ".join(f"{n} ({type(m).__name__})" for n, m in children(block.module))
    return block_type, f"{block_type} {block.name} holds {held or 'no submodules'}"


def _labels(specs: tuple[ClassSpec, ...]) -> str:
    return " or ".join(spec.label() for spec in specs)


def _missing_attention(declared: ModelMetadata | None, anywhere: bool) -> str:
    if declared is None or not declared.attention:
        return _NOT_ATTENTION
    labels = _labels(declared.attention)
    text = f"no module of the attention class {labels} ({declared.owner} declares it)"
    return text if anywhere else text + _NOWHERE


def _missing_router(declared: ModelMetadata | None) -> str:
    if declared is None or not declared.router:
        return _NOT_ROUTER
    return f"no router of the class {_labels(declared.router)} ({declared.owner} declares it)"


_NOWHERE = (
    " and no block of this model part holds one (if the attention modules were replaced "
    "by another class, name them with include=)"
)
_NOTHING_SCOPES = (
    "scopes=() and include names nothing in it. Fixes: 1. ask for scopes (attention, "
    "moe_router, mlp, moe, layer); 2. name modules of it with include="
)
_INCLUDE_FIX = (
    "if one of its modules is graph-safe (no host sync, the same shapes every step), name "
    "it with include=, e.g. include=['{example}']"
)
_MIXER_FIX = "if its mixer is graph-safe, name it with include=, e.g. include=['{example}']"
_NO_ATTENTION = (
    "it has no attention module (a Mamba or linear-attention mixer is not one), and a layer "
    "is graphed whole only around attention: a mixer keeps recurrent state and picks its "
    "kernels on the host"
)
_EAGER = (
    "the experts of {moe} run the experts implementation 'eager': a Python loop over the "
    "experts hit, with shapes read on the host (a sync, and shapes that change every step)"
)
_ROUTER_LOGITS = (
    "the model collects its routers' logits (config.output_router_logits) with a "
    "forward hook on {router}, which a replay of a graph around the router would never "
    "run (the logits, and the load-balancing loss, would be missing)"
)
_ROUTER_LOGITS_FIXES = (
    "leave it so: the router is graphed alone, its hook outside the graph",
    "set config.output_router_logits=False where the load-balancing loss is not needed",
)
_HOST_GROUPED = (
    "the experts of {moe} run 'grouped_mm', but torch has no grouped-GEMM kernel for their "
    "dtype on this GPU and falls back to a loop that copies the expert offsets to the host "
    "(a sync a capture cannot hold)"
)
_HOST_GROUPED_FIXES = (
    "keep the experts in bfloat16 (model.to(torch.bfloat16)), which torch's grouped GEMM "
    "runs on the device on Hopper and Blackwell GPUs",
    "call model.set_experts_implementation('batched_mm') (static shapes in any dtype), "
    "or let the partial-graph manager set it (experts_implementation='batched_mm')",
)
_UNSTATED_FIXES = (
    "if its experts keep static shapes (no .item(), nonzero() or Python loop over experts), "
    "graph it by name: include=['{moe}'] with moe_router left out of scopes",
    "on a transformers model, call model.set_experts_implementation('grouped_mm')",
)
_NO_MOE = "no MoE sublayer (a module, not the block itself, holding a router beside experts)"
_NO_MLP = (
    "no dense MLP (a direct child, not attention, MoE or a norm, owning two or more "
    "projections, called with one tensor)"
)
_STATIC_FIXES = (
    "call model.set_experts_implementation('grouped_mm') (or 'batched_mm': static shapes, "
    "expert offsets on the device) before the partial-graph manager is built",
    "let the partial-graph manager set it (its experts-implementation option)",
)


def block_reports(
    blocks: list[DiscoveredBlock],
    target_names: list[str],
    *,
    requested: tuple[Scope, ...],
    scoped: dict[str, ScopedBlock],
    example_of: Callable[[DiscoveredBlock], str],
) -> tuple[list[SkippedBlock], list[NarrowedBlock]]:
    """The skipped and the narrowed blocks among ``blocks``, in module order.

    Args:
        blocks: every discovered block (borrowed).
        target_names: the qualified names of every target chosen, includes as well.
        requested: the scopes asked for.
        scoped: each block's scope decision by name.
        example_of: a module name of a block to suggest for ``include=``.
    """
    attention_anywhere = any(b.attention is not None for b in blocks)
    skipped, narrowed = [], []
    for block in blocks:
        # A target inside the block, or one holding it (include="model.layers.3"),
        # means the block is graphed, whole or in part.
        graphed = any(names_overlap(name, block.name) for name in target_names)
        scope = scoped[block.name]
        if not graphed:
            skipped.append(
                scoped_skip_record(
                    block,
                    scope,
                    requested=requested,
                    attention_anywhere=attention_anywhere,
                    example=example_of(block),
                )
            )
        elif scope.choice.wanted is not None and scope.choice.scopes:
            narrowed.append(narrow_record(block, scope, example_of(block)))
    return skipped, narrowed


def narrow_record(block: DiscoveredBlock, scoped: ScopedBlock, example: str) -> NarrowedBlock:
    """The record of ``block``, graphed at ``scoped.choice.scopes`` instead of the
    wider ``scoped.choice.wanted``. ``example`` is a module name to suggest for
    ``include=`` (the block's mixer)."""
    choice = scoped.choice
    assert choice.wanted is not None and choice.reasons and choice.scopes, choice
    block_type = type(block.module).__name__
    why = "; ".join(_refusal(r, block, scoped) for r in choice.reasons)
    mixer = [_MIXER_FIX.format(example=example)]
    fixes = [
        f
        for r in choice.reasons
        for f in (mixer if r == "no_attention" else _experts_fixes(block, scoped))
    ]
    detail = (
        f"{block_type} {block.name}: {choice.wanted} was asked for, but {why}; graphed at "
        f"{' + '.join(choice.scopes)} instead. {_numbered(fixes)}"
    )
    return NarrowedBlock(
        block.name, block_type, choice.wanted, choice.scopes, choice.reasons[0], detail
    )


def scoped_skip_record(
    block: DiscoveredBlock,
    scoped: ScopedBlock,
    *,
    requested: tuple[Scope, ...],
    attention_anywhere: bool,
    example: str,
) -> SkippedBlock:
    """The record of ``block``, in which no requested scope is graph-safe (or none was
    requested), saying per scope why not, and the fixes."""
    block_type, head = _head(block)
    if not requested:
        return SkippedBlock(block.name, block_type, "nothing_asked", f"{head}; {_NOTHING_SCOPES}")
    why = "; ".join(
        f"{s}: {_scope_missing(s, block, scoped, attention_anywhere)}" for s in requested
    )
    # A piece found in the block whose scope was not asked for.
    left_out = [
        f"its {t.kind} {t.name} is left out ({scope} is not among the scopes); "
        for t, scope in ((block.attention, "attention"), (block.router, "moe_router"))
        if t is not None and scope not in requested
    ]
    # The include= fix last covers a refused layer's mixer too.
    experts_refused = not set(scoped.choice.reasons) <= {"no_attention"}
    fixes = _experts_fixes(block, scoped) if experts_refused else []
    fixes.append(_INCLUDE_FIX.format(example=example))
    return SkippedBlock(
        block.name,
        block_type,
        "no_graph_safe_scope",
        f"{head}; {''.join(left_out)}no scope asked for fits it ({why}). {_numbered(fixes)}",
    )


def _scope_missing(
    scope: Scope, block: DiscoveredBlock, scoped: ScopedBlock, attention_anywhere: bool
) -> str:
    # Called only for a block where no requested scope was taken, so each scope here
    # was refused: for want of its piece, or (layer, moe) by a rule of .scopes.
    offer = scoped.offer
    if scope == "layer":
        return _experts_refusal(block, scoped) if offer.attention else _NO_ATTENTION
    if scope == "attention":
        return _missing_attention(block.metadata, attention_anywhere)
    if scope == "moe_router":
        return _missing_router(block.metadata)
    if scope == "moe" and offer.moe:
        return _experts_refusal(block, scoped)
    return _NO_MOE if scope == "moe" else _NO_MLP


def _refusal(reason: NarrowReason, block: DiscoveredBlock, scoped: ScopedBlock) -> str:
    return _NO_ATTENTION if reason == "no_attention" else _experts_refusal(block, scoped)


def _experts_refusal(block: DiscoveredBlock, scoped: ScopedBlock) -> str:
    # .scopes refuses experts as "router_logits" when the model collects its routers'
    # logits, "host_grouped_mm" when grouped_mm runs off the device for their dtype, as
    # "eager_experts" when the implementation is "eager", and as "unknown_experts"
    # otherwise.
    experts = scoped.offer.experts
    if scoped.offer.router and scoped.offer.router_logits:
        return _ROUTER_LOGITS.format(router=block.router.name if block.router else block.moe)
    if _host_grouped(scoped):
        return _HOST_GROUPED.format(moe=block.moe)
    if experts == "eager":
        return _EAGER.format(moe=block.moe)
    stated = (
        f"{experts!r}, not one known to keep static shapes (grouped_mm, batched_mm)"
        if experts
        else "not stated (no config._experts_implementation on its experts or the model)"
    )
    return f"the experts implementation of {block.moe} is {stated}"


def _host_grouped(scoped: ScopedBlock) -> bool:
    return scoped.offer.experts == "grouped_mm" and not scoped.offer.grouped_on_device


def _experts_fixes(block: DiscoveredBlock, scoped: ScopedBlock) -> list[str]:
    # A stated implementation ("eager" or one not known to be static) is switched; with
    # none stated (a user model), the MoE sublayer is named instead.
    if scoped.offer.router and scoped.offer.router_logits:
        return list(_ROUTER_LOGITS_FIXES)
    if _host_grouped(scoped):
        return list(_HOST_GROUPED_FIXES)
    if scoped.offer.experts:
        return list(_STATIC_FIXES)
    return [f.format(moe=block.moe) for f in _UNSTATED_FIXES]


def _numbered(fixes: list[str]) -> str:
    unique = list(dict.fromkeys(fixes))
    if len(unique) == 1:
        return f"Fix: {unique[0]}."
    return "Fixes: " + "; ".join(f"{i}. {f}" for i, f in enumerate(unique, 1)) + "."
