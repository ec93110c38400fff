"""The words of partial graphs, imported by every phase and importing none of them.

* What is graphed: a :class:`Target` (one module, of a :data:`TargetKind`), per
  decoder layer at one of the :data:`SCOPES`, or a whole model part
  (:data:`MODEL_SCOPE`).
* What selection sees: the classes a model declares about its own layers
  (:class:`ClassSpec`, :class:`ModelMetadata`) and the blocks it finds
  (:class:`DiscoveredBlock`).
* What selection reports: blocks that yield no target (:class:`SkippedBlock`), blocks
  graphed narrower than asked (:class:`NarrowedBlock`), parts not graphed whole
  (:class:`ModelScopeOff`).
* Every reason the layer gives, each with what it means, in one registry per family
  (:data:`FALLBACK`, :data:`SKIPPED`, :data:`NARROWED`, :data:`MODEL_REFUSED`,
  :data:`OFF`): a reason ``r`` of a family is counted in ``stats()`` under
  ``family.key(r)`` (``"fallback_shape"``, ``"off_slower_than_eager"``).

The phases use these words in order: select (:mod:`.discovery`, :mod:`.scopes`,
:mod:`.planning`) -> record (:mod:`.recording`) -> capture (:mod:`.graphing`) ->
replay (:mod:`.replay`); :mod:`.manager` drives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

__all__ = [
    "CONTRACT_REASONS",
    "FALLBACK",
    "KIND_OF_SCOPE",
    "MODEL_KIND",
    "MODEL_REFUSED",
    "MODEL_SCOPE",
    "NARROWED",
    "OFF",
    "REASON_FAMILIES",
    "SCOPES",
    "SCOPE_OF_KIND",
    "SKIPPED",
    "ClassSpec",
    "DiscoveredBlock",
    "ModelMetadata",
    "ModelRefusal",
    "ModelScopeOff",
    "NarrowReason",
    "NarrowedBlock",
    "OffReason",
    "ReasonFamily",
    "Scope",
    "SkipReason",
    "SkippedBlock",
    "Source",
    "Target",
    "TargetKind",
]

# ---- what is graphed ------------------------------------------------------------------

#: How much of a decoder layer one graph covers, from the narrowest.
Scope = Literal["attention", "moe_router", "mlp", "moe", "layer"]
SCOPES: tuple[Scope, ...] = ("attention", "moe_router", "mlp", "moe", "layer")
#: The scope of a whole model part (embeddings, every layer, head and loss as its forward
#: runs them): wider than any layer, so never a default; see :mod:`.model_scope`.
MODEL_SCOPE: Literal["model"] = "model"

TargetKind = Literal["attention", "router", "custom", "layer", "moe", "mlp", "model"]
#: The target kind of a whole model part.
MODEL_KIND: Literal["model"] = "model"
#: The target kind of each scope: the router's kind is ``"router"``.
KIND_OF_SCOPE: dict[Scope, TargetKind] = {
    "attention": "attention",
    "moe_router": "router",
    "mlp": "mlp",
    "moe": "moe",
    "layer": "layer",
}
#: The name a target kind is reported under in ``stats()``: its scope, ``"include"``
#: for a module ``include=`` named.
SCOPE_OF_KIND: dict[str, str] = {"router": "moe_router", "custom": "include"}

#: What named a block: the model's own declarations, or the structural rules.
Source = Literal["metadata", "structure"]


@dataclass(frozen=True)
class Target:
    """One module to graph."""

    name: str  # qualified name in the model part, wrappers unwrapped ("" for the part)
    module: nn.Module = field(compare=False)
    kind: TargetKind
    block: str | None = None  # the block it belongs to, when discovered in one


# ---- what selection sees ----------------------------------------------------------------


@dataclass(frozen=True)
class ClassSpec:
    """One declared kind of module: instances of ``target_class``, or modules named by
    ``name_hint`` (a class name, or a suffix of the qualified module name: models
    write both, ``"LlamaAttention"`` and ``"self_attn"``), kept only where the
    qualified name holds ``.layer_name.`` when a layer name is given. GPT-2 needs the
    layer name: its self- and cross-attention are both ``GPT2Attention``, told apart
    as ``.attn`` and ``.crossattention``."""

    target_class: type | None
    layer_name: str | None = None
    name_hint: str | None = None

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether ``module``, at qualified name ``name``, is of this kind."""
        by_class = self.target_class is not None and isinstance(module, self.target_class)
        hint = self.name_hint
        by_name = hint is not None and (
            f".{name}".endswith(f".{hint}") or any(c.__name__ == hint for c in type(module).__mro__)
        )
        if not (by_class or by_name):
            return False
        if self.layer_name is None:
            return True
        # Dots on both sides: ".attn" must not match ".attn_norm" or ".c_attn".
        return f".{self.layer_name}." in f".{name}."

    def label(self) -> str:
        """The spec as a reader would name it (``GPT2Attention at .attn``)."""
        what = self.target_class.__name__ if self.target_class else repr(self.name_hint)
        return f"{what} at .{self.layer_name}" if self.layer_name else what


