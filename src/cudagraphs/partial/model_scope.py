"""The ``"model"`` scope: one graph for a whole model part, its layer graphs kept in
reserve.

Why a scope beyond the layers: graphs of whole layers leave the rest of the step eager:
the embedding, the attention mask and rotary tables, the final norm, the head, the loss,
and the host work of the model's own forward around its layers. On a launch-bound step
that rest is what remains of the host's time (measured by ``benchmarks/partial_train.py``,
rows ``partial_layers`` and ``partial_widest``), so only a graph of the part's whole
forward takes that ground.

When it is taken. At planning (:func:`model_scope_refusal`): the scope is asked for by
name (it is never a default: it graphs code outside the decoder layers, the caller's
forward included), no ``include`` names targets inside the part, the part has a forward
of its own (not a bare ``ModuleList``), and every block of the part is graph-safe
whole (its ``"layer"`` scope is taken, by the rules of :mod:`.scopes`). Under FSDP2 it
is refused: the layers' own unshard hooks would run inside the graph. At capture
(:func:`capture_model_first`): not under activation checkpointing (the recompute of the
layers' forwards is what checkpointing buys, and a graph holding every activation of
the part defeats it), the capture must succeed (a model whose forward syncs with the
host fails here), and every output of the forward must be a tensor or a plain Python
value: an object such as a ``DynamicCache`` would be handed back stale from the graph.
Each refusal is said at WARNING with the fix and counted in ``stats()``; the part is
then graphed layer by layer, as without the scope (at a later ``capture()``, one that
adds a variant, the layers an earlier graph of the part stood for are recorded afresh
at the next recorded step).

This module holds the rules; the phases apply them: :func:`~.planning.plan_targets`
asks :func:`model_scope_refusal`, the build asks :func:`fsdp_refusal`, and the capture
(:func:`~.graphing.capture_model_first`) asks :func:`opaque_outputs` and says the
refusals with :func:`refused_message`.

While the part's graph is live, the targets inside it are turned off
(``stats()['off_in_model_graph']``): the graph replays their work, and a call of the
part outside its contract runs the whole part eagerly. Its outputs reach the caller's
code (loss, logits), so each call hands back copies of them (one device copy per output
tensor), never the graph's static buffers that the next call overwrites.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..moe_kernels import GroupedMMProbe
from .scopes import scope_block
from .vocabulary import DiscoveredBlock, ModelScopeOff

__all__ = [
    "CHECKPOINT_REFUSAL",
    "fsdp_refusal",
    "model_scope_refusal",
    "opaque_output_fix",
    "opaque_outputs",
    "part_label",
    "refused_message",
]

# Plain values a graph may hand back as they were at capture: they cannot go stale.
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def part_label(part: nn.Module) -> str:
    """The part's name in logs and reports: its class name."""
    return type(part).__name__


def model_scope_refusal(
    part: nn.Module,
    blocks: Sequence[DiscoveredBlock],
    *,
    include_given: bool,
    probe: GroupedMMProbe,
) -> ModelScopeOff | None:
    """Why ``part`` cannot be one ``"model"`` target, or ``None`` when it can (the
    planning-time rules in the module docs; FSDP2 is checked where targets are built).
    Borrows everything."""
    label = part_label(part)
    if not blocks:
        return ModelScopeOff(
            label,
            "no_blocks",
            f"{label} holds no decoder blocks, so nothing says its forward is a model's. "
            "Fix: pass the model (or its decoder) as the model part.",
        )
    if include_given:
        return ModelScopeOff(
            label,
            "include",
            f"include= names targets inside {label}, which one graph of the whole part "
            "would contain. Fix: drop include= or the 'model' scope.",
        )
    if isinstance(part, (nn.ModuleList, nn.ModuleDict)):
        return ModelScopeOff(
            label,
            "no_forward",
            f"{label} is a container with no forward of its own (a pipeline stage as a "
            "list of layers). Fix: pass a module whose forward runs the layers.",
        )
    narrow = [
        b.name
        for b in blocks
        if scope_block(b, part, ("layer",), probe).choice.scopes != ("layer",)
    ]
    if narrow:
        return ModelScopeOff(
            label,
            "layers_not_whole",
            f"{len(narrow)} block(s) of {label} cannot be graphed whole ({', '.join(narrow)}; "
            "see the narrowed and skipped blocks for why), so neither can the part. Fix: "
            "make every layer graph-safe (experts_implementation='grouped_mm' for an MoE).",
        )
    return None


def fsdp_refusal(part: nn.Module) -> ModelScopeOff:
    """The refusal of a part under FSDP2."""
    label = part_label(part)
    return ModelScopeOff(
        label,
        "fsdp",
        f"{label} holds FSDP2 units, whose unshard hooks would run inside one graph of "
        "the whole part. Its layers are graphed instead (parameters copied in per call).",
    )


def opaque_outputs(graph: Any) -> list[str]:
    """Type names of the output leaves of ``graph`` (a core graphed callable) that are
    neither tensors nor plain values; empty for other callables."""
    graphs = getattr(graph, "graphs", None)
    leaves = getattr(graphs, "out_leaves", None) or ()
    return sorted({type(x).__name__ for x in leaves if not isinstance(x, (torch.Tensor, *_PLAIN))})


#: Why a whole part is not captured under activation checkpointing.
CHECKPOINT_REFUSAL = (
    "activation checkpointing is on: a graph of the whole part would hold every "
    "activation the recompute is there to drop. Its layers are graphed instead; turn "
    "checkpointing off to graph the part whole."
)


def opaque_output_fix(names: list[str]) -> str:
    """Why a part whose forward returns objects of the types ``names`` is not graphed
    whole, and the fix."""
    return (
        f"its forward returns {', '.join(names)} object(s), which a graph would hand back "
        "as they were at capture (stale). Fix: call the model with use_cache=False (or set "
        "model.config.use_cache = False for training), so that it returns tensors only."
    )


def refused_message(part: str, reason: str, why: str) -> str:
    """The WARNING said when the capture refuses to graph ``part`` whole for
    ``reason`` (an ``off_`` reason), ``why`` being what refused it."""
    return (
        f"partial graphs: {part} is not graphed whole (stats()['off_{reason}']): "
        f"{why.rstrip('.')}. The targets inside it are graphed instead where they are "
        "graph-safe (those an earlier graph of it stood for from the next recorded step on)."
    )
