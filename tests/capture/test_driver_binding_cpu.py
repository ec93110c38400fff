"""The CUDA binding layer (``cudagraphs.cuda_binding``) on a machine without a GPU.

Fakes stand in for NVIDIA's ``cuda.bindings`` modules (status-first tuples, enum
statuses, handle wrappers) and for the ctypes libraries (out-parameters written through
``byref``): the factory's order and fallbacks, each binding's calls, its node filter,
its error messages and error clearing, and the source setter's once-only wrapping.
"""

import builtins
import ctypes
import enum
import importlib.metadata
import io
import logging
import sys
import types

import pytest
import torch

import cudagraphs.cuda_binding as cb
from cudagraphs.errors import CudaCallError, CudaGraphsValueError

LOGGER = "cudagraphs.cuda_binding"
BIG = 0x7F00_0000_0000  # addresses past 32 bits must come back exact
NO_RUNTIME = "ctypes (libcuda.so.1; no libcudart loaded (static runtime))"


def _loads(name):
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def _has_cuda_bindings():
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return False
    return True


needs_no_driver = pytest.mark.skipif(_loads("libcuda.so.1"), reason="an NVIDIA driver is here")


# ---- fake cuda.bindings ------------------------------------------------------------


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyDeviceToDevice = 3


class Raw:
    """An int-able object, like the handles and pointers cuda.bindings returns."""

    def __init__(self, value):
        self.value = value

    def __int__(self):
        return self.value


def _handle_type(name, made):
    """A handle class whose constructions are appended to ``made``."""

    def init(self, value):
        self.value = value
        made.append((name, value))

    return type(name, (Raw,), {"__init__": init})


def _params(src, dst, width, height=1, depth=1, src_array=0, dst_array=0):
    ns = types.SimpleNamespace
    return ns(
        srcArray=Raw(src_array),
        dstArray=Raw(dst_array),
        srcPtr=ns(ptr=Raw(src)),
        dstPtr=ns(ptr=Raw(dst)),
        extent=ns(width=width, height=height, depth=depth),
    )


class FakeDriver:
    CUresult = CUresult

    def __init__(self, status=CUresult.CUDA_SUCCESS):
        self.status, self.calls, self.made = status, [], []
        self.CUgraph = _handle_type("CUgraph", self.made)
        self.cuDriverGetVersion = lambda: (self.status, 13000)
        self.cuMemGetInfo = lambda: (self.status, 5 * BIG, 6 * BIG)

    def cuGraphGetNodes(self, graph, count):
        self.calls.append((type(graph).__name__, int(graph), count))
        return (self.status, [], 7)


class FakeRuntime:
    """Status-first answers, a sticky last error, and handle types that count."""

    cudaError_t, cudaMemcpyKind = cudaError_t, cudaMemcpyKind

    def __init__(self, nodes=(), fail=()):
        self.nodes, self.fail, self.calls, self.made = dict(nodes), set(fail), [], []
        self.pending = self.set_status = self.device_status = cudaError_t.cudaSuccess
        self.cleared = 0
        for name in ("cudaGraph_t", "cudaGraphNode_t", "cudaGraphExec_t"):
            setattr(self, name, _handle_type(name, self.made))

    def _answer(self, call, *values):
        self.calls.append(call)
        status = cudaError_t.cudaSuccess
        if call[0] in self.fail:
            self.pending = status = cudaError_t.cudaErrorInvalidValue
        return (status, *values)

    def cudaGetLastError(self):
        self.cleared += 1
        error, self.pending = self.pending, cudaError_t.cudaSuccess
        return (error,)

    def cudaGetDeviceCount(self):
        if self.device_status:
            self.pending = self.device_status
        return (self.device_status, 1)

    def cudaGraphGetNodes(self, graph, count):
        nodes = [Raw(h) for h in self.nodes] if count else []
        call = ("cudaGraphGetNodes", type(graph).__name__, int(graph), count)
        return self._answer(call, nodes, len(self.nodes))

    def cudaGraphNodeGetType(self, node):
        return self._answer(("cudaGraphNodeGetType", int(node)), self.nodes[int(node)][0])

    def cudaGraphMemcpyNodeGetParams(self, node):
        return self._answer(("cudaGraphMemcpyNodeGetParams", int(node)), self.nodes[int(node)][1])

    def cudaGraphExecMemcpyNodeSetParams1D(self, *args):
        self.calls.append(("set", *args))
        if self.set_status:
            self.pending = self.set_status
        return (self.set_status,)


