"""Graph introspection through the CUDA driver.

* :func:`graph_node_count`: number of nodes in a captured graph.
* :func:`instantiate_measured`: instantiate a graph and report how much device
  memory the driver took for the executable graph.

The driver is reached through ``cuda.bindings`` when it is installed and through
``ctypes`` on ``libcuda.so.1`` otherwise. Off NVIDIA (no driver library), node counts
are ``None`` and memory is ``0``; nothing here raises for a missing driver.

Both functions need the ``cudaGraph_t`` itself, so capture with ``keep_graph=True``
(:func:`cudagraphs.capture.capture_into_graph` passes it through).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from .errors import CudaCallError, CudaGraphsValueError

__all__ = ["GraphMemory", "driver_backend", "graph_node_count", "instantiate_measured"]

logger = logging.getLogger(__name__)


class _CtypesDriver:
    name = "ctypes"

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")

    def node_count(self, handle: int) -> int:
        count = ctypes.c_size_t(0)
        status = self._lib.cuGraphGetNodes(ctypes.c_void_p(handle), None, ctypes.byref(count))
        if status != 0:
            raise CudaCallError(f"cuGraphGetNodes returned CUresult {status}")
        return int(count.value)

    def driver_version(self) -> int:
        version = ctypes.c_int(0)
        status = self._lib.cuDriverGetVersion(ctypes.byref(version))
        if status != 0:
            raise CudaCallError(f"cuDriverGetVersion returned CUresult {status}")
        return int(version.value)

    def free_memory(self) -> int:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        status = self._lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        if status != 0:
            raise CudaCallError(f"cuMemGetInfo_v2 returned CUresult {status}")
        return int(free.value)


class _BindingsDriver:
    name = "cuda.bindings"

    def __init__(self) -> None:
        from cuda.bindings import driver  # optional dependency

        self._driver = driver

    def _check(self, result: tuple, call: str) -> tuple:
        status = result[0]
        if int(status) != 0:
            raise CudaCallError(f"{call} returned {status}")
        return result[1:]

    def node_count(self, handle: int) -> int:
        graph = self._driver.CUgraph(handle)
        _, count = self._check(self._driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        return int(count)

    def driver_version(self) -> int:
        (version,) = self._check(self._driver.cuDriverGetVersion(), "cuDriverGetVersion")
        return int(version)

    def free_memory(self) -> int:
        free, _total = self._check(self._driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)


def driver_backend() -> _CtypesDriver | _BindingsDriver | None:
    """The driver binding in use: ``cuda.bindings`` if importable, else ``ctypes``,
    else ``None`` (no NVIDIA driver on this machine)."""
    for backend in (_BindingsDriver, _CtypesDriver):
        try:
            return backend()
        except (ImportError, OSError, AttributeError):
            continue
    return None


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
    backend = driver_backend()
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
    backend = driver_backend()
    nodes = backend.node_count(_raw_graph(graph)) if backend is not None else None
    torch.cuda.synchronize()
    free_before = backend.free_memory() if backend is not None else 0
    graph.instantiate()
    torch.cuda.synchronize()
    free_after = backend.free_memory() if backend is not None else 0
    return GraphMemory(nodes=nodes, exec_bytes=max(0, free_before - free_after))
