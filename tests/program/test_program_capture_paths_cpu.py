"""A program's capture paths on the CPU: ``capture_program`` (warmup, the input buffer,
the capture or, graphs disabled, the eager stand-in), ``capture_function`` into its own
pool and into a shared one, ``run_function_eagerly`` and ``CapturedProgram.stats``.

The device-only calls are stand-ins that record what they were given: the capture
(``capture_into_graph`` / ``capture_with_static_outputs``: the function runs once, as a
capture records it), the pool's streams, the warmup's side stream and the allocator's
figures. Everything else runs as written.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils import _pytree as pytree

from cudagraphs.errors import (
    CudaGraphCaptureError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    SignatureMismatchError,
)
from cudagraphs.program import graph_capture
from cudagraphs.program.buffer import ReusableValueBuffer
from cudagraphs.program.graph_capture import (
    CapturedProgram,
    capture_function,
    capture_program,
    run_function_eagerly,
)
from cudagraphs.program.signature import ValueTreeSignature
from helpers.leaf_types import QuantizedTensor, make_leaf_types
from helpers.staging import FakeRuntime

CPU = torch.device("cpu")


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that reports cuda:0: an output on another device than the program's."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _elsewhere(x):
    return (x + 1).as_subclass(_ReportsCuda)


class Graph:
    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


class Captures:
    """Stand-ins for both captures; ``calls`` records (kind, pool, opts)."""

    def __init__(self):
        self.calls = []
        self.graphs = []

    def own(self, run, pool, **opts):
        self.calls.append(("own", pool, opts))
        self.graphs.append(Graph())
        return self.graphs[-1], run()

    def shared(self, run, like, pool, **opts):
        self.calls.append(("shared", pool, opts))
        self.graphs.append(Graph())
        out = run()
        assert [t.shape for t in out] == [t.shape for t in like], "like sizes the buffers"
        static = [torch.full_like(t, 7.0) for t in like]  # buffers outside the scratch
        return self.graphs[-1], static


@pytest.fixture
def captures(monkeypatch):
    c = Captures()
    monkeypatch.setattr(graph_capture, "capture_into_graph", c.own)
    monkeypatch.setattr(graph_capture, "capture_with_static_outputs", c.shared)
    return c


class Pool:
    """The graph pool's streams, recorded by the device asked for."""

    def __init__(self):
        self.asked = []

    def warmup_stream(self, device):
        self.asked.append(("warmup_stream", device))
        return "warmup-stream"

    def capture_stream(self, device):
        self.asked.append(("capture_stream", device))
        return "capture-stream"