# One graph: a kernel, two plain 1-D copies, and copies the filter must skip.
NODES = {
    0x10: (0, None),  # kernel
    0x20: (1, _params(BIG + 0x1000, BIG + 0x2000, 256)),
    0x30: (1, _params(0x1, 0x2, 8, src_array=0x99)),
    0x40: (1, _params(0x1, 0x2, 8, dst_array=0x99)),
    0x50: (1, _params(0x1, 0x2, 8, height=2)),
    0x60: (1, _params(0x1, 0x2, 8, depth=4)),
    0x70: (1, _params(0x3000, 0x4000, 8)),
}
WANTED = [
    cb.MemcpyNode(0x20, BIG + 0x1000, BIG + 0x2000, 256),
    cb.MemcpyNode(0x70, 0x3000, 0x4000, 8),
]


def _install(monkeypatch, driver=None, runtime=None):
    """Make ``from cuda.bindings import driver, runtime`` find the fakes."""
    driver, runtime = driver or FakeDriver(), runtime or FakeRuntime()
    package = types.ModuleType("cuda.bindings")
    package.driver, package.runtime = driver, runtime
    root = types.ModuleType("cuda")
    root.bindings = package
    for name, mod in [("cuda", root), ("cuda.bindings", package)]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", runtime)
    return driver, runtime


def _no_cuda_bindings(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)  # any import of cuda.* fails
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)


def _bindings(monkeypatch, **runtime):
    driver, rt = _install(monkeypatch, runtime=FakeRuntime(**runtime))
    return cb._Bindings(), driver, rt


# ---- fake ctypes libraries ---------------------------------------------------------


class Fn:
    """A foreign function: records calls, takes ``argtypes``/``restype``."""

    def __init__(self, impl):
        self.impl, self.calls = impl, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.impl(*args)


def _fill(ref, value):
    ref._obj.value = value  # what the C call would write through the pointer
    return 0


class CDriver:
    def __init__(self, status=0, name=b"CUDA_ERROR_INVALID_VALUE", name_status=0):
        self.cuDriverGetVersion = Fn(lambda v: _fill(v, 12080) or status)
        self.cuMemGetInfo_v2 = Fn(lambda f, t: _fill(f, 3 * BIG) or _fill(t, 4 * BIG) or status)
        self.cuGraphGetNodes = Fn(lambda g, nodes, n: _fill(n, 9) or status)
        self.cuGetErrorName = Fn(lambda s, ref: (_fill(ref, name) if name else 0) or name_status)


class CRuntime:
    def __init__(self, nodes=NODES, fail=(), error_name=b"cudaErrorInvalidValue"):
        self.nodes, self.fail, self.pending, self.set_status = nodes, set(fail), 0, 0
        self.cudaGetErrorName = Fn(lambda status: error_name)
        self.cudaGetLastError = Fn(self._clear)
        self.cudaGraphGetNodes = Fn(self._get_nodes)
        self.cudaGraphNodeGetType = Fn(lambda n, k: _fill(k, nodes[n.value][0]) or self._st("type"))
        self.cudaGraphMemcpyNodeGetParams = Fn(self._get_params)
        self.cudaGraphExecMemcpyNodeSetParams1D = Fn(self._set)

    def _st(self, call):
        self.pending = int(call in self.fail)
        return self.pending

    def _clear(self):
        error, self.pending = self.pending, 0
        return error

    def _get_nodes(self, graph, handles, count):
        for i, h in enumerate(list(self.nodes) if handles is not None else []):
            handles[i] = h
        return _fill(count, len(self.nodes)) or self._st("nodes")

    def _get_params(self, node, ref):
        p, q = ref._obj, self.nodes[node.value][1]
        p.srcArray, p.dstArray = int(q.srcArray) or None, int(q.dstArray) or None
        p.srcPtr.ptr, p.dstPtr.ptr = int(q.srcPtr.ptr), int(q.dstPtr.ptr)
        p.extent.x, p.extent.y, p.extent.z = q.extent.width, q.extent.height, q.extent.depth
        return self._st("params")

    def _set(self, *args):
        self.pending = self.set_status
        return self.set_status


