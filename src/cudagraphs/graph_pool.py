"""Graph pools: the memory that captured graphs share, and the stream they capture on.

:class:`GraphMemoryPool` wraps torch's pool handle so that a failed capture can retire a
poisoned handle (see its docs); :func:`side_stream` orders warmup and capture work
after the caller's stream and back. Re-exported by :mod:`cudagraphs.capture`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from .checks import require_cuda
from .errors import CudaGraphsTypeError
from .settings import expandable_pools
from .torch_private import (
    begin_allocate_to_pool,
    clear_cublas_workspaces,
    device_index,
    end_allocate_to_pool,
    expandable_segments,
    release_pool,
)

__all__ = [
    "GraphMemoryPool",
    "GraphPool",
    "PoolHandle",
    "as_graph_pool",
    "new_pool",
    "new_torch_graph",
    "pool_segments",
    "side_stream",
]

logger = logging.getLogger(__name__)

PoolHandle = tuple[int, int]


def new_torch_graph(keep_graph: bool) -> torch.cuda.CUDAGraph:
    if keep_graph:
        # keep_graph keeps the cudaGraph_t alive after capture, which introspection
        # (node count, measured instantiation) needs. Every torch we support has it.
        return torch.cuda.CUDAGraph(keep_graph=True)
    return torch.cuda.CUDAGraph()


class GraphMemoryPool:
    """A memory pool that graphs share, and that stays usable after a failed capture.

    torch identifies a graph pool by a handle (``torch.cuda.graph_pool_handle()``), and
    two torch facts make a bare handle fragile:

    * After a capture fails part way, the pinned-host allocator (torch 2.11) still
      believes it records into that handle, and there is no Python call to stop it:
      every later capture into the handle fails with "already recording".
    * Once the last graph of a handle is released, capturing into it again trips an
      internal use-count assertion.

    A ``GraphMemoryPool`` is therefore a logical pool. It keeps one tiny *anchor* graph in
    its current handle (captured lazily before the first real capture; it allocates
    nothing), so the handle never runs out of users, and after a failed capture it
    retires the handle and moves on to a fresh one. Graphs captured before a failure
    keep their memory; graphs captured after it simply do not share memory with them.

    Not thread safe: one capture at a time, as CUDA graph capture requires anyway.
    """

    def __init__(self, handle: PoolHandle | None = None, *, owner: Any = None) -> None:
        self._handle = handle
        # Whether no capture went into the handle yet: true only for a handle made here
        # (one passed in may hold graphs captured elsewhere). See warmup_scope.
        self._fresh = handle is None
        # What the handle came from (a torch.cuda.MemPool), kept alive with it.
        self._owner = owner
        self._anchor: torch.cuda.CUDAGraph | None = None
        self._anchor_buffer: torch.Tensor | None = None
        self.retired: list[PoolHandle] = []  # handles given up after failed captures
        self._streams: dict[int, torch.cuda.Stream] = {}  # capture streams per device
        self._warmup_streams: dict[int, torch.cuda.Stream] = {}
        # Gradients the core lent to autograd out of this pool's memory, to be moved
        # before a replay overwrites them (cudagraphs.core.lent_grads).
        self.lent_grads: Any = None

    @property
    def handle(self) -> PoolHandle:
        """The torch pool handle captures go into now (changes after a failure)."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def handles(self) -> tuple[PoolHandle, ...]:
        """Every torch handle this pool captured into: the retired ones and the current."""
        current = () if self._handle is None else (self._handle,)
        return (*self.retired, *current)

    def prepare(self, stream: torch.cuda.Stream) -> PoolHandle:
        """Anchor the current handle (once) and return it; call before each capture."""
        handle = self.handle
        if self._anchor is None:
            # The anchor writes to a buffer allocated outside the pool, so the pool
            # gets a user but no memory.
            self._anchor_buffer = torch.zeros(1, device=stream.device)
            anchor = new_torch_graph(keep_graph=False)
            with torch.cuda.stream(stream):
                anchor.capture_begin(pool=handle, capture_error_mode="thread_local")
                try:
                    self._anchor_buffer.zero_()
                finally:
                    anchor.capture_end()
            self._anchor = anchor
        return handle

    @property
    def fresh(self) -> bool:
        """Whether no graph was captured into the current handle yet (and this object
        made the handle): warmups then run inside the pool (:meth:`warmup_scope`)."""
        return self._fresh

    def mark_captured(self) -> None:
        """Record that a capture goes into the current handle; called by
        :func:`~cudagraphs.capture.capture_into_graph` before each capture."""
        self._fresh = False

    @contextlib.contextmanager
    def warmup_scope(self, device: torch.device | int | None = None) -> Iterator[torch.cuda.Stream]:
        """Where eager warmups before captures into this pool run; yields the stream.

        While the pool is :attr:`fresh`, on the capture stream with the device's
        allocations routed into the pool (every thread's: autograd's backward runs on a
        thread of its own): every block the warmup frees is then free
        *in the pool, on the capture stream*, where the capture that follows takes it
        again, and what the warmup keeps (optimizer state, caches a model builds
        lazily, the capture stream's cuBLAS workspace) lives there too. The warmup's
        peak becomes the graphs' memory instead of a second copy cached beside them
        (the caching allocator reuses a free block only for the pool and stream it
        was freed in). torch.compile's CUDA-graph trees warm up the same way.

        Once a graph is in the pool, a warmup's lasting tensors could be placed in
        memory that graph uses for its temporaries, and a replay would overwrite
        them; so later warmups run on :meth:`warmup_stream`, outside the pool, and
        their blocks stay cached in the default pool (released by
        :func:`~cudagraphs.memory.release_unused_cache`).
        """
        if not self._fresh:
            stream = self.warmup_stream(device)
            with side_stream(stream):
                yield stream
            return
        stream = self.capture_stream(device)
        handle = self.prepare(stream)
        index = stream.device.index
        with side_stream(stream), pool_segments():
            begin_allocate_to_pool(index, handle)
            try:
                yield stream
            finally:
                end_allocate_to_pool(index, handle)
                release_pool(index, handle)

    def capture_stream(self, device: torch.device | int | None = None) -> torch.cuda.Stream:
        """The stream captures into this pool run on (one per device); never used for
        eager work (warm up on :meth:`warmup_stream`).

        Why a stream of its own: cuBLAS keeps a workspace per stream (32 MiB on Hopper),
        made by the first matmul on the stream. On this stream that first matmul is
        inside the pool's first capture, so the workspace is allocated in the pool and
        every later capture here reuses it. torch does not make a new CUDA stream for
        ``torch.cuda.Stream()``: it hands out its 32 per device and priority in turn, so
        after 32 more the stream comes round again, and eager matmuls that ran on it
        left torch holding a workspace for it. Making the pool's streams therefore drops
        torch's references to every workspace first (what torch.compile's CUDA-graph
        trees do each time they record): the next matmul anywhere makes a new one, and
        this stream's is made inside the pool. A workspace made eagerly would live in the
        caching allocator's general memory, where torch alone owns it, and torch drops
        its reference whenever it clears its workspaces: torch.compile's CUDA-graph
        trees do so each time they record (their ``clear_cublas_manager``),
        and newer torch does so per stream when a graph is destroyed. The memory then
        goes to other tensors (or back to the driver on ``empty_cache``) while our
        graphs still write their matmul scratch into it. Measured on the H200 with
        torch 2.11: a graph warmed up on its capture stream hits an illegal memory
        access after a clear and ``empty_cache``; warmed up on another stream it replays
        correctly and corrupts nothing. Inside the pool, a cleared workspace stays
        mapped as long as the pool's graphs live.
        """
        return self._make_streams(device)[0]

    def warmup_stream(self, device: torch.device | int | None = None) -> torch.cuda.Stream:
        """The stream eager warmups before captures into this pool run on (one per
        device). It has its own cuBLAS workspace outside the pool, made by the first warmup
        on it (the pool's first warmup runs inside the pool, on the capture stream)."""
        return self._make_streams(device)[1]

    def _make_streams(self, device: torch.device | int | None) -> tuple[torch.cuda.Stream, ...]:
        """The capture and warmup streams of ``device``, both made at the first ask for
        either, right after dropping torch's workspaces (:meth:`capture_stream`): neither
        then carries a workspace torch made for eager work before."""
        index = device_index(device, optional=True)
        if index not in self._streams:
            clear_cublas_workspaces()
            self._streams[index] = torch.cuda.Stream(index)
            self._warmup_streams[index] = torch.cuda.Stream(index)
        return self._streams[index], self._warmup_streams[index]

    def retire(self) -> None:
        """Give up the current handle after a failed capture; the next capture uses a
        fresh one. Graphs already in the old handle keep their memory."""
        if self._handle is not None:
            self.retired.append(self._handle)
            logger.warning(
                "graph pool %s retired after a failed capture; later graphs go to a new "
                "pool and do not share memory with the graphs captured before",
                self._handle,
            )
        self._handle = None
        self._fresh = True  # the next handle is made here
        self._anchor = None  # releases the old handle once its other graphs are gone

    def __repr__(self) -> str:
        return (
            f"GraphMemoryPool(handle={self._handle}, fresh={self._fresh}, "
            f"retired={len(self.retired)})"
        )


