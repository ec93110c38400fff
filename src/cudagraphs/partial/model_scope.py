"""The ``"model"`` scope: one graph for a whole model part, its layer graphs kept in
reserve.

Why a scope beyond the layers: graphs of whole layers leave the rest of the step eager:
the embedding, the attention mask and rotary tables, the final norm, the head, the loss,
and the host work of the model's own forward around its layers. On a launch-bound step
that rest is what remains of the host's time (measured in ``benchmarks/partial_train.py``,
rows ``partial_layers`` and ``partial_widest``; the README's partial-graphs section), so
only a graph of the part's whole forward takes that ground.

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

While the part's graph is live, the targets inside it are turned off
(``stats()['off_in_model_graph']``): the graph replays their work, and a call of the
part outside its contract runs the whole part eagerly. Its outputs reach the caller's
code (loss, logits), so each call hands back copies of them (one device copy per output
tensor), never the graph's static buffers that the next call overwrites.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import CudaGraphCaptureError, CudaGraphOutputError
from ..moe_kernels import GroupedMMProbe
from .contract import ContractSet
from .entry import PartialGraphEntry
from .recording import Call
from .scopes import scope_block
from .speed import turn_off_slower
from .vocabulary import MODEL_KIND, DiscoveredBlock, ModelScopeOff

__all__ = [
    "capture_model_first",
    "model_scope_refusal",
    "part_label",
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


def capture_model_first(
    todo: list[Call],
    entries: Sequence[PartialGraphEntry],
    capture: Callable[[list[Call]], list],
    *,
    activation_checkpointing: bool,
    logger: logging.Logger,
) -> list[Call]:
    """Capture the whole-part calls of ``todo`` first (through ``capture``, which
    graphs a list of calls and returns their speed verdicts), then turn off the
    targets inside each part graphed whole.

    A part refused here (activation checkpointing, a failed capture, an opaque output,
    a graph slower than eager: see the module docs and :mod:`.speed`) is turned off
    with the reason, said at WARNING, and its layers stay in the calls to capture.

    Returns:
        The calls left to capture, in ``todo``'s order.
    """
    whole = [call for call in todo if call[0].target.kind == MODEL_KIND]
    if not whole:
        return todo
    parts = list({id(entry): entry for entry, _ in whole}.values())  # in order, once each
    for entry in parts:
        calls = [call for call in whole if call[0] is entry]
        if activation_checkpointing:
            _refuse(entry, "model_activation_checkpointing", _CHECKPOINT_FIX, logger)
            continue
        try:
            # Judged before the layers are dropped: a part slower whole keeps them.
            turn_off_slower(capture(calls), logger)
        except (CudaGraphCaptureError, CudaGraphOutputError) as exc:
            _refuse(entry, "model_capture_failed", f"{type(exc).__name__}: {exc}", logger)
            continue
        opaque = sorted({name for g in entry.graphs() for name in opaque_outputs(g)})
        if opaque and entry.off_reason is None:
            _refuse(entry, "model_opaque_output", _opaque_fix(opaque), logger)
    inside: set[int] = set()
    for entry in parts:
        for other in _inner(entry, entries):
            if entry.off_reason is None and entry.graphs() and other.off_reason is None:
                other.turn_off("in_model_graph")
                inside.add(id(other))
            elif entry.off_reason is not None and other.off_reason == "in_model_graph":
                # Refused at a later capture (a new variant): the layers an earlier graph
                # of the part stood for are targets again, recorded afresh next time.
                other.off_reason = None
                other.variants = []
                other.contracts = ContractSet(other.contracts.max_variants)
    return [c for c in todo if c[0].target.kind != MODEL_KIND and id(c[0]) not in inside]


def _inner(entry: PartialGraphEntry, entries: Sequence[PartialGraphEntry]) -> list:
    modules = {id(m) for m in entry.target.module.modules()}
    return [o for o in entries if o is not entry and id(o.target.module) in modules]


_CHECKPOINT_FIX = (
    "activation checkpointing is on: a graph of the whole part would hold every "
    "activation the recompute is there to drop. Its layers are graphed instead; turn "
    "checkpointing off to graph the part whole."
)


def _opaque_fix(names: list[str]) -> str:
    return (
        f"its forward returns {', '.join(names)} object(s), which a graph would hand back "
        "as they were at capture (stale). Fix: call the model with use_cache=False (or set "
        "model.config.use_cache = False for training), so that it returns tensors only."
    )


def _refuse(entry: PartialGraphEntry, reason: str, why: str, logger: logging.Logger) -> None:
    entry.turn_off(reason)
    logger.warning(
        "partial graphs: %s is not graphed whole (stats()['off_%s']): %s. The targets "
        "inside it are graphed instead where they are graph-safe (those an earlier graph "
        "of it stood for from the next recorded step on).",
        entry.name,
        reason,
        why.rstrip("."),
    )
