"""The one place this package calls CUDA directly: the few driver and runtime calls
torch does not expose.

Two users: in-graph staging (:mod:`cudagraphs.program.staging`) finds a graph's
memcpy nodes and points one at a new source between launches; introspection
(:mod:`cudagraphs.introspect`) counts a graph's nodes and reads the driver's free
memory and version.

Two bindings give the same calls, chosen by :func:`cuda_binding`:

* ``cuda.bindings`` (NVIDIA's ``cuda-bindings`` package, the one torch itself uses
  for graph introspection), when it imports: its calls convert arguments in compiled
  code, where ``ctypes`` converts them in Python, so the replay path's node update is
  cheaper (0.8 us a call in ``docs/program.md``).
* ``ctypes`` otherwise: the driver from ``libcuda.so.1`` and the runtime torch
  loaded (the ``libcudart`` in this process's memory map). Builds that link the
  runtime statically have no such library: the driver calls still work and
  :attr:`CudaBinding.has_runtime` is False, so staging stays by copies.

Graph, executable-graph and node handles are driver objects, so the handles torch
hands out (``raw_cuda_graph()``, ``raw_cuda_graph_exec()``) are valid in either
binding. Every failure names the call and the CUDA error by name
(``cudaErrorInvalidValue``, ``CUDA_ERROR_INVALID_VALUE``), not by number.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CudaCallError, CudaGraphsValueError
from .settings import BINDING_ENV, env_choice

__all__ = ["BINDINGS", "CudaBinding", "MemcpyNode", "SourceSetter", "cuda_binding"]

logger = logging.getLogger(__name__)

#: The names :func:`cuda_binding` accepts for ``prefer``, best first.
BINDINGS = ("cuda.bindings", "ctypes")

_MEMCPY_NODE = 1  # cudaGraphNodeTypeMemcpy
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice

#: Points one memcpy node of one executable graph at a source address; returns
#: ``None`` on success, else the CUDA error's name (the error is cleared).
SourceSetter = Callable[[int], "str | None"]


@dataclass(frozen=True)
class MemcpyNode:
    """A plain 1-D memcpy node of a captured graph: its handle, addresses, bytes."""

    handle: int
    src: int
    dst: int
    nbytes: int


class CudaBinding(ABC):
    """The calls both bindings provide; each binding supplies the abstract ones."""

    name = ""
    has_runtime = True

    @abstractmethod
    def describe(self) -> str:
        """One line for ``python -m cudagraphs env``."""

    @abstractmethod
    def driver_version(self) -> int:
        """The driver's CUDA version as an integer (13000 for CUDA 13.0)."""

    @abstractmethod
    def free_memory(self) -> int:
        """Free device memory on the current device, in bytes, as the driver sees it."""

    @abstractmethod
    def node_count(self, graph: int) -> int:
        """The number of nodes of a ``cudaGraph_t``."""

    def memcpy_nodes(self, graph: int) -> list[MemcpyNode]:
        """The plain 1-D copies between linear buffers among a graph's nodes."""
        self._need_runtime("memcpy_nodes")
        found = []
        for handle in self._nodes(graph):
            if self._node_type(handle) != _MEMCPY_NODE:
                continue
            node = self._memcpy_params(handle)
            if node is not None:
                found.append(node)
        return found

    @abstractmethod
    def memcpy_source_setter(self, graph_exec: int, node: MemcpyNode) -> SourceSetter:
        """A function that points ``node`` of the executable graph ``graph_exec`` at a
        new source address for later launches (launches already queued keep theirs).

        Everything but the address is wrapped here, once, so a call on the replay
        path converts one integer.
        """

    # ---- the primitives ---------------------------------------------------------

    @abstractmethod
    def _nodes(self, graph: int) -> list[int]: ...

    @abstractmethod
    def _node_type(self, node: int) -> int: ...

    @abstractmethod
    def _memcpy_params(self, node: int) -> MemcpyNode | None: ...

    def _need_runtime(self, call: str) -> None:
        if not self.has_runtime:
            raise CudaCallError(
                f"{call} needs the CUDA runtime library, and {self.describe()} has none; "
                "install cuda-bindings (pip install cudagraphs[speedups])"
            )


# ---- cuda.bindings -----------------------------------------------------------------


