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
from cudagraphs.errors import CompiledCaptureError, CudaGraphCaptureError, CudaGraphsValueError

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


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
    total = CompileReport((a,), 1) + CompileReport((b,), 2)
    assert total.frames == (a, b) and total.torch_graphs == 3
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
        # dynamo's own text: the guard, then the source line that read the value.
        (
            "0/0: fn._modules['1'].training == True    # return F.dropout(input, self.p, "
            "self.training, self.inplace)  # nn/modules/dropout.py:70",
            "train/eval mode",
        ),
        ("1/0: s.window_size == 4    # return x[:, : s.window_size].sum()", "Python value"),
        ("0/1: G['Cfg'].temperature == 1.0    # return (x / t).softmax(dim=-1)", "Python value"),
        ("0/2: 2 <= L['x'].size()[0]    # return x * 2", "shape"),
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


# ---- the watch's logic on dynamo's records, exactly (records stood in for) -------------


def _record(**fields):
    from types import SimpleNamespace

    base = dict(
        co_name="layer_forward",
        co_filename="model.py",
        co_firstlineno=12,
        compile_id="0/1",
        entire_frame_compile_time_s=1.5,
        backward_cumulative_compile_time_us=250_000,
        recompile_reason="L['x'].size()[0] == 4",
        num_graph_breaks=2,
        start_time_us=1_000,
    )
    return SimpleNamespace(**{**base, **fields})


@pytest.fixture
def records(monkeypatch):
    """dynamo as loaded, its records the list returned, CUDA-graph trees counted from
    the list ``trees`` (one value per question)."""
    import cudagraphs.compile_watch as cw

    held: list = []
    trees: list[int] = []
    asked: list[int] = []

    def count(device_index):
        asked.append(device_index)
        return trees.pop(0)

    monkeypatch.setattr(cw, "dynamo_loaded", lambda: True)
    monkeypatch.setattr(cw, "compilation_metrics", lambda: list(held))
    monkeypatch.setattr(cw, "cudagraph_tree_functions", count)
    monkeypatch.setattr(cw.time, "time_ns", lambda: 1_000_000)  # the watch starts at 1000 us
    return held, trees, asked


def test_a_record_becomes_a_frame_field_by_field(records):
    held, _, _ = records
    held.append(_record())
    (frame,) = CompileWatch.start().finish().frames
    assert frame == CompiledFrame(
        name="layer_forward",
        where="model.py:12",
        compile_id="0/1",
        seconds=1.75,  # the frame's 1.5 s and its backward's 0.25 s
        recompile_reason="L['x'].size()[0] == 4",
        graph_breaks=2,
    )
    assert frame.label == "layer_forward (model.py:12, compile 0/1)"


def test_a_record_missing_fields_still_becomes_a_frame(records):
    held, _, _ = records
    held.append(
        _record(
            co_name=None,
            co_firstlineno=None,
            compile_id=None,
            entire_frame_compile_time_s=None,
            backward_cumulative_compile_time_us=None,
            recompile_reason="",
            num_graph_breaks=None,
        )
    )
    (frame,) = CompileWatch.start().finish().frames
    assert frame == CompiledFrame("?", "model.py", "?", 0.0, None, 0)


def test_only_records_started_at_or_after_the_watch_count(records):
    held, _, _ = records
    held += [
        _record(co_name="before", start_time_us=999),
        _record(co_name="at", start_time_us=1_000),
        _record(co_name="after", start_time_us=5_000),
        _record(co_name="untimed", start_time_us=None),
    ]
    assert [f.name for f in CompileWatch.start().finish().frames] == ["at", "after"]


def test_without_dynamo_loaded_no_record_is_read(records, monkeypatch):
    import cudagraphs.compile_watch as cw

    held, _, _ = records
    held.append(_record())
    monkeypatch.setattr(cw, "dynamo_loaded", lambda: False)
    assert CompileWatch.start().finish() == CompileReport()


