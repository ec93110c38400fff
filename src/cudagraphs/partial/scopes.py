"""Scopes: how much of each decoder layer one graph covers, and the rules that say
which scopes are graph-safe in a given block.

The scopes (``SCOPES`` lists them from the narrowest; here the whole layer first):

- ``"layer"``: the whole decoder block.
- ``"moe"``: the whole MoE sublayer (router, experts, shared experts, combine).
- ``"attention"``: the attention module.
- ``"moe_router"``: the MoE router alone.
- ``"mlp"``: a dense MLP sublayer.

Beyond the layers, ``"model"`` (:data:`MODEL_SCOPE`, not in :data:`SCOPES`, asked for by
name) graphs a whole model part in one graph; :mod:`.model_scope` holds its rules.

Per block, :func:`choose_scopes` takes the widest requested scope that is graph-safe
and narrows otherwise. Two facts decide: whether the block has attention (a block
without one, a Mamba or linear-attention layer, is never graphed whole: its mixer
keeps recurrent state and picks kernels on the host), and whether its experts keep
static shapes, read from what the model says is in effect
(:func:`experts_implementation`, :func:`static_experts`), never from model names; for
``grouped_mm`` experts, also whether torch runs their dtype on this GPU without a host
sync (:mod:`cudagraphs.moe_kernels`: bfloat16 yes, float32 no on torch 2.11).

What this module does NOT do: it finds no blocks, attention, routers, MoE sublayers or
MLPs (:mod:`.discovery` does), builds no :class:`~.vocabulary.Target`, and does not
prove a scope graph-safe: the replay contract and the capture check each call.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import CudaGraphsTypeError, CudaGraphsValueError
from ..moe_kernels import (
    GroupedMMProbe,
    experts_implementation,
    experts_weight,
    static_experts,
)
from .vocabulary import MODEL_SCOPE, SCOPES, DiscoveredBlock, NarrowReason, Scope

__all__ = [
    "BlockOffer",
    "ScopeChoice",
    "ScopedBlock",
    "check_scopes",
    "choose_scopes",
    "requested_scopes",
    "scope_block",
]

_ACCEPTED: tuple[str, ...] = (*SCOPES, MODEL_SCOPE)


def check_scopes(value: Any) -> tuple[str, ...]:
    """``value`` as a tuple of scope names: :data:`SCOPES` and :data:`MODEL_SCOPE`
    (empty allowed: ``include`` alone).

    Raises:
        CudaGraphsTypeError: ``value`` is a string (one scope is written ``("layer",)``)
            or not a list / tuple, or ``scopes[i]`` is not a string.
        CudaGraphsValueError: ``scopes[i]`` is not one of :data:`SCOPES` or
            :data:`MODEL_SCOPE`, or repeats an earlier entry.
    """
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise CudaGraphsTypeError(
            f"scopes must be a list or tuple of scope names from {_ACCEPTED}, got "
            f"{type(value).__name__} {value!r}"
            + (f"; for one scope write ({value!r},)" if isinstance(value, str) else "")
        )
    first: dict[str, int] = {}
    for i, name in enumerate(value):
        if not isinstance(name, str):
            raise CudaGraphsTypeError(
                f"scopes[{i}] must be a scope name (str), got {type(name).__name__} {name!r}"
            )
        if name not in _ACCEPTED:
            close = difflib.get_close_matches(name, _ACCEPTED)  # best first
            raise CudaGraphsValueError(
                f"scopes[{i}] is {name!r}, not a scope"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; the scopes are {', '.join(_ACCEPTED)}"
            )
        if name in first:
            raise CudaGraphsValueError(
                f"scopes[{i}] repeats {name!r} (already scopes[{first[name]}]); name each "
                "scope once"
            )
        first[name] = i
    return tuple(value)


def requested_scopes(scopes: Any) -> tuple[str, ...]:
    """The scopes asked for: ``scopes`` checked (:func:`check_scopes`), or with
    ``None`` every one of :data:`SCOPES`, so that each layer is graphed as widely as is
    graph-safe. The one place the default is decided: :func:`~.planning.plan_targets`
    and the manager both plan through it."""
    return SCOPES if scopes is None else check_scopes(scopes)


@dataclass(frozen=True)
class BlockOffer:
    """What one block holds, as far as the scope rules care."""

    attention: bool  # an attention target (declared or structural)
    router: bool  # an MoE router
    moe: bool  # an MoE sublayer apart from the block (the router's parent is not the block)
    experts: str | None  # the experts implementation in effect, when there is a router
    mlp: bool  # a dense MLP sublayer
    # torch's grouped GEMM keeps the offsets on the device for the experts' dtype there
    # (see .kernels); read only for "grouped_mm" experts.
    grouped_on_device: bool = True
    # The model collects its routers' logits (config.output_router_logits, for the
    # load-balancing loss): transformers does that with a forward hook on each router,
    # which a replay of a graph around the router would never run.
    router_logits: bool = False


@dataclass(frozen=True)
class ScopeChoice:
    """The scopes taken in one block, and why a wider requested one was not."""

    scopes: tuple[Scope, ...]  # taken: layer alone, or attention then feed-forward; may be ()
    wanted: Scope | None = None  # the widest requested scope refused, if any
    reasons: tuple[NarrowReason, ...] = ()  # why, in the order the rules refused


def choose_scopes(offer: BlockOffer, requested: Collection[str]) -> ScopeChoice:
    """The widest graph-safe scopes of ``requested`` for a block holding ``offer``.

    ``layer`` when the block has attention and its experts, if any, are static
    (``grouped_mm`` ones only where torch keeps their offsets on the device:
    ``offer.grouped_on_device``; else the reason is ``"host_grouped_mm"``). Otherwise ``attention`` beside, for the feed-forward: ``moe`` when the experts are
    static, else ``moe_router``; and ``mlp`` for a dense MLP. Only requested scopes are
    taken: asking for ``("layer",)`` alone never yields ``attention``. A refusal of
    ``layer`` or ``moe`` (whose block holds an MoE) is a narrowing, with its reasons;
    a block simply lacking a piece (no MoE, no MLP) is not.
    """
    layer_refused = _layer_refusal(offer)
    if "layer" in requested and layer_refused is None:
        return ScopeChoice(("layer",))
    # Read only where the block holds an MoE sublayer, which has a router.
    experts_refused = _experts_refusal(offer)
    taken: list[Scope] = []
    if "attention" in requested and offer.attention:
        taken.append("attention")
    if "moe" in requested and offer.moe and experts_refused is None:
        taken.append("moe")
    elif "moe_router" in requested and offer.router:
        taken.append("moe_router")
    if "mlp" in requested and offer.mlp:
        taken.append("mlp")
    reasons: list[NarrowReason] = []
    if "layer" in requested and layer_refused is not None:
        reasons.append(layer_refused)
    if "moe" in requested and offer.moe and experts_refused not in (None, *reasons):
        reasons.append(experts_refused)
    wanted: Scope | None = None
    if reasons:
        wanted = "layer" if "layer" in requested else "moe"
    return ScopeChoice(tuple(taken), wanted, tuple(reasons))


def _layer_refusal(offer: BlockOffer) -> NarrowReason | None:
    if not offer.attention:
        return "no_attention"
    return _experts_refusal(offer) if offer.router else None


def _experts_refusal(offer: BlockOffer) -> NarrowReason | None:
    if offer.router and offer.router_logits:
        # The router graphed alone (moe_router) keeps its hook outside the graph: it
        # runs in the router's own call, around the replay.
        return "router_logits"
    if offer.experts == "grouped_mm" and not offer.grouped_on_device:
        return "host_grouped_mm"
    if static_experts(offer.experts):
        return None
    return "eager_experts" if offer.experts == "eager" else "unknown_experts"


@dataclass(frozen=True)
class ScopedBlock:
    """One block's offer, the scopes chosen in it, and the module each one names."""

    offer: BlockOffer
    choice: ScopeChoice
    pieces: tuple[tuple[str, nn.Module, Scope], ...]  # (qualified name, module, scope)