class _Bindings(CudaBinding):
    name = "cuda.bindings"

    def __init__(self) -> None:
        from cuda.bindings import driver, runtime  # optional dependency

        self._driver = driver
        self._runtime = runtime
        self._driver_ok = driver.CUresult.CUDA_SUCCESS
        self._runtime_ok = runtime.cudaError_t.cudaSuccess

    def device_error(self) -> str | None:
        """``None`` when the runtime reaches a device, else the CUDA error's name."""
        status, _count = self._runtime.cudaGetDeviceCount()
        if status == self._runtime_ok:
            return None
        self._runtime.cudaGetLastError()
        return _enum_name(status)

    def describe(self) -> str:
        try:
            version = importlib.metadata.version("cuda-bindings")
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        return f"cuda.bindings {version}"

    def _driver_call(self, call: str, *args: Any) -> tuple:
        status, *values = getattr(self._driver, call)(*args)
        if status != self._driver_ok:
            raise CudaCallError(f"{call} failed with {_enum_name(status)}")
        return tuple(values)

    def _runtime_call(self, call: str, *args: Any) -> tuple:
        status, *values = getattr(self._runtime, call)(*args)
        if status != self._runtime_ok:
            self._runtime.cudaGetLastError()  # clear it
            raise CudaCallError(f"{call} failed with {_enum_name(status)}")
        return tuple(values)

    def driver_version(self) -> int:
        (version,) = self._driver_call("cuDriverGetVersion")
        return int(version)

    def free_memory(self) -> int:
        free, _total = self._driver_call("cuMemGetInfo")
        return int(free)

    def node_count(self, graph: int) -> int:
        _nodes, count = self._driver_call("cuGraphGetNodes", self._driver.CUgraph(graph), 0)
        return int(count)

    def _nodes(self, graph: int) -> list[int]:
        handle = self._runtime.cudaGraph_t(graph)
        _none, count = self._runtime_call("cudaGraphGetNodes", handle, 0)
        nodes, _count = self._runtime_call("cudaGraphGetNodes", handle, count)
        return [int(n) for n in nodes]

    def _node_type(self, node: int) -> int:
        (kind,) = self._runtime_call("cudaGraphNodeGetType", self._runtime.cudaGraphNode_t(node))
        return int(kind)

    def _memcpy_params(self, node: int) -> MemcpyNode | None:
        handle = self._runtime.cudaGraphNode_t(node)
        (p,) = self._runtime_call("cudaGraphMemcpyNodeGetParams", handle)
        extent = p.extent
        if int(p.srcArray) or int(p.dstArray) or extent.height != 1 or extent.depth != 1:
            return None  # not a plain 1-D copy between linear buffers
        return MemcpyNode(node, int(p.srcPtr.ptr), int(p.dstPtr.ptr), int(extent.width))

    def memcpy_source_setter(self, graph_exec: int, node: MemcpyNode) -> SourceSetter:
        rt = self._runtime
        set_params = rt.cudaGraphExecMemcpyNodeSetParams1D
        exec_handle = rt.cudaGraphExec_t(graph_exec)
        node_handle = rt.cudaGraphNode_t(node.handle)
        dst, nbytes = node.dst, node.nbytes
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        ok, clear = self._runtime_ok, rt.cudaGetLastError

        def set_source(src: int) -> str | None:
            (status,) = set_params(exec_handle, node_handle, dst, src, nbytes, kind)
            if status == ok:
                return None
            clear()
            return _enum_name(status)

        return set_source


def _enum_name(status: Any) -> str:
    name = getattr(status, "name", None)
    return f"{name} ({int(status)})" if name else f"error {int(status)}"


# ---- ctypes ------------------------------------------------------------------------


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


