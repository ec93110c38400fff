"""Discovery, the first step of the select phase: the transformer blocks of a training
model and the pieces of each (attention, MoE router, MoE sublayer, dense MLP), from
the model's own metadata where it declares some, from its structure otherwise.

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
3. The dense MLP, under either rule, by structure (no metadata declares one): a direct
   child, not the attention, the MoE sublayer or a norm, owning two or more
   projections and called with one tensor (:func:`find_mlp`).

What a manager graphs is decided from these blocks by :mod:`.planning`
(:func:`~.planning.plan_targets`): by default, per block, the widest scope the rules
of :mod:`.scopes` find graph-safe (the whole layer where it can be), plus what
``include`` names; each skipped or narrowed block is reported with the reason and the
fix.

What this module does NOT do: it does not choose targets (:mod:`.planning` does); it
does not tell encoder layers from decoder layers (no metadata does: a T5 encoder's
self-attention is a target like its decoder's); beneath a declaration it does not look for structural
stacks the declaration leaves out (``include`` names those); and it does not judge
whether a module is graph-safe (host syncs, data-dependent shapes): the replay
contract and the capture do.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection

import torch
from torch import nn

from .metadata import first_declared, read_metadata
from .tree import children as _children
from .tree import forward_parameters, names_overlap
from .tree import join_name as _join
from .tree import named_modules as _named_modules
from .vocabulary import DiscoveredBlock, ModelMetadata, Source, Target

__all__ = [
    "discover_blocks",
    "find_attention",
    "find_mlp",
    "find_moe",
    "is_attention",
]

logger = logging.getLogger(__name__)

_ROUTER_NAMES = ("gate", "router")  # the router child of an MoE sublayer
_EXPERT_NAMES = ("experts",)
# torch's own norms. transformers' RMSNorm classes are not among them; they hold only a
# 1-D weight, so the two-projection rule of find_mlp leaves them out.
_NORMS: tuple[type, ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


def is_attention(module: nn.Module) -> bool:
    """Whether ``module`` is called and built like attention: called with hidden states
    (``hidden_states`` or ``x``) and an attention mask or positions, owning at least
    two ``nn.Linear`` projections."""
    params = {p.name for p in forward_parameters(module)}
    takes_hidden = "hidden_states" in params or "x" in params
    takes_context = bool({"attention_mask", "position_embeddings", "position_ids"} & params)
    projections = sum(isinstance(m, nn.Linear) for m in module.modules())
    return takes_hidden and takes_context and projections >= 2


def find_attention(block: nn.Module, prefix: str = "") -> tuple[str, nn.Module] | None:
    """The block's whole attention module: a direct child called with hidden states
    and an attention mask or position embeddings, owning at least two projections."""
    found = [(n, m) for n, m in _children(block) if is_attention(m)]
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


def _one_tensor_argument(module: nn.Module) -> bool:
    # Exactly one parameter and no *args / **kwargs: a Mamba or linear-attention mixer
    # (hidden_states plus cache / mask, often **kwargs) is not a dense MLP.
    params = forward_parameters(module)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 1 and params[0].kind in positional


def _projections(module: nn.Module) -> int:
    # A 2-D weight: nn.Linear and GPT-2's Conv1D (weight stored transposed) alike.
    count = 0
    for m in module.modules():
        weight = getattr(m, "weight", None)
        count += isinstance(weight, torch.Tensor) and weight.dim() == 2
    return count


def find_mlp(
    block: nn.Module, prefix: str = "", *, taken: Collection[str] = ()
) -> tuple[str, nn.Module] | None:
    """The block's dense MLP sublayer: a direct child that neither is nor holds nor lies
    in a module named in ``taken`` (the attention and the MoE sublayer), is not a torch
    norm, owns two or more projections (modules with a 2-D weight) and whose forward
    takes one tensor argument. The first in module order when several qualify (logged
    at DEBUG). No metadata declares MLPs: this rule is structural only."""
    found = []
    for child_name, child in _children(block):
        name = _join(prefix, child_name)
        if any(names_overlap(name, t) for t in taken) or isinstance(child, _NORMS):
            continue
        if _projections(child) >= 2 and _one_tensor_argument(child):
            found.append((name, child))
    if len(found) > 1:
        logger.debug(
            "block %s has several MLP-like children %s; taking the first",
            prefix,
            [n for n, _ in found],
        )
    return found[0] if found else None


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
    # The MLP is found by structure alone (no metadata declares one), beside the
    # attention and the MoE sublayer.
    taken = [n for n in (moe[0] if moe else None, attn[0] if attn else None) if n is not None]
    mlp = find_mlp(block, name, taken=taken)
    return DiscoveredBlock(
        name=name,
        module=block,
        attention=Target(attn[0], attn[1], "attention", name) if attn else None,
        router=Target(moe[2], moe[3], "router", name) if moe else None,
        moe=moe[0] if moe else None,
        source=source,
        metadata=declared,
        moe_module=moe[1] if moe else None,
        mlp=Target(mlp[0], mlp[1], "mlp", name) if mlp else None,
    )