# ---- cuda_binding ------------------------------------------------------------------


@needs_no_driver
@pytest.mark.skipif(_has_cuda_bindings(), reason="cuda.bindings is installed")
@pytest.mark.parametrize("prefer", ["auto", "cuda.bindings", "ctypes"])
def test_no_driver_and_no_bindings_gives_none(prefer):
    assert cb.cuda_binding(prefer) is None


@pytest.mark.parametrize("prefer", ["cuda-python", "", "CTYPES", "bindings"])
def test_bad_prefer_is_a_value_error_naming_it(prefer):
    with pytest.raises(CudaGraphsValueError) as info:
        cb.cuda_binding(prefer)
    assert isinstance(info.value, ValueError)
    expected = f"prefer must be 'auto' or one of ('cuda.bindings', 'ctypes'), got {prefer!r}"
    assert str(info.value) == expected


def test_auto_prefers_cuda_bindings(monkeypatch):
    _install(monkeypatch)
    monkeypatch.setitem(cb._MAKERS, "ctypes", lambda: pytest.fail("ctypes tried"))
    found = cb.cuda_binding()
    assert isinstance(found, cb._Bindings) and found.name == "cuda.bindings"
    assert type(cb.cuda_binding("cuda.bindings")) is cb._Bindings


def test_bindings_that_cannot_reach_a_device_give_way_to_ctypes(monkeypatch, caplog):
    # cuda.bindings imports, but its runtime answers "insufficient driver" (a
    # cuda-bindings newer than the driver): auto takes ctypes, and the error is cleared.
    runtime = FakeRuntime()
    runtime.device_status = cudaError_t.cudaErrorInvalidValue
    _install(monkeypatch, runtime=runtime)
    monkeypatch.setitem(cb._MAKERS, "ctypes", lambda: "the ctypes one")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert cb.cuda_binding() == "the ctypes one"
    assert runtime.cleared == 1 and runtime.pending == cudaError_t.cudaSuccess
    assert "cannot reach a device: cudaErrorInvalidValue (1)" in caplog.text
    assert cb.cuda_binding("cuda.bindings") is None


@pytest.mark.parametrize(
    "value, chosen",
    [
        ("ctypes", "ctypes"),
        (" CUDA.Bindings ", "cuda.bindings"),
        ("", "cuda.bindings"),
        ("auto", "cuda.bindings"),
    ],
)
def test_the_environment_picks_the_binding(monkeypatch, value, chosen):
    monkeypatch.setenv("CUDAGRAPHS_CUDA_BINDING", value)
    monkeypatch.setitem(cb._MAKERS, "cuda.bindings", lambda: "cuda.bindings")
    monkeypatch.setitem(cb._MAKERS, "ctypes", lambda: "ctypes")
    assert cb.cuda_binding() == chosen
    assert cb.cuda_binding("ctypes") == "ctypes"  # an explicit prefer wins


def test_a_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_CUDA_BINDING", "cupy")
    with pytest.raises(CudaGraphsValueError) as info:
        cb.cuda_binding()
    assert str(info.value) == (
        "environment variable CUDAGRAPHS_CUDA_BINDING='cupy' is not one of auto, "
        "cuda.bindings, ctypes; set it to one of them, or unset it"
    )


def test_auto_falls_back_to_ctypes_when_the_import_fails(monkeypatch, caplog):
    _no_cuda_bindings(monkeypatch)
    monkeypatch.setattr(cb.ctypes, "CDLL", lambda name: CDriver())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        found = cb.cuda_binding()
    assert isinstance(found, cb._Ctypes) and found.name == "ctypes"
    assert found.has_runtime is False and found.driver_version() == 12080
    [record] = caplog.records
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith("CUDA binding cuda.bindings unavailable: ")


