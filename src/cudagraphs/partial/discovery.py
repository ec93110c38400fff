"""Structural discovery of partial-graph targets in a training model.

Nothing here looks at model names: a transformer block is recognized by what it holds
(an attention submodule), attention by how it is called (``hidden_states`` plus an
attention mask or position embeddings) and what it owns (projections), an MoE
sublayer by having a router (a gate with a weight) beside experts. A model label is
produced for diagnostics only.

Targets are the modules a manager will graph: each block's whole attention module and
its MoE router. Users add targets of their own with ``include``: one glob pattern over
qualified module names (a plain string), a list or tuple of patterns, or a predicate
``(name, module) -> bool``.

What this module does NOT do: it does not graph MLPs, whole MoE blocks or whole
layers unless ``include`` names them, and it does not judge whether an included
module is graph-safe (host syncs, data-dependent shapes): the replay contract and the
capture do.
"""

from __future__ import annotations

import fnmatch
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from ..checks import check_bool
from ..errors import CudaGraphsTypeError, TargetSelectionError

__all__ = [
    "DiscoveredBlock",
    "Selector",
    "Target",
    "TargetSelectionError",
    "as_model_parts",
    "discover_blocks",
    "find_attention",
    "find_moe",
    "include_predicate",
    "model_label",
    "select_targets",
    "unwrap_checkpoint",
    "why_nothing_found",
]

logger = logging.getLogger(__name__)

TargetKind = Literal["attention", "router", "custom"]
_ROUTER_NAMES = ("gate", "router")  # the router child of an MoE sublayer
_EXPERT_NAMES = ("experts",)


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


