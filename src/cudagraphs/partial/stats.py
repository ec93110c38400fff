"""The totals a :class:`~.manager.PartialCudaGraphManager` reports in ``stats()``:
graphs held, replays and fallbacks per reason, and the blocks skipped, narrowed or
turned off.

Separate from :mod:`.manager` because it is a pure function of the targets and blocks,
while the manager holds their life cycle (the keys are listed in its class docs).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..memory import MemoryAccount
from .entry import PartialGraphEntry
from .vocabulary import (
    MODEL_REFUSED,
    NARROWED,
    OFF,
    SCOPE_OF_KIND,
    SKIPPED,
    ModelScopeOff,
    NarrowedBlock,
    SkippedBlock,
)

__all__ = ["stats_of"]


def stats_of(
    entries: Sequence[PartialGraphEntry],
    skipped: Sequence[SkippedBlock],
    narrowed: Sequence[NarrowedBlock],
    disabled: bool | None,
    model_off: Sequence[ModelScopeOff] = (),
    released_bytes: int = 0,
) -> dict[str, int]:
    """Totals over ``entries``, the blocks and the parts not graphed whole (keys: see
    the manager's class docs); ``disabled`` is what the manager's first capture read
    (``None`` before it)."""
    graphs = sum(len(e.graphs()) for e in entries)
    out: dict[str, int] = {
        "captured": 0 if disabled else graphs,
        "disabled": int(bool(disabled)),
        "replayed": 0,
        "fallbacks": 0,
    }
    for entry in entries:
        for key, n in entry.counter.as_dict().items():
            out[key] = out.get(key, 0) + n
    reasons = [SKIPPED.key(b.reason) for b in skipped]
    reasons += [NARROWED.key(b.reason) for b in narrowed]
    reasons += [MODEL_REFUSED.key(p.reason) for p in model_off]
    reasons += [OFF.key(e.off_reason) for e in entries if e.off_reason is not None]
    for key in reasons:
        out[key] = out.get(key, 0) + 1
    _add_memory(out, entries)
    _add_accounts(out, entries, released_bytes)
    return out


def _add_memory(out: dict[str, int], entries: Sequence[PartialGraphEntry]) -> None:
    # The core's graphs say what their captures grew the device's reserved memory by
    # (new segments of the pool the targets share) and what static buffers were made
    # for them (shared ones counted once); other backends' say nothing.
    for entry in entries:
        for graph in entry.graphs():
            graphs = getattr(graph, "graphs", None)
            if graphs is None or getattr(graphs, "eager_only", True):
                continue
            scope = SCOPE_OF_KIND.get(entry.target.kind, entry.target.kind)
            for what in ("pool_bytes", "buffer_bytes"):
                for key in (what, f"{what}_{scope}"):
                    out[key] = out.get(key, 0) + getattr(graphs, what, 0)


def _add_accounts(
    out: dict[str, int], entries: Sequence[PartialGraphEntry], released_bytes: int
) -> None:
    # One cudagraphs.memory.MemoryAccount per make_graphed_callables call, shared by
    # the graphs it made: each counted once. released_bytes: what the manager's own
    # releases after its captures gave back.
    accounts = {}
    for entry in entries:
        for graph in entry.graphs():
            account = getattr(getattr(graph, "graphs", None), "memory", None)
            if account is not None:
                accounts[id(account)] = account
    if not accounts and not released_bytes:
        return
    total = sum(accounts.values(), MemoryAccount())
    for key, value in total.as_dict().items():
        out[key] = out.get(key, 0) + value
    out["released_bytes"] = out.get("released_bytes", 0) + released_bytes