@dataclass(frozen=True)
class ModelMetadata:
    """The layer, attention and router classes one model declares about itself (read
    by :func:`~.metadata.read_metadata`)."""

    owner: str  # class name of the module that declared it (for messages)
    layer_classes: tuple[str, ...]
    attention: tuple[ClassSpec, ...]
    cross_attention: tuple[ClassSpec, ...]
    router: tuple[ClassSpec, ...]

    def is_layer(self, module: nn.Module) -> bool:
        """Whether ``module`` is a declared decoder layer. The whole MRO is compared:
        FSDP2's ``fully_shard`` swaps a module's class for a subclass named
        ``FSDP<name>``, and a user subclass of a layer is still that layer."""
        return any(cls.__name__ in self.layer_classes for cls in type(module).__mro__)

    def is_attention(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` is declared self-attention (cross-attention never is)."""
        if any(spec.matches(name, module) for spec in self.cross_attention):
            return False
        return any(spec.matches(name, module) for spec in self.attention)

    def is_router(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` is a declared MoE router."""
        return any(spec.matches(name, module) for spec in self.router)


@dataclass(frozen=True)
class DiscoveredBlock:
    """One transformer block and the graphable pieces found in it."""

    name: str
    module: nn.Module = field(compare=False)
    attention: Target | None
    router: Target | None
    moe: str | None  # qualified name of the MoE sublayer (the router's parent), if any
    source: Source = "structure"  # what named it a block, and the rule used inside it
    # The declaration in force (None for a structural block): skip reports name its classes.
    metadata: ModelMetadata | None = field(default=None, compare=False, repr=False)
    moe_module: nn.Module | None = field(default=None, compare=False, repr=False)
    mlp: Target | None = None  # the dense MLP sublayer, if any (kind "mlp")


# ---- every reason ---------------------------------------------------------------------


@dataclass(frozen=True)
class ReasonFamily:
    """The reasons of one kind, each with what it means, and the ``stats()`` key a
    reason is counted under (``key_prefix`` + its name)."""

    key_prefix: str
    counts: str  # what one count of a reason of this family is
    reasons: Mapping[str, str]  # name -> what it means

    def key(self, reason: str) -> str:
        """The ``stats()`` key of ``reason``."""
        return self.key_prefix + reason


#: The reasons a call of a graphed target ran eagerly instead of replaying. The first
#: twelve are the contract's (:class:`~.contract.CallContract`), most structural first:
#: the first difference found is the one reported.
FALLBACK = ReasonFamily(
    "fallback_",
    "a call that ran the module eagerly instead of replaying a graph",
    {
        "structure": "the argument structure differs: containers, keywords, which leaves "
        "are tensors",
        "tensor_type": "a tensor argument is of another tensor class",
        "device": "a tensor is on another device",
        "dtype": "a tensor has another dtype",
        "shape": "a tensor has another shape (another sequence length, say)",
        "stride": "a tensor has other strides (a transposed or sliced view)",
        "requires_grad": "a tensor's requires_grad differs",
        "alias": "which arguments are the same tensor object differs",
        "control": "a non-tensor argument (a flag, a number, a None) differs",
        "grad_mode": "grad mode differs (a call under torch.no_grad(), say)",
        "autocast": "the autocast state differs",
        "training": "the module's training flag differs (model.eval(), say)",
        "not_captured": "the call matches a variant recorded but not captured yet",
        "param_storage": "a parameter was replaced or re-allocated since capture (the graph "
        "reads parameters in place)",
        "unchained_input": "an input the graph reads in place from another target's output "
        "got another tensor (that target ran eagerly for the call, say)",
        "kept_output": "a whole model part's output that its last replay handed out is "
        "still referenced by a tensor this torch cannot move (a view or a .detach() of it)",
    },
)
#: The contract's reasons, in the order :meth:`~.contract.CallContract.match` ranks them.
CONTRACT_REASONS: tuple[str, ...] = tuple(FALLBACK.reasons)[:12]

SkipReason = Literal["no_graph_safe_scope", "nothing_asked"]
SKIPPED = ReasonFamily(
    "skipped_",
    "a discovered block that yields no target and runs eagerly",
    {
        "no_graph_safe_scope": "no scope asked for fits the block (a Mamba or "
        "linear-attention layer asked for attention alone, say)",
        "nothing_asked": "scopes=() and include= names nothing in the block",
    },
)

NarrowReason = Literal[
    "no_attention", "eager_experts", "unknown_experts", "host_grouped_mm", "router_logits"
]
NARROWED = ReasonFamily(
    "narrowed_",
    "a block graphed at narrower scopes than the widest asked for",
    {
        "no_attention": "the block has no attention module (a Mamba or linear-attention "
        "mixer keeps recurrent state), so it is not graphed whole",
        "eager_experts": "its experts run the 'eager' implementation: a Python loop with "
        "shapes read on the host",
        "unknown_experts": "its experts implementation is not stated, or not one known to "
        "keep static shapes (grouped_mm, batched_mm)",
        "host_grouped_mm": "its experts run 'grouped_mm', which torch runs for their dtype "
        "on this GPU with the expert offsets copied to the host",
        "router_logits": "the model collects its routers' logits (output_router_logits) "
        "with a forward hook on each router, which no replay of a graph around the router "
        "would run: the router is graphed alone, its hook outside the graph",
    },
)

ModelRefusal = Literal["no_blocks", "include", "layers_not_whole", "no_forward", "fsdp"]
MODEL_REFUSED = ReasonFamily(
    "model_refused_",
    "a model part not graphed whole, decided at planning (the 'model' scope asked for)",
    {
        "no_blocks": "the part holds no decoder blocks",
        "include": "include= names targets inside the part",
        "layers_not_whole": "a block of the part cannot be graphed whole",
        "no_forward": "the part is a container with no forward of its own",
        "fsdp": "the part holds FSDP2 units, whose unshard hooks would run inside the graph",
    },
)

OffReason = Literal[
    "slower_than_eager",
    "stateful_argument",
    "in_model_graph",
    "model_activation_checkpointing",
    "model_capture_failed",
    "model_opaque_output",
]
OFF = ReasonFamily(
    "off_",
    "a target turned off: it runs its own forward for good",
    {
        "slower_than_eager": "its graph was measured slower than its eager run",
        "stateful_argument": "it is called with an object holding tensors (a KV cache)",
        "in_model_graph": "it lies inside a model part graphed whole, whose graph does its work",
        "model_activation_checkpointing": "a whole part under activation checkpointing",
        "model_capture_failed": "the capture of a whole part failed",
        "model_opaque_output": "a whole part's forward returns objects a graph would hand "
        "back stale (a DynamicCache)",
    },
)

#: Every family, in the order ``stats()`` reports them.
REASON_FAMILIES: tuple[ReasonFamily, ...] = (FALLBACK, SKIPPED, NARROWED, MODEL_REFUSED, OFF)


# ---- what selection reports -------------------------------------------------------------


@dataclass(frozen=True)
class SkippedBlock:
    """A block that yields no target, and why (so that nothing is left out silently)."""

    name: str  # qualified block name
    block_type: str  # class name
    reason: SkipReason  # a name of SKIPPED
    detail: str  # what was found, why it was skipped, the fix (include=)


@dataclass(frozen=True)
class NarrowedBlock:
    """A block graphed at narrower scopes than the widest one asked for, and why."""

    name: str  # qualified block name
    block_type: str  # class name
    wanted: Scope  # the widest requested scope refused ("layer" or "moe")
    got: tuple[Scope, ...]  # the scopes taken instead: attention, then feed-forward (never ())
    reason: NarrowReason  # the first refusal (a name of NARROWED); the detail names every one
    detail: str  # what was refused, why, what was taken, the fixes


@dataclass(frozen=True)
class ModelScopeOff:
    """A model part not graphed whole at planning, and why."""

    part: str  # the part's class name
    reason: ModelRefusal  # a name of MODEL_REFUSED
    detail: str  # what refused it, and the fix
