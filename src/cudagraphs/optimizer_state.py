"""An optimizer's state packed into one buffer per dtype before a capture: by partial
graphs (the optimizers that stepped while recording), ``graph_train_step`` (its own)
and ``make_graphed_callables`` / ``graph_stack`` (``optimizers=``). The core and
``graph_train_step`` pack inside :meth:`~cudagraphs.memory.MemoryMeter.start`, after
its release and before the eager cuBLAS workspaces are made again: a workspace made
first would fill a hole between state tensors and pin that segment.

Why: an optimizer makes its state lazily, at its first step, in the holes that the
step's activations left in the caching allocator's segments. Once the activations of
the graphed layers live in the graphs' pools, those segments hold little but the
state, and a segment (or, in an expandable one, a 20 MiB page) goes back to the driver
only when all of it is free: the release after a capture
(:func:`~cudagraphs.memory.release_unused_cache`) cannot give back the holes between
state tensors, and the eager steps that follow grow new segments beside them.
:func:`compact_fragmented` packs the state held in such segments (and nothing else
pins) into new buffers, one per dtype, and gives the segments back, in batches that
never raise the process's peak of reserved memory. State in segments it fills (large
tensors, each in a segment of its own size) stays where it is.

What moves: a state tensor of a plain ``torch.Tensor`` type on the device, contiguous,
not requiring grad, alone on a storage it fills whole, which nothing but the optimizer
refers to (its storage's use count says so). Each keeps its identity: it is pointed at
its place in the new buffer with ``Tensor.set_``, so the optimizer's ``state``, its
``state_dict()`` and its next steps read the same values at the new address. Places
are 512-byte aligned, as the caching allocator's blocks are, so fused and ``foreach``
kernels keep their vectorized paths. An optimizer whose parameter groups say
``capturable=True`` is left alone: its step may sit inside a graph that holds the old
addresses. ``CUDAGRAPHS_COMPACT_STATE=0`` turns packing off.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .memory import KEEP_CACHE_ENV, release_unused_cache
from .settings import compact_state, env_flag
from .torch_private import can_count_storage_uses, storage_object_uses, storage_use_count

__all__ = [
    "SteppedOptimizers",
    "buffer_bytes",
    "compact_fragmented",
    "compact_before_capture",
    "compact_optimizer_state",
    "freeable_segments",
    "movable_state",
    "optimizers_of",
    "pack",
]

logger = logging.getLogger(__name__)

#: The caching allocator's block granularity: each packed tensor starts on it.
ALIGN_BYTES = 512
#: The least unused memory a segment must hold to be worth packing: the caching
#: allocator rounds large blocks to 2 MiB, so an exact-size segment never does.
MIN_GAIN_BYTES = 2 << 20


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for entry in optimizer.state.values():
        if isinstance(entry, dict):
            out.extend(v for v in entry.values() if isinstance(v, torch.Tensor))
    return out


def _capturable(optimizer: torch.optim.Optimizer) -> bool:
    return any(bool(g.get("capturable", False)) for g in optimizer.param_groups)


def movable_state(
    optimizer: torch.optim.Optimizer,
    device: torch.device | str | int,
    *,
    in_no_graph: bool = False,
) -> list[torch.Tensor]:
    """The state tensors of ``optimizer`` on ``device`` that :func:`compact_optimizer_state`
    may move (module docs: which), each once, in the optimizer's state order.
    ``in_no_graph``: the caller knows no graph holds the state's addresses, so a
    ``capturable=True`` optimizer's state may move too."""
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if (_capturable(optimizer) and not in_no_graph) or not can_count_storage_uses():
        return []
    tensors = _state_tensors(optimizer)
    per_storage: dict[int, int] = {}
    for t in tensors:
        if t.untyped_storage().nbytes():
            key = t.untyped_storage().data_ptr()
            per_storage[key] = per_storage.get(key, 0) + 1
    # A storage object counts itself once (its Python object holds the C++ storage).
    own = storage_object_uses()
    out, seen = [], set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        if not (
            type(t) is torch.Tensor
            and t.device == device
            and not t.requires_grad
            and t.is_contiguous()
            and t.storage_offset() == 0
            and storage.nbytes() > 0
            and storage.nbytes() == t.numel() * t.element_size()
            and per_storage.get(storage.data_ptr()) == 1
            # Only this tensor holds the storage: no view or alias kept elsewhere.
            and storage_use_count(storage) == 1 + own
        ):
            continue
        out.append(t)
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def buffer_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """What :func:`pack` of ``tensors`` may grow the caching allocator by at most: per
    dtype, the aligned sizes summed, rounded up to the allocator's 2 MiB for large
    blocks."""
    per_dtype: dict[torch.dtype, int] = {}
    for t in tensors:
        per_dtype[t.dtype] = per_dtype.get(t.dtype, 0) + _aligned(t.numel() * t.element_size())
    return sum(-(-n // MIN_GAIN_BYTES) * MIN_GAIN_BYTES for n in per_dtype.values())


def pack(tensors: Sequence[torch.Tensor]) -> int:
    """Move ``tensors`` (each alone on a storage it fills, as :func:`movable_state`
    gives them) into one new buffer per dtype, each keeping its identity and values;
    return the bytes moved. Their old blocks are freed when this returns. Values are
    copied exactly, on the current stream."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    moved = 0
    with torch.no_grad():
        for dtype, group in groups.items():
            size = torch.empty((), dtype=dtype).element_size()
            if ALIGN_BYTES % size:
                continue
            offsets, total = [], 0
            for t in group:
                offsets.append(total // size)
                total += _aligned(t.numel() * size)
            flat = torch.empty(total // size, dtype=dtype, device=group[0].device)
            for t, offset in zip(group, offsets):
                flat.narrow(0, offset, t.numel()).copy_(t.reshape(-1))
            storage = flat.untyped_storage()
            for t, offset in zip(group, offsets):
                t.set_(storage, offset, t.size(), t.stride())
                moved += t.numel() * size
    return moved


def compact_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device | str | int
) -> int:
    """:func:`pack` all of the movable state of ``optimizer`` on ``device``
    (:func:`movable_state`), wherever it lies; return the bytes moved."""
    return pack(movable_state(optimizer, device))


def freeable_segments(
    segments: Sequence[dict], movable: Mapping[int, int], min_gain: int = MIN_GAIN_BYTES
) -> list[tuple[int, list[int]]]:
    """Which segments packing frees, from ``torch.cuda.memory_snapshot()``'s
    ``segments`` of the general pool and ``movable`` (data pointer -> bytes of each
    movable state tensor): those whose live blocks all start at a movable tensor
    (nothing else pins them) and that hold at least ``min_gain`` bytes unused (packing
    a full segment gains nothing; an exact-size segment's rounding is under 2 MiB).
    Each as ``(unused bytes, [data pointers])``, the largest gain first. A block's
    address is its segment's plus the sizes of the blocks before it."""
    out = []
    for seg in segments:
        if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0):
            continue
        addr, ptrs, pinned, live = int(seg["address"]), [], False, 0
        for block in seg.get("blocks", ()):
            size = int(block["size"])
            if block.get("state") == "active_allocated":
                live += size
                if addr in movable:
                    ptrs.append(addr)
                else:
                    pinned = True
            addr += size
        unused = int(seg["total_size"]) - live
        if ptrs and not pinned and unused >= min_gain:
            out.append((unused, ptrs))
    out.sort(key=lambda row: -row[0])
    return out


@dataclass
class SteppedOptimizers:
    """The optimizers whose ``step()`` ran between :meth:`enter` and :meth:`leave`
    (both idempotent), seen through torch's global optimizer step hook and held
    weakly: the optimizers of a recording step, whose state a capture packs."""

    seen: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    handle: torch.utils.hooks.RemovableHandle | None = None

    def enter(self) -> None:
        if self.handle is None:
            self.handle = register_optimizer_step_post_hook(self._saw)

    def _saw(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.seen.add(optimizer)

    def leave(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.seen)


def optimizers_of(
    optimizers: Iterable[torch.optim.Optimizer], params: Iterable[torch.Tensor]
) -> list[torch.optim.Optimizer]:
    """Those of ``optimizers`` that update at least one of ``params``: a manager packs
    the state of its own model's optimizers only."""
    wanted = {id(p) for p in params}
    return [
        o for o in optimizers if any(id(p) in wanted for g in o.param_groups for p in g["params"])
    ]


def compact_fragmented(
    optimizers: Iterable[torch.optim.Optimizer],
    device: int,
    what: str,
    *,
    in_no_graph: bool = False,
) -> tuple[int, int]:
    """Pack the movable state of ``optimizers`` on CUDA ``device`` that lies in
    segments packing frees (:func:`freeable_segments`), and give those segments back
    (:func:`~cudagraphs.memory.release_unused_cache`, logged with ``what``); return the
    bytes moved (logged at INFO) and the bytes given back.

    Packing never raises the process's peak of reserved memory: the new buffers are
    made in batches of segments whose state fits under that peak
    (``max_memory_reserved() - memory_reserved()``), each batch's old segments given
    back before the next; a segment whose state does not fit is left as it is.
    ``in_no_graph``: as :func:`movable_state` takes it."""
    seen: dict[int, torch.Tensor] = {}
    for o in optimizers:
        for t in movable_state(o, device, in_no_graph=in_no_graph):
            seen[t.data_ptr()] = t
    if not seen:
        return 0, 0
    torch.cuda.synchronize(device)
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device") == device]
    movable = {ptr: t.untyped_storage().nbytes() for ptr, t in seen.items()}
    plan = freeable_segments(segments, movable)
    moved = released = 0
    batch: list[torch.Tensor] = []
    for _, ptrs in plan:
        tensors = [seen[p] for p in ptrs]
        room = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
        if batch and buffer_bytes([*batch, *tensors]) > room:
            moved += pack(batch)
            released += release_unused_cache(device, what)
            batch = []
            room = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
        if buffer_bytes(tensors) <= room:
            batch.extend(tensors)
    if batch:
        moved += pack(batch)
        released += release_unused_cache(device, what)
    if moved:
        logger.info(
            "%s: packed %.0f MiB of optimizer state out of %d fragmented segments "
            "(CUDAGRAPHS_COMPACT_STATE=0 leaves it in place)",
            what,
            moved / (1 << 20),
            len(plan),
        )
    return moved, released


def compact_before_capture(
    optimizers: Sequence[torch.optim.Optimizer],
    device: int,
    what: str,
    *,
    in_no_graph: bool = False,
) -> tuple[int, int]:
    """:func:`compact_fragmented` for a capture that is about to start, right after the
    release of the unused cache, unless ``CUDAGRAPHS_KEEP_CACHE=1`` or
    ``CUDAGRAPHS_COMPACT_STATE=0``; returns the bytes moved and given back. Only state
    no graph holds moves (:func:`movable_state`; ``in_no_graph`` as it takes it)."""
    if not optimizers or env_flag(KEEP_CACHE_ENV) or not compact_state():
        return 0, 0
    return compact_fragmented(optimizers, device, what, in_no_graph=in_no_graph)
