"""In-graph staging: the graph copies a staged input from the caller's tensor itself.

Why: on the H200 host one ``copy_`` launch before a replay costs more host time than
the replay itself (the driver call is most of it). Changing the source address of a
memcpy node inside the instantiated graph costs less than that launch, and nothing at
all when the caller passes the same tensor as last time. Measured in
``docs/program.md`` (one input: raw replay 2.5 to 2.7 us, replay + ``copy_``
9.4 to 10.2 us, ours with a new tensor each call 7.3 to 8.1 us, with the same tensor
5.0 to 5.2 us).

How:
* Capture: each staged input buffer ``home`` is read through ``inner.copy_(home)`` at
  the start of the graph (a 1-D memcpy node); the function reads ``inner``, which
  lives in the graph's pool like any temporary, since every replay writes it first.
* After capture the node of each staged input is found in the kept ``cudaGraph_t`` by
  its (source, destination) addresses.
* Replay: a source on the graph's device, contiguous, of the staged dtype and size,
  becomes the node's source (``cudaGraphExecMemcpyNodeSetParams1D`` through
  :mod:`cudagraphs.cuda_binding`, handles wrapped once at capture; CUDA applies it
  to later launches only, so launches still queued keep theirs). Anything else (a CPU
  or other-device source, or a refused update) is copied into ``home`` as before and
  the node pointed back at ``home``.

The program keeps a reference to each bound source until the next replay or copy, so
the memory a node reads is never handed to another tensor while the node points at it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..cuda_binding import CudaBinding, SourceSetter, cuda_binding
from ..errors import CudaCallError, CudaGraphsValueError

__all__ = [
    "AUTO_GRAPH_STAGING_MAX_TENSORS",
    "GraphStaging",
    "StagedInput",
    "check_staging_mode",
    "choose_staging",
]

logger = logging.getLogger(__name__)

#: ``staging="auto"`` stages in the graph up to this many input tensors. A changed
#: source costs one runtime call (2.3 to 2.8 us more than the same source, on the H200
#: host), while one fused copy of any number of same-dtype tensors costs 6.8 to 7.5 us
#: (``docs/program.md``): beyond two tensors whose sources change at every
#: call, copies win.
AUTO_GRAPH_STAGING_MAX_TENSORS = 2

STAGING_MODES = ("auto", "graph", "copy")


def stageable(t: torch.Tensor) -> bool:
    """Whether a buffer tensor can be fed by a 1-D memcpy node."""
    return t.numel() > 0 and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def check_staging_mode(mode: object) -> None:
    if mode not in STAGING_MODES:
        raise CudaGraphsValueError(f"staging must be one of {STAGING_MODES}, got {mode!r}")


def choose_staging(mode: str, buffers: list[torch.Tensor], runtime_available: bool) -> str:
    """The staging a program gets: ``"graph"`` or ``"copy"`` (pure policy).

    Raises:
        ValueError: unknown mode, or ``"graph"`` when no buffer can be staged in the
            graph or the CUDA runtime cannot be reached.
    """
    check_staging_mode(mode)
    if mode == "copy":
        return "copy"
    usable = runtime_available and any(stageable(b) for b in buffers)
    if mode == "graph":
        if not runtime_available:
            raise CudaGraphsValueError(
                "staging='graph' needs the CUDA runtime: cuda-bindings (pip install "
                "cudagraphs[speedups]) or the libcudart torch loaded, and neither was "
                "found in this process (a statically linked torch?); install "
                "cuda-bindings, or use staging='copy' or 'auto'"
            )
        if not usable:
            raise CudaGraphsValueError(
                "staging='graph' stages contiguous, non-empty input tensors, and the "
                "examples have none; use staging='copy' or 'auto'"
            )
        return "graph"
    return "graph" if usable and len(buffers) <= AUTO_GRAPH_STAGING_MAX_TENSORS else "copy"


@dataclass
class StagedInput:
    """One input tensor fed by a memcpy node of the graph."""

    index: int  # position among the program's input tensors (flatten order)
    home: torch.Tensor  # the input buffer tensor (the node's source when copy-fed)
    numel: int
    set_source: SourceSetter  # points the memcpy node at an address (None: done)
    dst: int  # address the node writes (the graph-internal copy)
    nbytes: int
    current: int  # the node's source address now


def staged_arguments(buffers: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, int]]:
    """Inside capture: the tensors the function reads, with each stageable buffer
    replaced by a graph-internal copy; and {index: address of that copy}."""
    inner_tensors, inner_ptrs = [], {}
    with torch.no_grad():
        for i, home in enumerate(buffers):
            if not stageable(home):
                inner_tensors.append(home)
                continue
            inner = torch.empty_like(home)
            inner.copy_(home)
            inner.requires_grad_(home.requires_grad)
            inner_tensors.append(inner)
            inner_ptrs[i] = inner.data_ptr()
    return inner_tensors, inner_ptrs


class GraphStaging:
    """The staged inputs of one instantiated graph and the binding that updates them."""

    def __init__(
        self,
        runtime: CudaBinding,
        graph: torch.cuda.CUDAGraph,
        buffers: list[torch.Tensor],
        inner_ptrs: dict[int, int],
    ) -> None:
        graph_exec = int(graph.raw_cuda_graph_exec())
        by_edge = {(n.src, n.dst): n for n in runtime.memcpy_nodes(int(graph.raw_cuda_graph()))}
        staged = []
        for i, dst in inner_ptrs.items():
            home = buffers[i]
            node = by_edge.get((home.data_ptr(), dst))
            if node is None or node.nbytes != home.nbytes:
                # torch captured this copy as a kernel (or split it): the graph still
                # copies from ``home``, so the input stays copy-fed and correct.
                logger.debug("input tensor %d: no 1-D memcpy node found; staged by copy", i)
                continue
            setter = runtime.memcpy_source_setter(graph_exec, node)
            staged.append(
                StagedInput(i, home, home.numel(), setter, dst, home.nbytes, home.data_ptr())
            )
        self.inputs: tuple[StagedInput, ...] = tuple(staged)
        self._covers_all = len(staged) == len(buffers)
        self._device = buffers[0].device if buffers else None
        self._held: list[Any] = []  # sources bound to nodes (kept alive, see module docs)
        self.rebinds = 0  # node updates made (a figure for tests and diagnostics)

    def __bool__(self) -> bool:
        return bool(self.inputs)

    def bind(self, sources: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Point each staged node at its source where possible. Returns ``None`` when
        every input tensor was bound (nothing to copy), else ``sources`` with the
        bound ones replaced by the buffers themselves, which copies then skip."""
        held = []
        device = self._device
        all_bound = self._covers_all
        for s in self.inputs:
            src = sources[s.index]
            home = s.home
            if (
                src.device == device
                and src.dtype is home.dtype
                and src.numel() == s.numel
                and src.is_contiguous()
                # A conjugate or negative view's bytes are not its values: copy it.
                and not src.is_conj()
                and not src.is_neg()
            ):
                ptr = src.data_ptr()
                # A source overlapping the node's destination (a program output that
                # is its own input, fed back) cannot be a memcpy source: copy it.
                overlaps_dst = ptr < s.dst + s.nbytes and s.dst < ptr + s.nbytes
                if not overlaps_dst and (ptr == s.current or self._point(s, ptr) is None):
                    held.append(src)
                    continue
            self._point_home(s)  # the copy into home feeds the node
            all_bound = False
        self._held = held
        if all_bound:
            return None
        out = list(sources)
        for s in self.inputs:
            if s.current != s.home.data_ptr():
                out[s.index] = s.home  # bound: the copy skips it
        return out

    def unbind(self) -> None:
        """Point every node back at its buffer (before the buffer is written)."""
        for s in self.inputs:
            self._point_home(s)
        self._held = []

    def _point_home(self, s: StagedInput) -> None:
        error = self._point(s, s.home.data_ptr())
        if error is not None:
            # The node still reads a caller's tensor: replaying would read stale data.
            raise CudaCallError(
                f"input tensor {s.index}: CUDA refused ({error}) to point its memcpy node "
                "back at the program's own buffer (the address it was captured with); the "
                "program cannot replay safely. Close it and capture again with "
                "staging='copy', and please report this."
            )

    def _point(self, s: StagedInput, ptr: int) -> str | None:
        """Point ``s``'s node at ``ptr``: ``None`` when it does, else CUDA's error."""
        if ptr == s.current:
            return None
        error = s.set_source(ptr)
        if error is not None:
            logger.debug("input tensor %d: memcpy node update refused (%s)", s.index, error)
            return error
        s.current = ptr
        self.rebinds += 1
        return None


def runtime_for(mode: str) -> CudaBinding | None:
    """The CUDA binding when ``mode`` may stage in the graph and it can reach the
    runtime (looked up once per capture)."""
    if mode == "copy" or not torch.cuda.is_available():
        return None
    binding = cuda_binding()
    return binding if binding is not None and binding.has_runtime else None
