"""The totals a :class:`~.manager.PartialCudaGraphManager` reports in ``stats()``: a
pure function of its targets (their dispatchers' counters and their recordings'
graphs) and of the blocks and parts planning reported. Graphs held, replays and
fallbacks per reason, the blocks skipped or narrowed, the parts not graphed whole, the
targets turned off (each reason keyed as :data:`~.vocabulary.REASON_FAMILIES` say),
and the memory and set-up time the graphs account for.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..memory import MemoryAccount
from .recording import TargetRecording
from .replay import TargetDispatcher
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
    dispatchers: Sequence[TargetDispatcher],
    skipped: Sequence[SkippedBlock],
    narrowed: Sequence[NarrowedBlock],
    disabled: bool | None,
    model_off: Sequence[ModelScopeOff] = (),
    released_bytes: int = 0,
    compacted_bytes: int = 0,
) -> dict[str, int]:
    """Totals over the targets of ``dispatchers``, the blocks and the parts not graphed
    whole (keys: see the manager's class docs); ``disabled`` is what the manager's
    first capture read (``None`` before it)."""
    recordings = [d.recording for d in dispatchers]
    graphs = sum(len(r.graphs()) for r in recordings)
    out: dict[str, int] = {
        "captured": 0 if disabled else graphs,
        "disabled": int(bool(disabled)),
        "replayed": 0,
        "fallbacks": 0,
    }
    for d in dispatchers:
        for key, n in d.counter.as_dict().items():
            out[key] = out.get(key, 0) + n
    reasons = [SKIPPED.key(b.reason) for b in skipped]
    reasons += [NARROWED.key(b.reason) for b in narrowed]
    reasons += [MODEL_REFUSED.key(p.reason) for p in model_off]
    reasons += [OFF.key(r.off_reason) for r in recordings if r.off_reason is not None]
    for key in reasons:
        out[key] = out.get(key, 0) + 1
    _add_memory(out, recordings)
    _add_accounts(out, recordings, released_bytes)
    _add_setup(out, recordings)
    if compacted_bytes:
        out["compacted_state_bytes"] = compacted_bytes
    return out


def _add_memory(out: dict[str, int], recordings: Sequence[TargetRecording]) -> None:
    # The core's graphs say what their captures grew the device's reserved memory by
    # (new segments of the pool the targets share) and what static buffers were made
    # for them (shared ones counted once); other backends' say nothing.
    for rec in recordings:
        for graph in rec.graphs():
            graphs = getattr(graph, "graphs", None)
            if graphs is None or getattr(graphs, "eager_only", True):
                continue
            scope = SCOPE_OF_KIND.get(rec.target.kind, rec.target.kind)
            for what in ("pool_bytes", "buffer_bytes"):
                for key in (what, f"{what}_{scope}"):
                    out[key] = out.get(key, 0) + getattr(graphs, what, 0)


def _per_capture_call(recordings: Sequence[TargetRecording], attr: str) -> list:
    # What a core make_graphed_callables call shares among the graphs it made (their
    # EntryGraphs' ``attr``), each object once; other backends' graphs have none.
    found = {}
    for rec in recordings:
        for graph in rec.graphs():
            value = getattr(getattr(graph, "graphs", None), attr, None)
            if value is not None:
                found[id(value)] = value
    return list(found.values())


def _add_accounts(
    out: dict[str, int], recordings: Sequence[TargetRecording], released_bytes: int
) -> None:
    # One cudagraphs.memory.MemoryAccount per make_graphed_callables call.
    # released_bytes: what the manager's own releases after its captures gave back.
    accounts = _per_capture_call(recordings, "memory")
    if not accounts and not released_bytes:
        return
    total = sum(accounts, MemoryAccount())
    for key, value in total.as_dict().items():
        out[key] = out.get(key, 0) + value
    out["released_bytes"] = out.get("released_bytes", 0) + released_bytes


def _add_setup(out: dict[str, int], recordings: Sequence[TargetRecording]) -> None:
    # One cudagraphs.core.runtime.SetupSeconds per make_graphed_callables call, summed
    # in whole milliseconds (the stats are integers). compile_ms is the part of
    # warmup_ms that torch.compile spent compiling, so a compiled target's set-up reads
    # apart from its capture.
    kept = _per_capture_call(recordings, "setup")
    if not kept:
        return
    out["warmup_ms"] = round(1000 * sum(s.warmup for s in kept))
    out["compile_ms"] = round(1000 * sum(s.compile for s in kept))
    out["capture_ms"] = round(1000 * sum(s.capture for s in kept))
    out["compiled_frames"] = sum(s.compiled_frames for s in kept)