def scope_block(
    block: DiscoveredBlock,
    model: nn.Module,
    requested: Collection[str],
    probe: GroupedMMProbe | None = None,
) -> ScopedBlock:
    """Apply :func:`choose_scopes` to ``block`` (found in ``model``), naming the module
    of each chosen scope. ``probe`` answers, for ``grouped_mm`` experts, whether torch
    runs their dtype on the device without a host sync (a fresh one when ``None``;
    pass one per discovery pass to ask torch once). Borrows everything; modifies
    nothing."""
    moe_at = (block.moe, block.moe_module) if block.moe is not None else None
    mlp = (block.mlp.name, block.mlp.module) if block.mlp is not None else None
    experts = experts_implementation(moe_at[1], model) if moe_at is not None else None
    grouped_on_device = True
    if experts == "grouped_mm" and moe_at is not None:
        grouped_on_device = (probe or GroupedMMProbe()).on_device(experts_weight(moe_at[1]))
    offer = BlockOffer(
        attention=block.attention is not None,
        router=block.router is not None,
        moe=moe_at is not None and moe_at[0] != block.name,
        experts=experts,
        mlp=mlp is not None,
        grouped_on_device=grouped_on_device,
        router_logits=block.router is not None and collects_router_logits(model),
    )
    choice = choose_scopes(offer, requested)
    where: dict[str, tuple[str, nn.Module] | None] = {
        "layer": (block.name, block.module),
        "attention": (block.attention.name, block.attention.module) if block.attention else None,
        "moe_router": (block.router.name, block.router.module) if block.router else None,
        "moe": moe_at,
        "mlp": mlp,
    }
    pieces = []
    for scope in choice.scopes:
        hit = where[scope]
        assert hit is not None, f"scope {scope} chosen in {block.name} without its module"
        pieces.append((hit[0], hit[1], scope))
    return ScopedBlock(offer, choice, tuple(pieces))


def collects_router_logits(model: nn.Module) -> bool:
    """Whether the model's config asks for its routers' logits on every forward
    (``output_router_logits``, which MoE training sets for the load-balancing loss).
    A call that passes ``output_router_logits=True`` itself is not seen here."""
    return bool(getattr(getattr(model, "config", None), "output_router_logits", False))