def test_prefer_ctypes_never_touches_cuda_bindings(monkeypatch):
    _install(monkeypatch)
    monkeypatch.setitem(cb._MAKERS, "cuda.bindings", lambda: pytest.fail("cuda.bindings tried"))
    monkeypatch.setitem(cb._MAKERS, "ctypes", lambda: "the ctypes one")
    assert cb.cuda_binding("ctypes") == "the ctypes one"


def test_prefer_cuda_bindings_alone_gives_none_without_it(monkeypatch):
    _no_cuda_bindings(monkeypatch)
    monkeypatch.setitem(cb._MAKERS, "ctypes", lambda: pytest.fail("ctypes tried"))
    assert cb.cuda_binding("cuda.bindings") is None


@pytest.mark.parametrize("exc", [ImportError, OSError, AttributeError, ModuleNotFoundError])
def test_a_maker_failing_to_load_is_skipped_and_logged(monkeypatch, caplog, exc):
    def broken():
        raise exc("boom")

    monkeypatch.setitem(cb._MAKERS, "cuda.bindings", broken)
    monkeypatch.setitem(cb._MAKERS, "ctypes", lambda: "second")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert cb.cuda_binding() == "second"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "CUDA binding cuda.bindings unavailable: boom")
    ]
    monkeypatch.setitem(cb._MAKERS, "ctypes", broken)
    assert cb.cuda_binding() is None


@pytest.mark.parametrize("exc", [RuntimeError, ValueError, TypeError, KeyError])
def test_other_maker_errors_propagate(monkeypatch, exc):
    def broken():
        raise exc("boom")

    monkeypatch.setitem(cb._MAKERS, "cuda.bindings", broken)
    monkeypatch.setitem(cb._MAKERS, "ctypes", lambda: pytest.fail("ctypes tried"))
    with pytest.raises(exc, match="boom"):
        cb.cuda_binding()


# ---- _Bindings ---------------------------------------------------------------------


def test_bindings_driver_calls_and_describe(monkeypatch):
    b, driver, _ = _bindings(monkeypatch)
    assert b.has_runtime is True
    assert b.driver_version() == 13000 and type(b.driver_version()) is int
    assert b.free_memory() == 5 * BIG
    assert b.node_count(0xABC) == 7 and driver.calls == [("CUgraph", 0xABC, 0)]

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert b.describe() == "cuda.bindings (version unknown)"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: f"13.3 of {name}")
    assert b.describe() == "cuda.bindings 13.3 of cuda-bindings"


def test_bindings_driver_failure_names_the_call_and_error(monkeypatch):
    driver, rt = _install(monkeypatch, driver=FakeDriver(CUresult.CUDA_ERROR_INVALID_VALUE))
    b = cb._Bindings()
    with pytest.raises(CudaCallError) as info:
        b.driver_version()
    assert isinstance(info.value, RuntimeError)
    assert str(info.value) == "cuDriverGetVersion failed with CUDA_ERROR_INVALID_VALUE (1)"
    with pytest.raises(CudaCallError, match=r"^cuMemGetInfo failed with CUDA_ERROR_INVALID"):
        b.free_memory()
    assert rt.cleared == 0  # a driver error is not the runtime's sticky error
    driver.status = 5  # a plain int status, no enum name
    with pytest.raises(CudaCallError, match=r"^cuGraphGetNodes failed with error 5$"):
        b.node_count(1)


def test_bindings_memcpy_nodes_keeps_plain_1d_copies(monkeypatch):
    b, _, rt = _bindings(monkeypatch, nodes=NODES)
    assert b.memcpy_nodes(0x1234) == WANTED
    assert rt.calls[:2] == [
        ("cudaGraphGetNodes", "cudaGraph_t", 0x1234, 0),
        ("cudaGraphGetNodes", "cudaGraph_t", 0x1234, len(NODES)),
    ]
    assert [c[1] for c in rt.calls if c[0] == "cudaGraphNodeGetType"] == list(NODES)
    read = [c[1] for c in rt.calls if c[0] == "cudaGraphMemcpyNodeGetParams"]
    assert read == list(NODES)[1:]  # the kernel node is not read
    assert rt.cleared == 0
    rt.nodes.clear()
    assert b.memcpy_nodes(1) == []


