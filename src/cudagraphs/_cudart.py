"""The few CUDA runtime calls that torch does not expose, through ``ctypes``.

Used by in-graph staging (:mod:`cudagraphs.program.staging`) to find a graph's
memcpy nodes and to change a memcpy node's source in an instantiated graph.

The binding opens the ``libcudart`` that torch itself loaded (found in the process's
memory map), so the handles torch hands out (``raw_cuda_graph()``,
``raw_cuda_graph_exec()``) belong to the same runtime. Builds that link the runtime
statically, and machines without it, get ``None`` from :func:`cuda_runtime`; callers
then keep staging by copies.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from .errors import CudaCallError

__all__ = ["CudaRuntime", "MemcpyNode", "cuda_runtime"]

logger = logging.getLogger(__name__)

_MEMCPY_NODE = 1  # cudaGraphNodeTypeMemcpy
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


class _Pos(ctypes.Structure):  # cudaPos and cudaExtent share this layout
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [
        ("ptr", ctypes.c_void_p),
        ("pitch", ctypes.c_size_t),
        ("xsize", ctypes.c_size_t),
        ("ysize", ctypes.c_size_t),
    ]


class _Memcpy3DParms(ctypes.Structure):
    _fields_ = [
        ("srcArray", ctypes.c_void_p),
        ("srcPos", _Pos),
        ("srcPtr", _PitchedPtr),
        ("dstArray", ctypes.c_void_p),
        ("dstPos", _Pos),
        ("dstPtr", _PitchedPtr),
        ("extent", _Pos),
        ("kind", ctypes.c_int),
    ]


@dataclass(frozen=True)
class MemcpyNode:
    """A memcpy node of a captured graph: its handle, addresses and width in bytes."""

    handle: int
    src: int
    dst: int
    nbytes: int


class CudaRuntime:
    """Thin checked wrappers; every failure raises ``RuntimeError`` naming the call,
    except :meth:`set_memcpy_source`, which returns the status (callers fall back)."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        setter = lib.cudaGraphExecMemcpyNodeSetParams1D
        setter.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
        ]
        setter.restype = ctypes.c_int
        self._set = setter
        lib.cudaGetLastError.restype = ctypes.c_int

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            self._lib.cudaGetLastError()  # clear it, so torch's next check does not trip
            raise CudaCallError(f"{call} returned cudaError {status}")

    def memcpy_nodes(self, graph: int) -> list[MemcpyNode]:
        """The memcpy nodes of a ``cudaGraph_t`` (a graph captured with keep_graph)."""
        lib = self._lib
        count = ctypes.c_size_t(0)
        self._check(
            lib.cudaGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)),
            "cudaGraphGetNodes",
        )
        handles = (ctypes.c_void_p * count.value)()
        self._check(
            lib.cudaGraphGetNodes(ctypes.c_void_p(graph), handles, ctypes.byref(count)),
            "cudaGraphGetNodes",
        )
        found = []
        for handle in handles[: count.value]:
            kind = ctypes.c_int(-1)
            node = ctypes.c_void_p(handle)
            self._check(lib.cudaGraphNodeGetType(node, ctypes.byref(kind)), "cudaGraphNodeGetType")
            if kind.value != _MEMCPY_NODE:
                continue
            p = _Memcpy3DParms()
            self._check(
                lib.cudaGraphMemcpyNodeGetParams(node, ctypes.byref(p)),
                "cudaGraphMemcpyNodeGetParams",
            )
            if p.srcArray or p.dstArray or p.extent.y != 1 or p.extent.z != 1:
                continue  # not a plain 1-D copy between linear buffers
            found.append(MemcpyNode(handle, p.srcPtr.ptr or 0, p.dstPtr.ptr or 0, p.extent.x))
        return found

    def set_memcpy_source(self, graph_exec: int, node: int, dst: int, src: int, nbytes: int) -> int:
        """Point a 1-D device-to-device memcpy node of an instantiated graph at ``src``
        for later launches (launches already queued keep their source). Returns the
        cudaError status (0 on success); a failure is cleared from the runtime."""
        status = self._set(graph_exec, node, dst, src, nbytes, _DEVICE_TO_DEVICE)
        if status:
            self._lib.cudaGetLastError()
        return status


def _loaded_cudart_path() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def cuda_runtime() -> CudaRuntime | None:
    """The runtime torch loaded, or ``None`` (no CUDA, static runtime, not Linux).

    Looked up on each call (cheap: it reads the memory map); programs call it once at
    capture.
    """
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    path = _loaded_cudart_path()
    if path is None:
        logger.debug("no libcudart in this process's memory map; in-graph staging is off")
        return None
    try:
        return CudaRuntime(ctypes.CDLL(path), path)
    except (OSError, AttributeError) as exc:
        logger.debug("cannot bind %s (%s); in-graph staging is off", path, exc)
        return None