# Deprecated alias of GraphMemoryPool, kept for one release. The name read too close
# to the program layer's CudaGraphPool, which is a different thing (the scratch that
# programs share).
GraphPool = GraphMemoryPool


def pool_segments() -> contextlib.AbstractContextManager:
    """The scope in which a pool's segments are made (a fresh pool's warmup, every
    capture): expandable ones, unless ``CUDAGRAPHS_EXPANDABLE_POOLS=0``.

    Why: per-layer graphs in one pool free each layer's activations during its
    backward capture, and the gradients the next backward captures allocate could
    take their place, but they are other sizes: in fixed segments (one per large
    allocation, or 20 MiB ones) the freed blocks rarely fit, so the pool grows by
    the gradients and holds activations plus gradients where eager holds about the
    larger of the two. In one expandable segment neighbouring free blocks merge
    (``docs/memory.md`` has the measured effect per layer). Only segments of the
    graph pools change; eager
    memory keeps the allocator's own settings, and a process that set
    ``expandable_segments:True`` itself is left as it is. Off for code that needs
    pool memory exportable as a CUDA IPC handle (``cudaIpcGetMemHandle`` refuses
    memory mapped this way)."""
    return expandable_segments() if expandable_pools() else contextlib.nullcontext()


@contextlib.contextmanager
def side_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make ``stream`` current, ordered after the work already queued on the current
    stream, and order the current stream after it again on exit (also on error).

    ``None`` is a no-op (CPU code paths). Warmups run here on the pool's
    :meth:`GraphMemoryPool.warmup_stream`, never on its capture stream (see
    :meth:`GraphMemoryPool.capture_stream` for why).
    """
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


def new_pool() -> GraphMemoryPool:
    """A fresh :class:`GraphMemoryPool` for graphs that should share memory.

    Raises:
        NoCudaDeviceError: torch finds no usable CUDA device (graph pools live on one).
    """
    require_cuda("new_pool()")
    return GraphMemoryPool()


def as_graph_pool(pool: Any) -> GraphMemoryPool:
    """The :class:`GraphMemoryPool` for what a caller passed as ``pool``.

    Accepted: a :class:`GraphMemoryPool` (itself); ``None`` (a new pool); a raw torch pool
    handle, as ``torch.cuda.graph_pool_handle()`` and Transformer Engine's
    ``graph_pool_handle()`` return; a ``torch.cuda.MemPool`` (its handle, with the
    ``MemPool`` kept alive as long as the wrapper); and any object with a
    ``graph_pool`` attribute holding a :class:`GraphMemoryPool` (a
    :class:`~cudagraphs.CudaGraphPool`: graphs then share its scratch memory).

    A raw handle or ``MemPool`` is wrapped; the wrapper retires the handle on failure
    like any ``GraphMemoryPool``, but only for the captures that go through the same
    wrapper, so keep the returned object (or pass ``new_pool()`` from the start) to
    capture again.

    Raises:
        CudaGraphsTypeError: anything else, naming what was passed.
    """
    if isinstance(pool, GraphMemoryPool):
        return pool
    if pool is None:
        return GraphMemoryPool()
    inner = getattr(pool, "graph_pool", None)
    if isinstance(inner, GraphMemoryPool):
        return inner
    if _is_handle(pool):
        return GraphMemoryPool(handle=tuple(pool))
    mem_pool = getattr(torch.cuda, "MemPool", None)
    if isinstance(mem_pool, type) and isinstance(pool, mem_pool) and _is_handle(pool.id):
        return GraphMemoryPool(handle=tuple(pool.id), owner=pool)
    raise CudaGraphsTypeError(
        "pool must be a cudagraphs.GraphMemoryPool, a CudaGraphPool, a torch.cuda.MemPool, a "
        f"handle from torch.cuda.graph_pool_handle() or None; got {type(pool).__name__} "
        f"{pool!r}"
    )


def _is_handle(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
