"""Where a capture's device memory goes, and giving back what it leaves unused.

A graphed layer can hold device memory in three places beyond its tensors:

* its graph pools' segments: what the graphs write (outputs, gradients, temporaries),
  the static buffers allocated during capture, and what a warmup run inside the pool
  kept (optimizer state, the capture stream's cuBLAS workspace);
* blocks the caching allocator keeps cached *outside* the pools that no tensor uses:
  a warmup that ran outside its pool, or eager steps run before the capture with a
  larger working set than the graphed steps leave to eager code. torch reuses a
  cached block only for the pool and stream it was freed in, so these stay reserved
  until ``torch.cuda.empty_cache()`` (or an out-of-memory retry) gives them back;
* memory the driver takes outside torch's allocator: each instantiated graph's
  executable, and library handles made during warmup.

:class:`MemoryMeter` measures all three across one capture phase into a
:class:`MemoryAccount`, which every layer's stats carry and ``python -m cudagraphs``
prints. :func:`release_unused_cache` gives cached-but-unused blocks back; it never
touches a live tensor, and what it costs is said where a layer calls it (the next
eager allocations come from the driver again: ``docs/memory.md`` has the measured
time). ``CUDAGRAPHS_KEEP_CACHE=1`` turns every release off.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from .settings import env_flag, expandable_recording
from .torch_private import expandable_segments

__all__ = [
    "KEEP_CACHE_ENV",
    "MemoryAccount",
    "MemoryMeter",
    "RecordingSegments",
    "place_cublas_workspaces",
    "pool_usage",
    "release_unused_cache",
    "tensor_bytes",
]

logger = logging.getLogger(__name__)

KEEP_CACHE_ENV = "CUDAGRAPHS_KEEP_CACHE"
_MIB = 1 << 20


@dataclass(frozen=True)
class MemoryAccount:
    """Device memory of one capture phase, in bytes.

    Attributes:
        pool_reserved_bytes: segments of the layer's graph pools after the phase.
        pool_allocated_bytes: of those, bytes in blocks in use now (graph outputs,
            gradients, static buffers and state made inside the pool); the rest is
            the graphs' temporaries, free between replays but kept for them.
        unused_cache_bytes: reserved outside the pools and used by no tensor, after
            the phase and before any release.
        released_bytes: given back to the driver by :func:`release_unused_cache`
            before the warmup and at the end of the phase (0 when nothing was
            released).
        driver_bytes: device memory taken during the phase outside torch's
            allocator: graph executables, library handles. Measured as the drop in
            the device's free memory minus the growth of torch's reserved memory, so
            another process allocating at the same time would show here too.
        static_bytes: the static input and output buffers the graphs own for good
            (forward inputs and outputs, incoming gradients, input gradients; each
            storage once): memory an eager run of the same work holds only while a
            step uses it. Parameter gradients are not counted: eager holds them too.
    """

    pool_reserved_bytes: int = 0
    pool_allocated_bytes: int = 0
    unused_cache_bytes: int = 0
    released_bytes: int = 0
    driver_bytes: int = 0
    static_bytes: int = 0

    def __add__(self, other: MemoryAccount) -> MemoryAccount:
        return MemoryAccount(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, ...]:
        return (
            self.pool_reserved_bytes,
            self.pool_allocated_bytes,
            self.unused_cache_bytes,
            self.released_bytes,
            self.driver_bytes,
            self.static_bytes,
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def summary(self) -> str:
        """One line in MiB, for logs and ``python -m cudagraphs``."""
        return (
            f"pool {self.pool_reserved_bytes / _MIB:.0f} MiB "
            f"({self.pool_allocated_bytes / _MIB:.0f} in use), "
            f"unused cache {self.unused_cache_bytes / _MIB:.0f} MiB "
            f"(released {self.released_bytes / _MIB:.0f}), "
            f"driver {self.driver_bytes / _MIB:.0f} MiB, "
            f"static buffers {self.static_bytes / _MIB:.0f} MiB"
        )


def pool_usage(handles: Iterable[tuple[int, int]], device: int) -> tuple[int, int]:
    """``(reserved, allocated)`` bytes of the segments in the private pools
    ``handles`` on ``device``, from the caching allocator's snapshot."""
    wanted = {tuple(h) for h in handles}
    reserved = allocated = 0
    if not wanted:
        return 0, 0
    for segment in torch.cuda.memory_snapshot():
        if (
            segment.get("device") != device
            or tuple(segment.get("segment_pool_id", ())) not in wanted
        ):
            continue
        reserved += int(segment["total_size"])
        allocated += int(segment["allocated_size"])
    return reserved, allocated


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped): a buffer
    that several tensors view, or that two graphs share, counts once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def release_unused_cache(device: torch.device | int, what: str) -> int:
    """Give the device memory cached outside tensors back to the driver
    (``torch.cuda.empty_cache()``), unless ``CUDAGRAPHS_KEEP_CACHE`` is set; returns
    the bytes given back. Live tensors and the graphs' pools keep every byte they
    use; the next eager allocations that would have reused a cached block ask the
    driver again instead (once). Logged at INFO with ``what``."""
    if env_flag(KEEP_CACHE_ENV):
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    released = max(0, before - torch.cuda.memory_reserved(device))
    if released:
        logger.info(
            "%s: gave %.0f MiB of unused cached memory back to the driver (%s=1 keeps it)",
            what,
            released / _MIB,
            KEEP_CACHE_ENV,
        )
    return released