@pytest.mark.parametrize(
    "call", ["cudaGraphGetNodes", "cudaGraphNodeGetType", "cudaGraphMemcpyNodeGetParams"]
)
def test_bindings_runtime_failure_names_it_and_clears_it(monkeypatch, call):
    b, _, rt = _bindings(monkeypatch, nodes=NODES, fail=[call])
    with pytest.raises(CudaCallError) as info:
        b.memcpy_nodes(1)
    assert str(info.value) == f"{call} failed with cudaErrorInvalidValue (1)"
    assert rt.cleared == 1 and rt.pending == cudaError_t.cudaSuccess


def test_bindings_source_setter_wraps_once_and_passes_everything(monkeypatch):
    b, _, rt = _bindings(monkeypatch)
    setter = b.memcpy_source_setter(0xE0, cb.MemcpyNode(0x20, BIG + 1, BIG + 2, 4096))
    assert sorted(rt.made) == [("cudaGraphExec_t", 0xE0), ("cudaGraphNode_t", 0x20)]
    sources = (BIG + 10, BIG + 20, 0)
    assert [setter(src) for src in sources] == [None, None, None]
    assert len(rt.made) == 2  # no handle built per call
    sets = [c for c in rt.calls if c[0] == "set"]
    kind = cudaMemcpyKind.cudaMemcpyDeviceToDevice
    assert [c[3:] for c in sets] == [(BIG + 2, src, 4096, kind) for src in sources]
    exec_h, node_h = sets[0][1:3]
    assert (type(exec_h).__name__, int(exec_h)) == ("cudaGraphExec_t", 0xE0)
    assert (type(node_h).__name__, int(node_h)) == ("cudaGraphNode_t", 0x20)
    assert all(c[1] is exec_h and c[2] is node_h for c in sets)
    assert rt.cleared == 0
    rt.set_status = cudaError_t.cudaErrorInvalidValue
    assert setter(6) == "cudaErrorInvalidValue (1)"
    assert rt.cleared == 1 and rt.pending == cudaError_t.cudaSuccess


# ---- _Ctypes -----------------------------------------------------------------------