class _Ctypes(CudaBinding):
    name = "ctypes"

    def __init__(self, driver: Any, runtime: Any | None, runtime_path: str | None) -> None:
        self._drv = driver
        self._rt = runtime
        self.runtime_path = runtime_path
        self.has_runtime = runtime is not None
        driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        if runtime is not None:
            runtime.cudaGetErrorName.restype = ctypes.c_char_p
            runtime.cudaGetLastError.restype = ctypes.c_int
            setter = runtime.cudaGraphExecMemcpyNodeSetParams1D
            setter.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_int]
            setter.restype = ctypes.c_int
            self._set_params = setter

    def describe(self) -> str:
        runtime = self.runtime_path or "no libcudart loaded (static runtime)"
        return f"ctypes (libcuda.so.1; {runtime})"

    def _driver_error(self, status: int) -> str:
        name = ctypes.c_char_p()
        if self._drv.cuGetErrorName(status, ctypes.byref(name)) != 0 or not name.value:
            return f"CUresult {status}"
        return f"{name.value.decode()} ({status})"

    def _runtime_error(self, status: int) -> str:
        name = self._rt.cudaGetErrorName(status)
        return f"{name.decode()} ({status})" if name else f"cudaError {status}"

    def _driver_call(self, call: str, *args: Any) -> None:
        status = getattr(self._drv, call)(*args)
        if status != 0:
            raise CudaCallError(f"{call} failed with {self._driver_error(status)}")

    def _runtime_call(self, call: str, *args: Any) -> None:
        status = getattr(self._rt, call)(*args)
        if status != 0:
            self._rt.cudaGetLastError()  # clear it, so torch's next check does not trip
            raise CudaCallError(f"{call} failed with {self._runtime_error(status)}")

    def driver_version(self) -> int:
        version = ctypes.c_int(0)
        self._driver_call("cuDriverGetVersion", ctypes.byref(version))
        return int(version.value)

    def free_memory(self) -> int:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._driver_call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return int(free.value)

    def node_count(self, graph: int) -> int:
        count = ctypes.c_size_t(0)
        self._driver_call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
        return int(count.value)

    def _nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self._runtime_call("cudaGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
        handles = (ctypes.c_void_p * count.value)()
        self._runtime_call(
            "cudaGraphGetNodes", ctypes.c_void_p(graph), handles, ctypes.byref(count)
        )
        return [h or 0 for h in handles[: count.value]]

    def _node_type(self, node: int) -> int:
        kind = ctypes.c_int(-1)
        self._runtime_call("cudaGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        return int(kind.value)

    def _memcpy_params(self, node: int) -> MemcpyNode | None:
        p = _Memcpy3DParms()
        self._runtime_call("cudaGraphMemcpyNodeGetParams", ctypes.c_void_p(node), ctypes.byref(p))
        if p.srcArray or p.dstArray or p.extent.y != 1 or p.extent.z != 1:
            return None  # not a plain 1-D copy between linear buffers
        return MemcpyNode(node, p.srcPtr.ptr or 0, p.dstPtr.ptr or 0, p.extent.x)

    def memcpy_source_setter(self, graph_exec: int, node: MemcpyNode) -> SourceSetter:
        self._need_runtime("memcpy_source_setter")
        set_params = self._set_params
        exec_handle, node_handle = ctypes.c_void_p(graph_exec), ctypes.c_void_p(node.handle)
        dst, nbytes = ctypes.c_void_p(node.dst), ctypes.c_size_t(node.nbytes)
        clear, name = self._rt.cudaGetLastError, self._runtime_error

        def set_source(src: int) -> str | None:
            status = set_params(exec_handle, node_handle, dst, src, nbytes, _DEVICE_TO_DEVICE)
            if status == 0:
                return None
            clear()  # so torch's next check does not trip on it
            return name(status)

        return set_source


def _loaded_cudart_path() -> str | None:
    """The ``libcudart`` shared library this process has mapped (torch's), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                # address perms offset device inode path: the path may hold spaces.
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if "/libcudart" in path and ".so" in path and not path.endswith("(deleted)"):
                    return path
    except OSError:
        return None
    return None


def _bindings_binding() -> _Bindings | None:
    binding = _Bindings()  # ImportError without cuda-bindings
    # Importing proves little: without a driver, or with a cuda-bindings built for a
    # newer CUDA than the driver's, calls fail. Ask the runtime once, so such a machine
    # falls back to ctypes instead of failing at capture.
    error = binding.device_error()
    if error is not None:
        logger.debug("CUDA binding cuda.bindings cannot reach a device: %s", error)
        return None
    return binding


def _ctypes_binding() -> _Ctypes:
    driver = ctypes.CDLL("libcuda.so.1")  # OSError without an NVIDIA driver
    runtime, path = None, None
    if torch.cuda.is_available():
        torch.cuda.init()  # loads torch's runtime, so the memory map lists it
        path = _loaded_cudart_path()
        if path is not None:
            try:
                runtime = ctypes.CDLL(path)
            except OSError as exc:
                logger.debug("cannot open %s (%s): runtime calls are off", path, exc)
                path = None
    return _Ctypes(driver, runtime, path)


_MAKERS: dict[str, Callable[[], CudaBinding | None]] = {
    "cuda.bindings": _bindings_binding,
    "ctypes": _ctypes_binding,
}


def cuda_binding(prefer: str | None = None) -> CudaBinding | None:
    """The binding to use: ``cuda.bindings`` when it imports and reaches a device,
    else ``ctypes``, else ``None`` (no NVIDIA driver on this machine). Never raises
    for a missing library.

    ``prefer`` names one binding to use alone (``"cuda.bindings"`` or ``"ctypes"``)
    or ``"auto"`` (try them in that order); ``None`` reads ``CUDAGRAPHS_CUDA_BINDING``
    (default ``auto``), so a machine where one binding misbehaves can be switched to
    the other without code. Looked up on each call (an import and a read of the
    memory map); callers look it up once per capture.

    Raises:
        CudaGraphsValueError: ``prefer`` or the variable names no binding.
    """
    if prefer is None:
        prefer = env_choice(BINDING_ENV, ("auto", *BINDINGS), "auto")
    if prefer != "auto" and prefer not in BINDINGS:
        raise CudaGraphsValueError(f"prefer must be 'auto' or one of {BINDINGS}, got {prefer!r}")
    for name in BINDINGS if prefer == "auto" else (prefer,):
        try:
            found = _MAKERS[name]()
        except (ImportError, OSError, AttributeError) as exc:
            logger.debug("CUDA binding %s unavailable: %s", name, exc)
            continue
        if found is not None:
            return found
    return None