def test_torch_graphs_count_what_the_trees_ran_during_the_watch_on_its_device(records):
    _, trees, asked = records
    trees += [3, 5]
    assert CompileWatch.start(1).finish().torch_graphs == 2
    assert asked == [1, 1]
    trees += [4, 1]  # the trees were reset meanwhile: nothing new counted
    assert CompileWatch.start(0).finish().torch_graphs == 0
    asked.clear()
    assert CompileWatch.start().finish().torch_graphs == 0  # no device: trees not asked
    assert asked == []


def test_recompile_fix_says_each_fix_word_for_word():
    assert recompile_fix("Size mismatch at index 0") == (
        "a tensor's shape or strides changed between steps: graphs have fixed shapes, "
        "so give every step inputs of one shape (pad them), or compile with "
        "dynamic=False so that each shape is compiled once and can be warmed up"
    )
    assert recompile_fix("tensor 'x' rank mismatch. expected 1, actual 2") == (
        recompile_fix("stride mismatch")
    )
    assert recompile_fix("GRAD_MODE changed") == (
        "grad mode or autocast differed from the warmup's: run warmup and capture "
        "under the same modes as the steps themselves"
    )
    assert recompile_fix("autocast state") == recompile_fix("___check_global_state()")
    assert recompile_fix("L['step'] == 3") == (
        "the compiled code reads a Python value that changed between steps (a step "
        "counter, a float hyperparameter, an attribute): hold it in a device tensor "
        "updated in place, or keep it constant while graphed"
    )


def test_the_refusal_lists_every_frame_word_for_word():
    first = CompiledFrame("f", "m.py:1", "0/0", 1.0, None, 0)
    again = CompiledFrame("g", "m.py:9", "1/1", 0.5, "L['n']  ==\n 3", 0)
    with pytest.raises(CompiledCaptureError) as err:
        require_no_compile(CompileReport((first, again)), "the capture", "graph_train_step")
    assert str(err.value) == (
        "graph_train_step: torch.compile compiled 2 frame(s) during the capture, which "
        "must run code compiled before it:\n"
        "- f (m.py:1, compile 0/0): compiled for the first time; warm up with more steps "
        "(each must run the compiled code as the graphed steps will)\n"
        "- g (m.py:9, compile 1/1): recompiled because L['n'] == 3; " + recompile_fix("L['n'] == 3")
    )
    cause = RuntimeError("capture failed")
    with pytest.raises(CompiledCaptureError) as err:
        require_no_compile(CompileReport((first,)), "the capture", "x", cause)
    assert err.value.__cause__ is cause


def test_the_torch_graphs_refusal_word_for_word():
    with pytest.raises(CompiledCaptureError) as err:
        require_no_torch_graphs(CompileReport(torch_graphs=3), "make_graphed_callables")
    assert str(err.value) == (
        "make_graphed_callables: the compiled code runs torch.compile's own CUDA graphs "
        '(mode="reduce-overhead": 3 function(s) warmed up or recorded), which cannot be '
        'captured inside ours. Compile with mode="default" or '
        'mode="max-autotune-no-cudagraphs": our graph takes the place of torch\'s.'
    )


def test_a_record_without_the_optional_fields_becomes_a_frame(records):
    from types import SimpleNamespace

    held, _, _ = records
    held.append(SimpleNamespace(start_time_us=2_000))  # a torch that records less
    held.append(SimpleNamespace())  # and one without a start time: not counted
    (frame,) = CompileWatch.start().finish().frames
    assert frame == CompiledFrame("?", "?", "?", 0.0, None, 0)


def test_a_record_in_the_watchs_first_microsecond_counts(records, monkeypatch):
    import cudagraphs.compile_watch as cw

    held, _, _ = records
    monkeypatch.setattr(cw.time, "time_ns", lambda: 1_000_999)  # 1000.999 us
    held.append(_record(start_time_us=1_000))
    assert len(CompileWatch.start().finish().frames) == 1