def unwrap_checkpoint(module: nn.Module) -> nn.Module:
    """The module beneath any nesting of activation-checkpoint wrappers."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _children(module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    # _modules, not named_children(): the latter skips a module registered twice (a
    # tied layer), which is exactly what target selection must see and reject.
    for name, child in module._modules.items():
        if child is None:
            continue
        if hasattr(child, "_checkpoint_wrapped_module"):
            # The wrapper's own child name is an implementation detail; report the
            # wrapped module under the wrapper's name.
            yield name, unwrap_checkpoint(child)
        else:
            yield name, child


def _forward_parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _is_attention(module: nn.Module) -> bool:
    params = _forward_parameters(module)
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
    """Every transformer block of ``model``: the children of each block stack (a
    ``ModuleList``/``ModuleDict`` of same-typed blocks that each hold an attention
    module), main stack and extra stacks (multi-token-prediction layers) alike."""
    out: list[DiscoveredBlock] = []
    stack = [(prefix, model)]
    while stack:
        name, module = stack.pop(0)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and _is_block_stack(module):
            for child_name, child in _children(module):
                out.append(_describe_block(f"{name}.{child_name}" if name else child_name, child))
            continue  # blocks found: do not look for stacks inside them
        for child_name, child in _children(module):
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    return out


def _describe_block(name: str, block: nn.Module) -> DiscoveredBlock:
    attn = find_attention(block, name)
    moe = find_moe(block, name)
    return DiscoveredBlock(
        name=name,
        module=block,
        attention=Target(attn[0], attn[1], "attention", name) if attn else None,
        router=Target(moe[2], moe[3], "router", name) if moe else None,
        moe=moe[0] if moe else None,
    )


def model_label(model: nn.Module) -> str:
    """A short label for logs (class name and block count); never used to decide."""
    return f"{type(model).__name__} with {len(discover_blocks(model))} block(s)"


#: What ``include`` accepts: one glob pattern, a list or tuple of them, or a predicate.
Selector = str | Sequence[str] | Callable[[str, nn.Module], bool]
Predicate = Callable[[str, nn.Module], bool]


def include_predicate(include: Selector | None) -> Predicate | None:
    """``include`` as a predicate ``(name, module) -> bool`` (``None`` stays ``None``).

    A plain string is one glob pattern (``"model.layers.*.mlp"``), not a sequence of
    one-character patterns; a list or tuple holds patterns; a callable is used as it
    is. Patterns match qualified names with :func:`fnmatch.fnmatchcase`.

    Raises:
        CudaGraphsTypeError: ``include`` is none of these, or a list / tuple holds
            something other than a string (naming ``include[i]``).
    """
    if include is None:
        return None
    if isinstance(include, str):
        patterns: tuple[str, ...] = (include,)
    elif isinstance(include, (list, tuple)):
        for i, pattern in enumerate(include):
            if not isinstance(pattern, str):
                raise CudaGraphsTypeError(
                    f"include[{i}] must be a glob pattern (str), got "
                    f"{type(pattern).__name__} {pattern!r}"
                )
        patterns = tuple(include)
    elif callable(include):
        return include
    else:
        raise CudaGraphsTypeError(
            "include must be a glob pattern (str), a list or tuple of patterns, or a "
            f"predicate (name, module) -> bool; got {type(include).__name__} {include!r}"
        )

    def matches(name: str, module: nn.Module) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    return matches


def select_targets(
    model: nn.Module,
    *,
    attention: bool = True,
    router: bool = True,
    include: Selector | None = None,
) -> list[Target]:
    """The targets to graph in ``model``, in module order.

    Args:
        model: the model (or one pipeline stage) to search; not modified.
        attention, router: take the discovered attention modules / MoE routers.
        include: extra user-chosen targets (see :func:`include_predicate`): one glob
            pattern over qualified names (``"model.layers.*.mlp.shared_experts"``),
            a list or tuple of patterns, or a predicate ``(name, module) -> bool``.
            A module already chosen is not added twice.

    Returns:
        The targets, in the order of ``model``'s modules (empty when nothing fits).

    Raises:
        CudaGraphsTypeError: ``model`` is not an ``nn.Module``, ``attention`` /
            ``router`` is not a bool, or ``include`` has an unusable type.
        TargetSelectionError: the same physical module would be graphed under two
            names (a shared layer runs more than once per forward), or one target
            contains another.
    """
    if not isinstance(model, nn.Module):
        raise CudaGraphsTypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_bool("attention", attention)
    check_bool("router", router)
    predicate = include_predicate(include)
    targets: list[Target] = []
    for block in discover_blocks(model):
        if attention and block.attention is not None:
            targets.append(block.attention)
        if router and block.router is not None:
            targets.append(block.router)
    if predicate is not None:
        chosen = {t.name for t in targets}
        for name, module in _named_modules(model):
            if name not in chosen and predicate(name, module):
                targets.append(Target(name, module, "custom"))
    _reject_shared(targets)
    order = {name: i for i, (name, _) in enumerate(_named_modules(model))}
    return sorted(targets, key=lambda t: order.get(t.name, len(order)))


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out, stack = [], [("", model)]
    while stack:
        name, module = stack.pop()
        if name:
            out.append((name, module))
        children = list(_children(module))
        for child_name, child in reversed(children):
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    return out


def _reject_shared(targets: list[Target]) -> None:
    by_module: dict[int, str] = {}
    for t in targets:
        other = by_module.setdefault(id(t.module), t.name)
        if other != t.name:
            raise TargetSelectionError(
                f"{t.name} and {other} are the same module object: it runs more than once "
                "per forward, and one graph cannot stand for several calls with different "
                "inputs. Fixes: 1. untie the modules (one object per position); 2. leave "
                "them out of the targets (attention=False / router=False, or an include "
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
                    "both (narrow include, or turn attention / router off)"
                )


def as_model_parts(model_parts: Any) -> list[nn.Module]:
    """``model_parts`` as a list of modules: one ``nn.Module`` (a ``ModuleList``
    included: it is one module) or an iterable of them.

    Raises:
        CudaGraphsTypeError: neither, naming ``model_parts`` or ``model_parts[i]``.
    """
    if isinstance(model_parts, nn.Module):
        return [model_parts]
    if isinstance(model_parts, (str, bytes)) or not isinstance(model_parts, Iterable):
        raise CudaGraphsTypeError(
            "model_parts must be an nn.Module or a sequence of them (pipeline stages), "
            f"got {type(model_parts).__name__}"
        )
    parts = list(model_parts)
    for i, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise CudaGraphsTypeError(
                f"model_parts[{i}] must be an nn.Module, got {type(part).__name__} {part!r}"
            )
    return parts


def why_nothing_found(
    parts: Sequence[nn.Module], *, attention: bool, router: bool, include: Selector | None
) -> str:
    """Why no target was found in ``parts``, with the fixes (for a log line)."""
    if not parts:
        return "no model parts were given"
    searched = ", ".join(model_label(p) for p in parts)
    asked = [w for w, on in (("attention", attention), ("MoE routers", router)) if on]
    if include is not None:
        asked.append(f"include={include!r}")
    if not asked:
        return f"in {searched}: attention=False, router=False and no include: nothing asked for"
    return (
        f"in {searched}, looking for {', '.join(asked)}; blocks are found in a ModuleList/"
        "ModuleDict of same-typed modules that each hold an attention module. Fixes: "
        "1. pass include= naming the modules to graph; 2. pass the model parts that hold "
        "the decoder layers"
    )
