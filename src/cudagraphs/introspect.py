"""Graph introspection through the CUDA driver.

* :func:`graph_node_count`: number of nodes in a captured graph.
* :func:`instantiate_measured`: instantiate a graph and report how much device
  memory the driver took for the executable graph.

The driver is reached through :func:`cudagraphs.cuda_binding.cuda_binding`
(``cuda.bindings`` when installed, ``ctypes`` otherwise). Off NVIDIA (no driver
library), node counts are ``None`` and memory is ``0``; nothing here raises for a
missing driver.

Both functions need the ``cudaGraph_t`` itself, so capture with ``keep_graph=True``
(:func:`cudagraphs.capture.capture_into_graph` passes it through).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .cuda_binding import cuda_binding
from .errors import CudaGraphsValueError

__all__ = ["GraphMemory", "graph_node_count", "instantiate_measured"]

logger = logging.getLogger(__name__)


def _raw_graph(graph: torch.cuda.CUDAGraph) -> int:
    try:
        return int(graph.raw_cuda_graph())
    except RuntimeError as exc:
        raise CudaGraphsValueError(
            "this graph no longer holds its cudaGraph_t; capture with keep_graph=True to inspect it"
        ) from exc


def graph_node_count(graph: torch.cuda.CUDAGraph) -> int | None:
    """Number of nodes (kernels, copies, memsets, ...) in a captured graph.

    Returns ``None`` when no driver binding is available.

    Raises:
        ValueError: the graph was captured without ``keep_graph=True``.
    """
    backend = cuda_binding()
    if backend is None:
        return None
    count = backend.node_count(_raw_graph(graph))
    return count


@dataclass(frozen=True)
class GraphMemory:
    """What instantiating one graph cost on the device."""

    nodes: int | None
    exec_bytes: int  # device memory the driver took for the executable graph

    @property
    def bytes_per_node(self) -> float:
        return self.exec_bytes / self.nodes if self.nodes else 0.0


def instantiate_measured(graph: torch.cuda.CUDAGraph) -> GraphMemory:
    """Instantiate ``graph`` (captured with ``keep_graph=True``, not yet replayed) and
    report the device memory the driver took for it.

    The figure is the drop in the driver's free-memory count across instantiation, so
    it is coarse (the driver maps memory in pages) and includes anything another
    thread allocated meanwhile: take it on a quiet device.
    """
    backend = cuda_binding()
    nodes = backend.node_count(_raw_graph(graph)) if backend is not None else None
    torch.cuda.synchronize()
    free_before = backend.free_memory() if backend is not None else 0
    graph.instantiate()
    torch.cuda.synchronize()
    free_after = backend.free_memory() if backend is not None else 0
    return GraphMemory(nodes=nodes, exec_bytes=max(0, free_before - free_after))