def test_a_nameless_frame_given_up_is_named_after_an_earlier_record_of_its_frame(records):
    # dynamo's record of a frame given up at its recompile limit has no code name or
    # file; an earlier compile of the same frame (before the watch) says which it is.
    held, _, _ = records
    held.append(_record(co_name="partial_LlamaDecoderLayer", compile_id="3/7", start_time_us=1))
    given_up = _record(
        co_name=None,
        co_filename=None,
        co_firstlineno=None,
        compile_id="3/8",
        fail_type="Unsupported",
        fail_reason="Dynamo recompile limit exceeded",
    )
    other = _record(**{**vars(given_up), "compile_id": "5/8"})  # frame 5: no record
    held.extend([given_up, other])
    frames = CompileWatch.start().finish().frames
    assert [(f.name, f.where, f.compile_id) for f in frames] == [
        ("partial_LlamaDecoderLayer", "model.py:12", "3/8"),
        ("?", "?", "5/8"),
    ]


def test_a_frame_dynamo_gave_up_carries_its_failure_and_is_no_compile(records):
    held, _, _ = records
    held.append(
        _record(
            fail_type="Unsupported",
            fail_reason="Dynamo recompile limit exceeded\n  Explanation: too many",
            recompile_reason=None,
        )
    )
    held.append(_record(fail_type=None, fail_reason=None))
    report = CompileWatch.start().finish()
    failed, compiled = report.frames
    assert failed.failure == "Unsupported: Dynamo recompile limit exceeded"
    assert compiled.failure is None
    assert report.failures == (failed,)
    # Only the compiled frame is a compile in the phase.
    with pytest.raises(CompiledCaptureError, match=r"compiled 1 frame\(s\) during"):
        require_no_compile(report, "the capture", "here")
    require_no_compile(CompileReport((failed,)), "the capture", "here")  # no compile
    bare = _record(fail_type="Unsupported", fail_reason=None)
    held[:] = [bare]
    assert CompileWatch.start().finish().frames[0].failure == "Unsupported"
    # A record of a torch whose metrics have no fail_reason field at all.
    without = _record(fail_type="Unsupported")
    held[:] = [without]
    assert CompileWatch.start().finish().frames[0].failure == "Unsupported"


def test_frames_dynamo_gave_up_are_said_at_warning_with_the_fix(caplog):
    import logging

    from cudagraphs.compile_watch import warn_failed_compiles

    limit = CompiledFrame(
        "f", "m.py:1", "0/8", 0.0, None, 0, "Unsupported: Dynamo recompile limit exceeded"
    )
    other = CompiledFrame("g", "m.py:9", "1/0", 0.0, None, 0, "Unsupported: generator")
    log = logging.getLogger("cudagraphs.test_watch")
    with caplog.at_level(logging.WARNING, logger="cudagraphs.test_watch"):
        assert warn_failed_compiles(CompileReport((limit, other)), "here", log) == 2
        assert warn_failed_compiles(CompileReport(), "here", log) == 0
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "here: dynamo gave up compiling f (m.py:1, compile 0/8) (Unsupported: Dynamo "
        "recompile limit exceeded): it runs eagerly, and the graph records its eager "
        "kernels. Fix: fewer distinct shapes, guarded Python values or module structures "
        "through this function, or a larger recompile_limit in dynamo's config.",
        "here: dynamo gave up compiling g (m.py:9, compile 1/0) (Unsupported: generator): "
        "it runs eagerly, and the graph records its eager kernels. Fix: the cause dynamo "
        "names (TORCH_LOGS=graph_breaks,recompiles).",
    ]


def test_real_dynamo_records_the_frame_it_gives_up_at_its_recompile_limit():
    torch._dynamo.config.recompile_limit  # noqa: B018  (the limit this relies on exists)
    from torch import nn

    def run(m, x):
        return m(x)

    compiled = torch.compile(run, backend="eager")
    watch = CompileWatch.start()
    with torch._dynamo.config.patch(recompile_limit=2):
        for width in (3, 4, 5):
            # Each a new module class: a new guard on the module's type, a recompile.
            cls = type(f"M{width}", (nn.Linear,), {})
            compiled(cls(2, width), torch.randn(1, 2))
    report = watch.finish()
    assert len(report.failures) == 1, report
    assert "recompile limit" in report.failures[0].failure.lower()