def place_cublas_workspaces(device: torch.device | int | str) -> None:
    """Make cuBLAS's workspaces for eager matmuls on the current stream of ``device``
    now, for the calling thread and for autograd's backward thread (one tiny matmul
    forward and backward; torch keeps one workspace per cuBLAS handle and stream, and
    a handle per thread). Where they exist already, nothing changes.

    Why: a graph pool's first streams drop torch's workspaces
    (:meth:`~cudagraphs.graph_pool.GraphMemoryPool.capture_stream` says why), and the
    next eager matmul makes a new one wherever the caching allocator finds room. For
    the backward thread that is the first matmul of the next backward, when the
    loss's large blocks have just been freed: the 32 MiB workspace (Hopper) is cut
    out of one of them and pins its whole segment for good, so the next step's loss
    cannot reuse it and the allocator grows by another. Made right after
    :func:`release_unused_cache`, when only the holes between live tensors are
    cached, a workspace fills a hole or takes a segment of its own size. Measured on
    the benchmark's ``small`` shape, partial graphs with the default scopes:
    ``docs/memory.md``."""
    # Under the caller's inference mode or no_grad (an evaluation's capture) too.
    with torch.inference_mode(False), torch.enable_grad():
        a = torch.ones(2, 2, device=device, requires_grad=True)
        torch.autograd.grad((a @ a).sum(), (a,))


def _unused_cache(device: int) -> int:
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


