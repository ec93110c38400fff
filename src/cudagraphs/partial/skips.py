"""Why a discovered block yields no target: one :class:`SkippedBlock` per such block,
with a reason slug a program can count and a sentence a user can act on (what the
block holds, what was looked for, the fix).

Reasons:

- ``"no_graph_safe_scope"``: the block holds nothing of the kinds asked for (a Mamba
  or linear-attention layer without an MoE router; any block without a router when
  only routers are asked for).
- ``"nothing_asked"``: ``attention=False`` and ``router=False``, and ``include``
  names nothing in the block.

What this module does NOT do: it decides no target (:mod:`.discovery` does) and does
not log; the caller reports the records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .metadata import ClassSpec, ModelMetadata
from .tree import children

if TYPE_CHECKING:
    from .discovery import DiscoveredBlock

__all__ = ["SkipReason", "SkippedBlock", "skip_record"]

SkipReason = Literal["no_graph_safe_scope", "nothing_asked"]

_NOT_ATTENTION = (
    "no attention-like child (called with hidden_states plus an attention mask or "
    "positions, owning two or more projections)"
)
_NOT_ROUTER = "no MoE router (a gate or router with a 2-D weight beside experts)"


@dataclass(frozen=True)
class SkippedBlock:
    """A block that yields no target, and why (so that nothing is left out silently)."""

    name: str  # qualified block name
    block_type: str  # class name
    reason: SkipReason  # short slug, see the module docstring
    detail: str  # what was found, why it was skipped, the fix (include=)


def skip_record(
    block: DiscoveredBlock,
    *,
    attention: bool,
    router: bool,
    attention_anywhere: bool,
    example: str,
) -> SkippedBlock:
    """The record for ``block``, which yields no target.

    Args:
        block: the discovered block (borrowed).
        attention, router: what was asked for.
        attention_anywhere: whether any block of the same model part has attention
            (when none has, a declared attention class may have been replaced).
        example: a qualified module name to suggest for ``include=``.
    """
    block_type = type(block.module).__name__
    held = ", ".join(f"{n} ({type(m).__name__})" for n, m in children(block.module))
    head = f"{block_type} {block.name} holds {held or 'no submodules'}"
    if not (attention or router):
        return SkippedBlock(
            block.name,
            block_type,
            "nothing_asked",
            f"{head}; attention=False and router=False, and include names nothing in it. "
            "Fixes: 1. turn attention or router on; 2. name modules of it with include=",
        )
    missing = []
    if attention:
        missing.append(_missing_attention(block.metadata, attention_anywhere))
    if router:
        missing.append(_missing_router(block.metadata))
    # A piece found in a skipped block is one whose switch is off.
    left_out = [
        f"its {t.kind} {t.name} is left out ({t.kind}=False)"
        for t in (block.attention, block.router)
        if t is not None
    ]
    detail = "; ".join([head, "it has " + " and ".join(missing), *left_out])
    return SkippedBlock(
        block.name,
        block_type,
        "no_graph_safe_scope",
        f"{detail}. Fix: if one of its modules is graph-safe (no host sync, the same "
        f"shapes every step), name it with include=, e.g. include=['{example}']",
    )


def _labels(specs: tuple[ClassSpec, ...]) -> str:
    return " or ".join(spec.label() for spec in specs)


def _missing_attention(declared: ModelMetadata | None, anywhere: bool) -> str:
    if declared is None or not declared.attention:
        return _NOT_ATTENTION
    labels = _labels(declared.attention)
    text = f"no module of the attention class {labels} ({declared.owner} declares it)"
    if not anywhere:
        text += (
            " and no block of this model part holds one (if the attention modules were "
            "replaced by another class, name them with include=)"
        )
    return text


def _missing_router(declared: ModelMetadata | None) -> str:
    if declared is None or not declared.router:
        return _NOT_ROUTER
    return f"no router of the class {_labels(declared.router)} ({declared.owner} declares it)"