def test_ctypes_driver_calls_and_setup():
    drv, rt = CDriver(), CRuntime()
    c = cb._Ctypes(drv, rt, "/usr/lib/libcudart.so.13")
    assert c.has_runtime is True and c.runtime_path == "/usr/lib/libcudart.so.13"
    assert c.describe() == "ctypes (libcuda.so.1; /usr/lib/libcudart.so.13)"
    assert c.driver_version() == 12080 and c.free_memory() == 3 * BIG
    assert c.node_count(0xABC) == 9
    graph, nodes, _count = drv.cuGraphGetNodes.calls[0]
    assert graph.value == 0xABC and nodes is None
    assert drv.cuGetErrorName.argtypes == [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    assert rt.cudaGetErrorName.restype is ctypes.c_char_p
    assert rt.cudaGetLastError.restype is ctypes.c_int
    setter = rt.cudaGraphExecMemcpyNodeSetParams1D
    assert setter.argtypes == [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_int]
    assert setter.restype is ctypes.c_int


@pytest.mark.parametrize(
    "name, name_status, shown",
    [
        (b"CUDA_ERROR_INVALID_VALUE", 0, "CUDA_ERROR_INVALID_VALUE (1)"),
        (b"X", 1, "CUresult 1"),  # cuGetErrorName fails
        (None, 0, "CUresult 1"),  # or leaves the name NULL
    ],
)
def test_ctypes_driver_failure_is_named_by_cuGetErrorName(name, name_status, shown):
    drv = CDriver(status=1, name=name, name_status=name_status)
    c = cb._Ctypes(drv, None, None)
    calls = [c.driver_version, c.free_memory, lambda: c.node_count(1)]
    messages = []
    for call in calls:
        with pytest.raises(CudaCallError) as info:
            call()
        assert isinstance(info.value, RuntimeError)
        messages.append(str(info.value))
    names = ["cuDriverGetVersion", "cuMemGetInfo_v2", "cuGraphGetNodes"]
    assert messages == [f"{n} failed with {shown}" for n in names]
    assert [args[0] for args in drv.cuGetErrorName.calls] == [1, 1, 1]


def test_ctypes_memcpy_nodes_keeps_plain_1d_copies():
    rt = CRuntime()
    c = cb._Ctypes(CDriver(), rt, "libcudart.so")
    assert c.memcpy_nodes(0x1234) == WANTED
    first, second = rt.cudaGraphGetNodes.calls
    assert first[0].value == 0x1234 and first[1] is None
    assert second[0].value == 0x1234 and len(second[1]) == len(NODES)
    assert [n.value for n, _ in rt.cudaGraphNodeGetType.calls] == list(NODES)
    assert [n.value for n, _ in rt.cudaGraphMemcpyNodeGetParams.calls] == list(NODES)[1:]
    assert rt.cudaGetLastError.calls == []
    assert cb._Ctypes(CDriver(), CRuntime(nodes={}), None).memcpy_nodes(1) == []


def test_ctypes_reads_a_null_address_as_zero():
    # ctypes reads a NULL c_void_p field as None; the node record holds ints, so a
    # NULL source or destination is 0 (never an address a buffer can have).
    nodes = {0x80: (1, _params(0, 0, 16))}
    found = cb._Ctypes(CDriver(), CRuntime(nodes=nodes), "libcudart.so").memcpy_nodes(7)
    assert found == [cb.MemcpyNode(0x80, 0, 0, 16)]
    assert all(type(v) is int for v in (found[0].src, found[0].dst, found[0].nbytes))


@pytest.mark.parametrize(
    "fail, call, name, shown",
    [
        ("nodes", "cudaGraphGetNodes", b"cudaErrorInvalidValue", "cudaErrorInvalidValue (1)"),
        ("type", "cudaGraphNodeGetType", b"cudaErrorInvalidValue", "cudaErrorInvalidValue (1)"),
        ("params", "cudaGraphMemcpyNodeGetParams", b"cudaErrorX", "cudaErrorX (1)"),
        ("nodes", "cudaGraphGetNodes", None, "cudaError 1"),  # no name from the runtime
    ],
)
def test_ctypes_runtime_failure_names_it_and_clears_it(fail, call, name, shown):
    rt = CRuntime(fail=[fail], error_name=name)
    c = cb._Ctypes(CDriver(), rt, "libcudart.so")
    with pytest.raises(CudaCallError) as info:
        c.memcpy_nodes(1)
    assert str(info.value) == f"{call} failed with {shown}"
    assert rt.cudaGetErrorName.calls == [(1,)]
    assert len(rt.cudaGetLastError.calls) == 1 and rt.pending == 0


def test_ctypes_without_runtime():
    c = cb._Ctypes(CDriver(), None, None)
    assert c.has_runtime is False and c.runtime_path is None
    assert c.describe() == NO_RUNTIME
    for call in ("memcpy_nodes", "memcpy_source_setter"):
        with pytest.raises(CudaCallError) as info:
            getattr(c, call)(*([1] if call == "memcpy_nodes" else [1, WANTED[0]]))
        assert str(info.value) == (
            f"{call} needs the CUDA runtime library, and {NO_RUNTIME} has none; "
            "install cuda-bindings (pip install cudagraphs[speedups])"
        )
    assert c.driver_version() == 12080 and c.free_memory() == 3 * BIG and c.node_count(1) == 9


def test_ctypes_source_setter():
    rt = CRuntime()
    c = cb._Ctypes(CDriver(), rt, "libcudart.so")
    setter = c.memcpy_source_setter(0xE0, cb.MemcpyNode(0x20, BIG + 1, BIG + 2, 4096))
    assert setter(BIG + 10) is None and setter(BIG + 20) is None
    (e, n, dst, src, nbytes, kind), second = rt.cudaGraphExecMemcpyNodeSetParams1D.calls
    got = (e.value, n.value, dst.value, src, nbytes.value, kind)
    assert got == (0xE0, 0x20, BIG + 2, BIG + 10, 4096, 3)
    assert second[3] == BIG + 20  # the rest was wrapped once, at creation
    assert all(a is b for a, b in zip((e, n, dst, nbytes), (*second[:3], second[4])))
    assert rt.cudaGetLastError.calls == []
    rt.set_status = 1
    assert setter(7) == "cudaErrorInvalidValue (1)"
    assert len(rt.cudaGetLastError.calls) == 1 and rt.pending == 0


# ---- _loaded_cudart_path and _ctypes_binding ---------------------------------------

MAPS = (
    "55d0a0000000-55d0a0001000 r--p 00000000 08:01 11 /usr/bin/python3.12\n"
    "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n"
    "7f0000001000-7f0000002000 r--p 00000000 08:01 12 /usr/lib/libcudart_static.a\n"
    "7f0000002000-7f0000003000 r-xp 00000000 08:01 13 /usr/lib/libcudart.so.13\n"
    "7f0000003000-7f0000004000 r-xp 00000000 08:01 14 /opt/other/libcudart.so.12\n"
)


@pytest.mark.parametrize(
    "content, path",
    [
        (None, None),
        (MAPS, "/usr/lib/libcudart.so.13"),
        ("".join(MAPS.splitlines(True)[:3]), None),
        ("", None),
        # A path with spaces is read whole; a library deleted on disk cannot be opened.
        (
            "7f00-7f01 r-xp 00000000 08:01 13 /home/me/My Envs/lib/libcudart.so.13\n",
            "/home/me/My Envs/lib/libcudart.so.13",
        ),
        ("7f00-7f01 r-xp 00000000 08:01 13 /usr/lib/libcudart.so.13 (deleted)\n", None),
    ],
)
def test_loaded_cudart_path(monkeypatch, content, path):
    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        if file != "/proc/self/maps":
            return real_open(file, *args, **kwargs)
        if content is None:
            raise OSError("no /proc here")
        return io.StringIO(content)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert cb._loaded_cudart_path() == path


@needs_no_driver
def test_ctypes_binding_without_a_driver_is_an_os_error():
    with pytest.raises(OSError):
        cb._ctypes_binding()


@pytest.mark.parametrize(
    "available, path, error",
    [
        (False, "/x/libcudart.so.13", None),  # no usable GPU: the map is not read
        (True, None, None),  # a static runtime
        (True, "/x/libcudart.so.13", None),
        (True, "/x/libcudart.so.13", OSError("bad ELF")),
    ],
)
def test_ctypes_binding(monkeypatch, caplog, available, path, error):
    loaded, libs, inits = [], {"libcuda.so.1": CDriver()}, []

    def cdll(name):
        loaded.append(name)
        if name != "libcuda.so.1" and error is not None:
            raise error
        return libs.setdefault(name, CRuntime())

    monkeypatch.setattr(cb.ctypes, "CDLL", cdll)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "init", lambda: inits.append(1))
    monkeypatch.setattr(cb, "_loaded_cudart_path", lambda: path)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        c = cb._ctypes_binding()
    opens_runtime = available and path is not None
    assert isinstance(c, cb._Ctypes) and c._drv is libs["libcuda.so.1"]
    assert inits == ([1] if available else [])
    assert loaded == (["libcuda.so.1", path] if opens_runtime else ["libcuda.so.1"])
    has_runtime = opens_runtime and error is None
    assert c.has_runtime is has_runtime and c._rt is (libs[path] if has_runtime else None)
    assert c.runtime_path == (path if has_runtime else None)
    assert c.driver_version() == 12080
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ([f"cannot open {path} (bad ELF): runtime calls are off"] if error else [])