@pytest.fixture
def streams(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def side_stream(stream):
        entered.append(stream)
        yield

    monkeypatch.setattr(graph_capture, "side_stream", side_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return entered


def _buffer(*tensors):
    sig = ValueTreeSignature.from_value(tuple(tensors), path="inputs")
    buf = ReusableValueBuffer(sig, CPU)
    buf.copy_from(tuple(tensors), path="inputs")
    return buf


def _scale(x, y):
    return {"sum": x + y, "twice": (x * 2).requires_grad_()}


def _capture(function, buf, **given):
    """``capture_function`` with a program's usual options, ``given`` overriding them."""
    options = dict(
        last=None,
        graph_pool=object(),
        stream=None,
        shared_pool=False,
        leaf_types=None,
        name="p",
        check_input_liveness=False,
        staging="copy",
    )
    return capture_function(function, buf, **{**options, **given})


# ---- capture_function: its own pool ----------------------------------------------------


def test_own_pool_capture_gets_the_options_and_returns_detached_outputs(captures):
    buf = _buffer(torch.arange(3.0), torch.ones(3))
    pool = object()
    got = _capture(_scale, buf, graph_pool=pool, stream="s", check_input_liveness=True)
    assert captures.calls == [
        (
            "own",
            pool,
            {"stream": "s", "check_input_liveness": True, "what": "program p", "keep_graph": False},
        ),
    ]
    assert got.graph is captures.graphs[0] and got.staging is None
    assert torch.equal(got.output["sum"], torch.tensor([1.0, 2.0, 3.0]))
    assert not got.output["twice"].requires_grad, "outputs are detached views"
    assert got.out_sig == ValueTreeSignature.from_value(got.output, path="output")
    assert captures.graphs[0].resets == 0


def test_an_output_on_another_device_resets_the_graph_and_is_refused(captures):
    buf = _buffer(torch.ones(2))
    with pytest.raises(CudaGraphsTypeError, match=r"\['cuda:0'\].*its device cpu"):
        _capture(_elsewhere, buf)
    assert captures.graphs[0].resets == 1


def test_own_pool_staging_auto_on_the_cpu_is_copies(captures):
    buf = _buffer(torch.ones(2))
    got = _capture(lambda x: x + 1, buf, staging="auto")
    assert captures.calls[0][2]["keep_graph"] is False and got.staging is None


# ---- capture_function: a shared pool -----------------------------------------------------


def test_shared_pool_outputs_are_the_buffers_sized_by_the_last_warmup(captures):
    x, y = torch.arange(3.0), torch.ones(3)
    buf = _buffer(x, y)
    last = _scale(x, y)
    pool = object()
    got = _capture(_scale, buf, last=last, graph_pool=pool, stream="s", shared_pool=True, name="q")
    assert [c[:2] for c in captures.calls] == [("shared", pool)]
    assert captures.calls[0][2]["what"] == "program q"
    leaves = pytree.tree_leaves(got.output)
    assert all(torch.equal(t, torch.full((3,), 7.0)) for t in leaves)
    assert set(got.output) == {"sum", "twice"} and got.staging is None
    assert got.graph is captures.graphs[0]
    assert got.out_sig == ValueTreeSignature.from_value(got.output, path="output")


def test_shared_pool_refuses_a_warmup_output_on_another_device_before_capturing(captures):
    buf = _buffer(torch.ones(2))
    with pytest.raises(CudaGraphsTypeError, match="cuda:0"):
        _capture(_elsewhere, buf, last=_elsewhere(torch.ones(2)), shared_pool=True)
    assert captures.calls == []


# ---- run_function_eagerly ------------------------------------------------------------------


def test_graphs_disabled_replays_run_eagerly_into_the_same_output(caplog):
    buf = _buffer(torch.arange(3.0), torch.ones(3))
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        got = run_function_eagerly(_scale, buf, None, "prog")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "CUDAGRAPHS_DISABLE" in said[0] and "prog" in said[0]
    out = got.output
    assert torch.equal(out["sum"], torch.tensor([1.0, 2.0, 3.0]))
    assert not out["twice"].requires_grad and got.staging is None
    buf.copy_from((torch.full((3,), 2.0), torch.zeros(3)), path="inputs")
    got.graph.replay()
    assert got.output is out, "callers borrow one output tree"
    assert torch.equal(out["sum"], torch.full((3,), 2.0))
    assert torch.equal(out["twice"], torch.full((3,), 4.0))
    assert got.out_sig == ValueTreeSignature.from_value(out, path="output")


def test_graphs_disabled_refuses_outputs_on_another_device():
    buf = _buffer(torch.ones(2))
    with pytest.raises(CudaGraphsTypeError, match="cuda:0"):
        run_function_eagerly(_elsewhere, buf, None, "p")


# ---- capture_program ---------------------------------------------------------------------


def _program(function, inputs, *, disabled, warmup=2, pool=None, leaf_types=None, live=False):
    sig = ValueTreeSignature.from_value(inputs, path="inputs", leaf_types=leaf_types)
    return capture_program(
        function,
        inputs,
        sig,
        CPU,
        warmup=warmup,
        pool=pool,
        leaf_types=leaf_types,
        check_input_liveness=live,
        staging="copy",
        disabled=disabled,
    )


def test_a_disabled_program_skips_the_warmup_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(graph_capture, "warm_up", lambda *a, **k: pytest.fail("warmed up"))
    x, y = torch.arange(3.0), torch.ones(3)
    got = _program(_scale, (x, y), disabled=True)
    assert isinstance(got, CapturedProgram)
    assert got.name == "_scale" and got.device == CPU and got.last is None
    assert got.warmup_iterations == 2 and got.pool is None and got.graph_pool is not None
    assert [t is x or t is y for t in got.buffer.tensors] == [False, False]
    assert torch.equal(got.buffer.tensors[0], x) and torch.equal(got.buffer.tensors[1], y)
    assert torch.equal(got.captured.output["sum"], x + y)
    assert 0 <= got.warmup_seconds < 60 and 0 <= got.capture_seconds < 60


def test_a_program_warms_up_on_the_pools_streams_then_captures(monkeypatch, captures, streams):
    pool = Pool()
    monkeypatch.setattr(graph_capture, "GraphMemoryPool", lambda: pool)
    calls = []

    def function(x, y):
        calls.append(1)
        return _scale(x, y)

    x, y = torch.arange(3.0), torch.ones(3)
    got = _program(function, (x, y), disabled=False, warmup=3)
    assert pool.asked == [("warmup_stream", CPU), ("capture_stream", CPU)]
    assert streams == ["warmup-stream"]
    assert len(calls) == 4, "three warmup runs and the capture"
    assert captures.calls[0][0] == "own" and captures.calls[0][1] is pool
    assert captures.calls[0][2]["stream"] == "capture-stream"
    assert got.graph_pool is pool and got.pool is None
    assert torch.equal(got.last["sum"], x + y)
    assert got.name.endswith("function") and got.warmup_iterations == 3


def test_a_program_in_a_shared_pool_captures_with_static_outputs(captures, streams):
    pool = SimpleNamespace(graph_pool=Pool())
    x = torch.arange(2.0)
    got = _program(lambda a: (a * 3,), (x,), disabled=False, warmup=1, pool=pool)
    assert [c[0] for c in captures.calls] == ["shared"]
    assert captures.calls[0][1] is pool.graph_pool
    assert got.pool is pool and got.graph_pool is None
    assert torch.equal(got.captured.output[0], torch.full((2,), 7.0))


def test_stats_report_the_capture_and_the_allocator_now(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: asked.append(d) or 11)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: asked.append(d) or 22)
    got = _program(_scale, (torch.ones(2), torch.ones(2)), disabled=True, warmup=4)
    stats = got.stats(first_replay_seconds=0.5)
    assert stats.warmup_iterations == 4 and stats.first_replay_seconds == 0.5
    assert stats.warmup_seconds == got.warmup_seconds
    assert stats.capture_seconds == got.capture_seconds
    assert (stats.memory_allocated_bytes, stats.memory_reserved_bytes) == (11, 22)
    assert asked == [CPU, CPU]
    assert got.stats().first_replay_seconds == 0.0


# ---- registered leaf types in the outputs ------------------------------------------------


def _quantize(x):
    return {"q": QuantizedTensor((x * 10).to(torch.int8), x.sum().reshape(1), 2), "x": x + 1}


@pytest.mark.parametrize("shared", [False, True], ids=["own_pool", "shared_pool"])
def test_outputs_with_registered_leaves_are_described_with_the_leaf_types(captures, shared):
    leaf_types = make_leaf_types()
    x = torch.arange(4.0)
    buf = _buffer(x)
    got = _capture(_quantize, buf, last=_quantize(x), shared_pool=shared, leaf_types=leaf_types)
    assert got.graph is captures.graphs[0]
    assert isinstance(got.output["q"], QuantizedTensor) and got.output["q"].block == 2
    assert got.out_sig == ValueTreeSignature.from_value(
        got.output, path="output", leaf_types=leaf_types
    )
    if not shared:
        assert torch.equal(got.output["q"].data, (x * 10).to(torch.int8))


def test_graphs_disabled_outputs_with_registered_leaves_replay_into_them():
    leaf_types = make_leaf_types()
    buf = _buffer(torch.arange(4.0))
    got = run_function_eagerly(_quantize, buf, leaf_types, "p")
    q = got.output["q"]
    buf.copy_from((torch.ones(4),), path="inputs")
    got.graph.replay()
    assert got.output["q"] is q, "callers borrow one output tree"
    assert torch.equal(got.output["q"].data, torch.full((4,), 10, dtype=torch.int8))
    assert torch.equal(got.output["q"].scale, torch.tensor([4.0]))


def test_a_program_keeps_what_it_was_made_of_and_hands_it_to_the_capture(
    monkeypatch, captures, streams
):
    monkeypatch.setattr(graph_capture, "GraphMemoryPool", Pool)
    leaf_types = make_leaf_types()
    x = torch.arange(4.0)
    got = _program(_quantize, (x,), disabled=False, warmup=1, leaf_types=leaf_types, live=True)
    opts = captures.calls[0][2]
    assert opts["what"] == "program _quantize" and opts["check_input_liveness"] is True
    assert got.function is _quantize and got.leaf_types is leaf_types
    assert got.signature == ValueTreeSignature.from_value((x,), path="inputs")
    assert isinstance(got.captured.output["q"], QuantizedTensor)


def test_a_program_without_a_qualname_is_named_by_its_type(captures, streams):
    class Scaler:
        def __call__(self, x):
            return x * 2

    got = _program(Scaler(), (torch.ones(2),), disabled=True)
    assert got.name == "Scaler"


def test_a_disabled_program_with_registered_leaves_replays_eagerly(caplog):
    leaf_types = make_leaf_types()
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        got = _program(_quantize, (torch.arange(4.0),), disabled=True, leaf_types=leaf_types)
    assert isinstance(got.captured.output["q"], QuantizedTensor)
    assert "program _quantize is not captured" in caplog.text


# ---- capture_function: in-graph staging (a fake CUDA runtime) ---------------------------


class StagedGraph(Graph):
    """A captured graph whose raw handles the fake runtime knows; counts instantiation."""

    def __init__(self):
        super().__init__()
        self.instantiated = 0

    def instantiate(self):
        self.instantiated += 1

    def raw_cuda_graph(self):
        return 11

    def raw_cuda_graph_exec(self):
        return 22


class Runtime(FakeRuntime):
    """The fake runtime, whose memcpy nodes are the copies staged_arguments made (found
    once the capture has run): one per staged input, unless ``nodes=False``."""

    def __init__(self, buf, read, nodes=True):
        super().__init__([])
        self.buf, self.read, self.give = buf, read, nodes

    def memcpy_nodes(self, graph):
        assert graph == 11
        if not self.give:
            return []
        return [
            SimpleNamespace(src=home.data_ptr(), dst=inner, nbytes=home.nbytes, handle=i)
            for i, (home, inner) in enumerate(zip(self.buf.tensors, self.read))
        ]


@pytest.fixture
def staged(monkeypatch):
    """Captures that make :class:`StagedGraph` objects, and ``runtime(buf, nodes)``
    installing a :class:`Runtime` as the one ``runtime_for`` finds."""
    c = Captures()

    def own(run, pool, **opts):
        c.calls.append(("own", pool, opts))
        c.graphs.append(StagedGraph())
        return c.graphs[-1], run()

    def shared(run, like, pool, **opts):
        c.calls.append(("shared", pool, opts))
        c.graphs.append(StagedGraph())
        return c.graphs[-1], [t.clone() for t in run()]

    monkeypatch.setattr(graph_capture, "capture_into_graph", own)
    monkeypatch.setattr(graph_capture, "capture_with_static_outputs", shared)

    def runtime(buf, read, nodes=True):
        rt = Runtime(buf, read, nodes)
        monkeypatch.setattr(graph_capture, "runtime_for", lambda mode: rt)
        return rt

    c.runtime = runtime
    return c


def _reading(read):
    """x + y that records the addresses of the tensors it was given."""

    def f(x, y):
        read[:] = [x.data_ptr(), y.data_ptr()]
        return {"sum": x + y}

    return f


@pytest.mark.parametrize("shared_pool", [False, True], ids=["own", "shared"])
def test_graph_staging_reads_copies_made_inside_the_graph_and_stages_each(staged, shared_pool):
    x, y = torch.arange(3.0), torch.ones(3)
    buf = _buffer(x, y)
    read: list[int] = []
    rt = staged.runtime(buf, read)
    last = {"sum": x + y}
    got = _capture(_reading(read), buf, staging="graph", shared_pool=shared_pool, last=last)
    assert staged.calls[0][2]["keep_graph"] is True, "node updates need the cudaGraph_t"
    homes = [t.data_ptr() for t in buf.tensors]
    assert read and not set(read) & set(homes), "the function read copies, not the buffers"
    assert torch.equal(got.output["sum"], x + y)
    assert staged.graphs[0].instantiated == 1
    assert [(s.index, s.home.data_ptr(), s.dst) for s in got.staging.inputs] == [
        (0, homes[0], read[0]),
        (1, homes[1], read[1]),
    ]
    assert rt.calls == []


def test_graph_staging_without_a_node_to_update_is_copies(staged):
    buf = _buffer(torch.arange(3.0), torch.ones(3))
    read: list[int] = []
    staged.runtime(buf, read, nodes=False)
    got = _capture(_reading(read), buf, staging="graph")
    assert got.staging is None, "torch copied with kernels: the inputs stay copy-fed"


def test_copy_staging_reads_the_buffers_themselves(staged):
    buf = _buffer(torch.arange(3.0), torch.ones(3))
    read: list[int] = []
    staged.runtime(buf, read)
    got = _capture(_reading(read), buf, staging="copy")
    assert read == [t.data_ptr() for t in buf.tensors] and got.staging is None
    assert staged.calls[0][2]["keep_graph"] is False


def test_a_shared_pool_capture_whose_output_changed_names_the_output_path(captures):
    x = torch.arange(3.0)
    buf = _buffer(x, torch.ones(3))
    with pytest.raises(SignatureMismatchError, match=r"output\['sum'\]: shape"):
        _capture(lambda a, b: {"sum": torch.cat([a, b])}, buf, last={"sum": x}, shared_pool=True)


def test_graphs_disabled_runs_the_function_once_to_set_up_and_names_it_in_errors(caplog):
    calls = []

    def f(x):
        calls.append(1)
        return {"y": x + 1} if len(calls) < 3 else {"y": torch.cat([x, x])}

    buf = _buffer(torch.ones(2))
    got = run_function_eagerly(f, buf, None, "p")
    assert len(calls) == 1, "one run sizes the output buffers"
    got.graph.replay()
    with pytest.raises(SignatureMismatchError, match=r"output\['y'\]: shape"):
        got.graph.replay()


def test_a_program_whose_warmup_fails_is_named_by_its_function(monkeypatch, captures, streams):
    monkeypatch.setattr(graph_capture, "GraphMemoryPool", Pool)

    def decode_step(x):
        raise RuntimeError("boom")

    with pytest.raises(CudaGraphCaptureError) as info:
        _program(decode_step, (torch.ones(2),), disabled=False, warmup=1)
    assert str(info.value).startswith("warmup of program ") and str(info.value).endswith(
        "decode_step failed: boom"
    )
    assert captures.calls == [], "nothing captured"


def test_graphs_disabled_a_replay_after_reset_names_the_program():
    got = run_function_eagerly(lambda x: x + 1, _buffer(torch.ones(2)), None, "p")
    got.graph.reset()
    with pytest.raises(CudaGraphsStateError, match=r"^program p: replay\(\) after reset\(\)$"):
        got.graph.replay()


def test_the_first_replay_check_takes_nan_where_the_warmup_had_nan():
    # A masked softmax's fully padded row is NaN at every run: a fixed schedule.
    same = graph_capture._same_values
    nan = float("nan")
    assert same(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    assert not same(torch.tensor([nan, 1.0]), torch.tensor([nan, 2.0]))
    assert not same(torch.tensor([nan, 1.0]), torch.tensor([1.0, nan]))
    assert same(torch.tensor([1, 2]), torch.tensor([1, 2]))


def test_a_function_that_writes_into_its_inputs_is_refused_naming_them():
    a, b = torch.zeros(3), torch.zeros(3)
    versions = [graph_capture.tensor_version(t) for t in (a, b)]
    graph_capture._refuse_written_inputs([a, b], versions, "p")  # nothing written
    b.add_(1)
    with pytest.raises(CudaGraphsValueError, match=r"writes into input tensors \[1\]"):
        graph_capture._refuse_written_inputs([a, b], versions, "p")


def test_outputs_in_an_inputs_memory_are_copied_inside_the_graph():
    # step(cur, prev) -> (2 * cur - prev, cur): the pass-through fed back as the next
    # input would be read after the next call's copy overwrote it.
    cur, prev = torch.ones(3), torch.zeros(3)
    new = 2 * cur - prev
    out = graph_capture._own_outputs({"new": new, "cur": cur, "view": prev[1:]}, [cur, prev])
    assert out["new"] is new  # the function's own memory: handed out as it is
    assert out["cur"] is not cur and torch.equal(out["cur"], cur)
    assert out["cur"].untyped_storage().data_ptr() != cur.untyped_storage().data_ptr()
    assert out["view"].untyped_storage().data_ptr() != prev.untyped_storage().data_ptr()