def test_check_warmup_refuses_trees_and_a_last_compile_and_says_what_dynamo_gave_up(caplog):
    import logging

    from cudagraphs.compile_watch import check_warmup

    log = logging.getLogger("cudagraphs.test_watch")
    compiled = CompiledFrame("f", "m.py:1", "0/0", 1.0, None, 0)
    failed = CompiledFrame("g", "m.py:9", "1/0", 0.0, None, 0, "Unsupported: generator")
    check_warmup(CompileReport((compiled,)), CompileReport(), "here", "the last step", log)
    with pytest.raises(CompiledCaptureError, match="during the last step"):
        check_warmup(
            CompileReport((compiled,)), CompileReport((compiled,)), "here", "the last step", log
        )
    with pytest.raises(CompiledCaptureError, match="CUDA graphs"):
        check_warmup(CompileReport(torch_graphs=1), CompileReport(), "here", "the last step", log)
    with caplog.at_level(logging.WARNING, logger="cudagraphs.test_watch"):
        # A frame given up in the last step is said, and is no compile there.
        check_warmup(
            CompileReport((failed,)), CompileReport((failed,)), "here", "the last step", log
        )
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "here: dynamo gave up compiling g"
    ]


def test_a_nameless_record_of_a_named_frames_compile_is_that_frame_not_another(records):
    # On the H100 a compile with an empty inductor cache logs a second record under the
    # frame's compile id, without a code name and of 0 s (serving_hf's cold starts).
    held, _, _ = records
    held += [
        _record(
            co_name="step",
            compile_id="0/0",
            entire_frame_compile_time_s=14.5,
            backward_cumulative_compile_time_us=None,
            num_graph_breaks=0,
        ),
        _record(
            co_name=None,
            co_filename=None,
            co_firstlineno=None,
            compile_id="0/0",
            entire_frame_compile_time_s=0.5,
            backward_cumulative_compile_time_us=None,
            recompile_reason=None,
            num_graph_breaks=1,
        ),
        _record(
            co_name=None,
            compile_id="1/0",
            entire_frame_compile_time_s=2.0,
            backward_cumulative_compile_time_us=None,
        ),  # no named frame of its id
        _record(co_name=None, compile_id="?", entire_frame_compile_time_s=None),
    ]
    frames = CompileWatch.start().finish().frames
    assert [(f.name, f.compile_id, f.seconds, f.graph_breaks) for f in frames] == [
        ("step", "0/0", 15.0, 1),
        ("?", "1/0", 2.0, 2),
        ("?", "?", 0.25, 2),
    ]


def test_inductors_global_cuda_graphs_are_refused_unless_the_options_turn_them_off(monkeypatch):
    # TORCHINDUCTOR_CUDAGRAPHS=1 sets inductor's config at import: every compile would
    # record CUDA-graph trees of its own, inside our capture.
    import torch._inductor.config as inductor

    from cudagraphs.compile_watch import check_compile_options

    monkeypatch.setattr(inductor.triton, "cudagraphs", True)
    with pytest.raises(CudaGraphsValueError, match="TORCHINDUCTOR_CUDAGRAPHS"):
        check_compile_options("here", {})
    with pytest.raises(CudaGraphsValueError, match="inductor's own config"):
        check_compile_options("here", {"mode": "max-autotune-no-cudagraphs"})
    off = {"options": {"triton.cudagraphs": False}}
    assert check_compile_options("here", off) == off
    assert check_compile_options("here", {"backend": "aot_eager"}) == {"backend": "aot_eager"}
    monkeypatch.setattr(inductor.triton, "cudagraphs", False)
    assert check_compile_options("here", {}) == {}
