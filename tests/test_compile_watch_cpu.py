"""``cudagraphs.compile_watch`` against real dynamo on the CPU (the ``eager`` backend:
dynamo's guards, recompiles and records are the same whatever the backend)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cudagraphs.compile_watch import (
    CompiledFrame,
    CompileReport,
    CompileWatch,
    recompile_fix,
    require_no_compile,
    require_no_torch_graphs,
)
from cudagraphs.errors import CompiledCaptureError, CudaGraphCaptureError


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _watched(fn, *args):
    watch = CompileWatch.start()
    fn(*args)
    return watch.finish()


def test_a_first_call_compiles_one_frame_and_the_next_nothing():
    def scale_by_two(x):
        return x * 2

    compiled = torch.compile(scale_by_two, backend="eager")
    first = _watched(compiled, torch.ones(3))
    assert [f.name for f in first.frames] == ["scale_by_two"]
    assert first.recompiles == () and first.seconds > 0
    assert "test_compile_watch_cpu.py:" in first.frames[0].where
    assert _watched(compiled, torch.ones(3)).frames == ()


def test_a_guard_on_a_changed_python_value_is_a_recompile_named_with_its_fix():
    factor = {"value": 2.0}

    def scaled(x):
        return x * factor["value"]

    compiled = torch.compile(scaled, backend="eager")
    compiled(torch.ones(3))
    factor["value"] = 3.0
    report = _watched(compiled, torch.ones(3))
    assert [f.name for f in report.recompiles] == ["scaled"]
    with pytest.raises(CompiledCaptureError) as err:
        require_no_compile(report, "the capture", "graph_train_step")
    text = str(err.value)
    assert "graph_train_step" in text and "during the capture" in text
    assert "scaled" in text and "recompiled because" in text
    assert "Python value" in text and "device tensor" in text
    assert isinstance(err.value, CudaGraphCaptureError)


def test_a_changed_shape_is_a_recompile_whose_fix_is_fixed_shapes():
    def doubled(x):
        return x + x

    compiled = torch.compile(doubled, backend="eager", dynamic=False)
    compiled(torch.ones(3))
    report = _watched(compiled, torch.ones(5))
    (frame,) = report.recompiles
    assert "shape" in recompile_fix(frame.recompile_reason)
    with pytest.raises(CompiledCaptureError, match="one shape"):
        require_no_compile(report, "the last warmup step", "graph_train_step")


def test_a_frame_compiled_before_the_watch_is_not_counted():
    def tripled(x):
        return x * 3

    compiled = torch.compile(tripled, backend="eager")
    compiled(torch.ones(2))
    watch = CompileWatch.start()
    assert watch.finish().frames == ()


def test_a_first_compile_in_a_phase_that_must_compile_nothing_says_warm_up_more():
    report = CompileReport((CompiledFrame("f", "m.py:1", "0/0", 1.5, None, 0),))
    with pytest.raises(CompiledCaptureError, match="compiled for the first time; warm up"):
        require_no_compile(report, "the last warmup step", "graph_train_step")
    require_no_compile(CompileReport(), "the capture", "graph_train_step")  # nothing: fine


def test_reports_add_frames_in_order_and_sum_seconds_and_breaks():
    a = CompiledFrame("a", "m.py:1", "0/0", 1.0, None, 1)
    b = CompiledFrame("b", "m.py:9", "1/1", 0.5, "L['x'] changed", 2)
    total = CompileReport((a,), 1) + CompileReport((b,))
    assert total.frames == (a, b) and total.torch_graphs == 1
    assert total.seconds == 1.5 and total.graph_breaks == 3 and total.recompiles == (b,)


def test_torch_compiles_own_cuda_graphs_are_refused_with_the_modes_to_use():
    require_no_torch_graphs(CompileReport(), "graph_train_step")
    with pytest.raises(CompiledCaptureError) as err:
        require_no_torch_graphs(CompileReport(torch_graphs=2), "graph_train_step")
    assert "reduce-overhead" in str(err.value) and "max-autotune-no-cudagraphs" in str(err.value)


@pytest.mark.parametrize(
    ("reason", "says"),
    [
        ("size mismatch at index 0. expected 3, actual 5", "shape"),
        ("tensor 'L['x']' stride mismatch at index 1", "shape"),
        ("___check_global_state()", "grad mode"),
        ("G['factor']['value'] == 2.0", "Python value"),
    ],
)
def test_recompile_fix_names_the_cause_of_each_kind_of_failed_guard(reason, says):
    assert says in recompile_fix(reason)


def test_nothing_is_imported_when_dynamo_was_never_loaded():
    code = (
        "import sys; from cudagraphs.compile_watch import CompileWatch; "
        "w = CompileWatch.start(); r = w.finish(); "
        "print(r.frames, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["()", "False"]