@dataclass
class MemoryMeter:
    """Measures one capture phase: :meth:`start` before the warmup, :meth:`finish`
    after the last capture."""

    device: int
    reserved: int
    free: int
    unused_cache: int
    released_before: int = 0

    @classmethod
    def start(
        cls,
        device: torch.device | int,
        *,
        release: str | None = None,
        eager_workspaces: bool = True,
        pack: Callable[[], int] | None = None,
    ) -> MemoryMeter:
        """Start measuring on ``device``. ``release`` (the caller's name, for the log):
        first give back the unused cache when there is more than 2 MiB of it
        (:func:`release_unused_cache`); then call ``pack``, which packs what is left
        and returns the bytes it gave back
        (:func:`~cudagraphs.optimizer_state.compact_before_capture` of the optimizers
        a caller names), counted as released too; then, where either gave anything
        back and with ``eager_workspaces``, make the eager cuBLAS workspaces again
        (:func:`place_cublas_workspaces`; ``False`` where the graphs leave no eager
        matmul, as a whole graphed training step does: the two would be 64 MiB that
        nothing uses). The unused cache :meth:`finish` compares with is read last.

        Why before the warmup: eager steps run before a capture cached their whole
        working set, the graphed work's activations included. From the capture on those
        live in the graph's pool, so the cached copy of them is held for nothing, and
        the pool grows beside it (measured: layers captured after two eager steps of
        the model held 1.24-1.28x the eager peak, ``docs/memory.md``). The workspaces
        go back with the cache when the pool's streams drop them; made again right
        after the release (and packing), they take a hole or a segment of their own
        size instead of a piece of the next step's large blocks. The next eager step
        asks the driver once for what it needs beyond the graphs.

        Why packing comes before the workspaces: after the release the cached holes
        lie between the optimizer's state tensors, and a workspace made then fills one
        of them; its segment then holds a live block that is not state, so packing
        cannot give it back (measured: ``docs/memory.md``, item 10)."""
        index = torch.device("cuda", device).index if isinstance(device, int) else device.index
        index = torch.cuda.current_device() if index is None else index
        torch.cuda.synchronize(index)
        released = 0
        if release is not None:
            if _unused_cache(index) > 2 * _MIB:
                released = release_unused_cache(index, release)
            if pack is not None:
                released += pack()
                torch.cuda.synchronize(index)
            if released and eager_workspaces:
                place_cublas_workspaces(index)
        return cls(
            index,
            torch.cuda.memory_reserved(index),
            torch.cuda.mem_get_info(index)[0],
            _unused_cache(index),
            released,
        )

    def finish(
        self,
        handles: Iterable[tuple[int, int]],
        *,
        what: str,
        release: bool | None = None,
        static_bytes: int = 0,
    ) -> MemoryAccount:
        """The account of the phase. ``release``: give unused cached memory back to
        the driver (:func:`release_unused_cache`) always (``True``), never
        (``False``), or when the phase left more of it than there was before
        (``None``: a warmup that ran outside its pool). ``static_bytes``: the graphs'
        static buffers (:func:`tensor_bytes` of them), as the account's."""
        index = self.device
        torch.cuda.synchronize(index)
        reserved = torch.cuda.memory_reserved(index)
        free = torch.cuda.mem_get_info(index)[0]
        unused = _unused_cache(index)
        pool_reserved, pool_allocated = pool_usage(handles, index)
        # Pool segments count as reserved but hold graph temporaries: not "unused".
        unused_outside = max(0, unused - (pool_reserved - pool_allocated))
        before_outside = self.unused_cache
        driver = max(0, (self.free - free) - (reserved - self.reserved))
        if release is None:
            release = unused_outside > before_outside + 2 * _MIB
        released = release_unused_cache(index, what) if release and unused_outside else 0
        return MemoryAccount(
            pool_reserved,
            pool_allocated,
            unused_outside,
            self.released_before + released,
            driver,
            static_bytes,
        )


@dataclass
class RecordingSegments:
    """The eager allocations of a recording step made in expandable segments:
    :meth:`enter` when recording starts, :meth:`leave` when it stops (both
    idempotent). Off under ``CUDAGRAPHS_EXPANDABLE_RECORDING=0``, without CUDA, on a
    torch whose allocator settings cannot change at run time, and where the process
    set ``expandable_segments:True`` itself (then every segment is expandable anyway).

    Why: the recording step is an eager step, and its optimizer makes its state
    (kept for good) in the holes the step's activations leave, scattered across the
    step's segments. From the capture on those activations live in the graphs'
    pools, so the segments they shared with the state hold little but the state; a
    fixed segment goes back to the driver only when all of it is free, and the
    release after the capture (:func:`release_unused_cache`) could not give them
    back. An expandable segment gives back every free page, so what the recording
    step leaves in the general memory is the state it keeps, rounded to pages.
    Segments made inside stay expandable; the allocator makes fixed ones again after
    :meth:`leave`. Memory made inside cannot be exported as a CUDA IPC handle
    (``cudaIpcGetMemHandle`` refuses memory mapped this way): recording steps that
    share tensors across processes set the variable to ``0``."""

    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    active: bool = False

    def enter(self) -> None:
        if self.active or not expandable_recording():
            return
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        self.stack.enter_context(expandable_segments())
        self.active = True

    def leave(self) -> None:
        if self.active:
            self.active = False
            self.stack.close()
