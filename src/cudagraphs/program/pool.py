"""The records a program hands out and the pool programs share.

``CudaGraphPool`` owns the shared scratch of sequential programs; ``CopyHandle`` and
``CudaGraphCaptureStats`` are the small records programs return.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from ..capture import GraphMemoryPool
from ..checks import require_cuda
from ..errors import (
    CudaGraphInputError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    ProgramClosedError,
)
from .launch_order import LaunchOrder

__all__ = ["CopyHandle", "CudaGraphCaptureStats", "CudaGraphPool", "ProgramClosedError"]


class _Member(Protocol):
    """What a pool asks of its programs (no import of the program module: it imports
    this one)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class CudaGraphCaptureStats:
    """One-time construction costs and allocator snapshots right after capture
    (process-wide figures, not the graph's own footprint)."""

    warmup_iterations: int
    warmup_seconds: float
    capture_seconds: float
    first_replay_seconds: float
    memory_allocated_bytes: int
    memory_reserved_bytes: int


@dataclass(frozen=True)
class CopyHandle:
    """Proof of one :meth:`CudaGraphProgram.copy_inputs_from`: which program, which
    payload generation, and the event that completes when the copy has landed."""

    program_token: object
    generation: int
    event: torch.cuda.Event
    sources: tuple[torch.Tensor, ...]  # kept alive until the copy is consumed

    def check(self, program_token: object, generation: int, program: str) -> None:
        """That this handle is ``program``'s latest payload.

        Raises:
            CudaGraphInputError: made by another program (a foreign handle), or a
                newer copy or replay replaced its payload (a stale handle); the two
                are told apart in the message.
        """
        if self.program_token is not program_token:
            raise CudaGraphInputError(
                f"program {program}: copy_handle was made by another program; pass the "
                "handle that this program's copy_inputs_from returned"
            )
        if self.generation != generation:
            raise CudaGraphInputError(
                f"program {program}: copy_handle is stale (payload {self.generation}, "
                f"buffer now holds payload {generation}): a newer copy_inputs_from or "
                "replay replaced it; use the latest handle"
            )


class CudaGraphPool:
    """Shared scratch memory for programs that run one after another.

    Programs captured with one pool share the memory of their intermediates; their
    inputs and retained outputs live outside it, so the programs may replay in any
    order without overwriting each other's outputs. Launches are chained with events,
    so programs replayed from different streams still use the scratch one at a time.

    Args:
        device: the CUDA device of the scratch memory (``"cuda"``: the current one).
        pool: the :class:`~cudagraphs.GraphMemoryPool` to take the scratch from (share one
            with the core helper's or a runner's graphs); a new one by default.

    Raises:
        CudaGraphsTypeError, CudaGraphsValueError: ``device`` is not a CUDA device.
        NoCudaDeviceError: torch finds no usable CUDA device.
    """

    def __init__(
        self, device: torch.device | str | int = "cuda", *, pool: GraphMemoryPool | None = None
    ) -> None:
        if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
            raise CudaGraphsTypeError(
                f"CudaGraphPool(device=...) takes a torch.device, a str such as 'cuda:0' "
                f"or a device index, got {type(device).__name__}"
            )
        try:
            device = (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            )
        except RuntimeError as exc:
            raise CudaGraphsValueError(f"CudaGraphPool(device={device!r}): {exc}") from None
        require_cuda("CudaGraphPool")
        if device.type != "cuda":
            raise CudaGraphsValueError(f"a CudaGraphPool lives on a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        if pool is not None and not isinstance(pool, GraphMemoryPool):
            raise CudaGraphsTypeError(
                f"CudaGraphPool(pool=...) takes a cudagraphs.GraphMemoryPool (new_pool()), got "
                f"{type(pool).__name__}"
            )
        self._graph_pool = GraphMemoryPool() if pool is None else pool
        self._members: weakref.WeakSet[_Member] = weakref.WeakSet()
        #: Launches of member programs share the scratch: one on another stream than
        #: the last waits for it (:class:`LaunchOrder`).
        self.launch_order = LaunchOrder()
        self._closed = False

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def graph_pool(self) -> GraphMemoryPool:
        """The :class:`~cudagraphs.GraphMemoryPool` holding the scratch: pass it (or this
        object) as ``pool=`` to other layers' captures to share the memory.

        Raises:
            ProgramClosedError: after ``close()``.
        """
        self.check_open()
        return self._graph_pool

    def check_open(self) -> None:
        """Raise :class:`~cudagraphs.errors.ProgramClosedError` once ``close()`` ran."""
        if self._closed:
            raise ProgramClosedError("this CudaGraphPool was closed; create a new pool")

    def add_member(self, program: _Member) -> None:
        """Register a program captured with this pool (held weakly), closed with it."""
        self._members.add(program)

    def discard_member(self, program: _Member) -> None:
        """Unregister a program (it is closing)."""
        self._members.discard(program)

    def close(self) -> None:
        """Wait for all scratch users, then close the live member programs (idempotent)."""
        if self._closed:
            return
        torch.cuda.synchronize(self._device)
        for program in list(self._members):
            program.close()
        self._closed = True
        self._graph_pool = None
        self.launch_order.forget()
