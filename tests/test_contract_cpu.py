"""The package-wide contract on the CPU: one error hierarchy, environment switches,
argument checks, the no-CUDA error first, the core's mismatch reports, lossless dtype
conversion and the eager path taken under CUDAGRAPHS_DISABLE."""

import ast
import inspect
import logging
import pathlib
import pickle

import pytest
import torch
from torch import nn

import cudagraphs
from cudagraphs import errors
from cudagraphs.checks import check_callable, check_int, check_number
from cudagraphs.dtypes import converts_losslessly
from cudagraphs.settings import DISABLE_ENV, env_choice, env_flag, graphs_disabled

SRC = pathlib.Path(cudagraphs.__file__).parent


# ---- one error hierarchy ----------------------------------------------------------------
def _error_classes():
    return [
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
    ]


def test_every_error_class_lives_in_errors_and_derives_from_the_root():
    classes = _error_classes()
    assert len(classes) >= 15
    for cls in classes:
        assert issubclass(cls, errors.CudaGraphsError), cls
        assert cls.__module__ == "cudagraphs.errors"
        assert getattr(cudagraphs, cls.__name__) is cls  # exported at the top level
    builtin = {
        errors.CudaGraphsValueError: ValueError,
        errors.CudaGraphsTypeError: TypeError,
        errors.CudaGraphsKeyError: KeyError,
        errors.CudaGraphsStateError: RuntimeError,
        errors.NoCudaDeviceError: RuntimeError,
        errors.CudaGraphCaptureError: RuntimeError,
        errors.CudaGraphInputError: ValueError,
        errors.SignatureMismatchError: ValueError,
        errors.CudaGraphOutputError: ValueError,
        errors.GraphReleasedError: RuntimeError,
        errors.ProgramClosedError: RuntimeError,
        errors.CaptureTimeHookError: RuntimeError,
        errors.TargetSelectionError: ValueError,
        errors.CudaCallError: RuntimeError,
        errors.QuantizationNotSupportedError: NotImplementedError,
    }
    for cls, base in builtin.items():
        assert issubclass(cls, base), (cls, base)
    # The layers re-export the classes they raise; they are the same objects.
    from cudagraphs import partial, program

    assert program.SignatureMismatchError is errors.SignatureMismatchError
    assert program.ProgramClosedError is errors.ProgramClosedError
    assert partial.TargetSelectionError is errors.TargetSelectionError


def _raised_names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name):
                yield node.lineno, exc.id


def test_the_package_raises_only_its_own_error_classes():
    # A plain `raise ValueError(...)` anywhere in src/ is a regression: callers could
    # not catch it as a CudaGraphsError. (Re-raising a caught exception is fine.)
    ours = {cls.__name__ for cls in _error_classes()}
    # argparse's own type for a bad command-line value, turned into its usage error.
    allowed = ours | {"ArgumentTypeError"}
    offenders = []
    for path in SRC.rglob("*.py"):
        for line, name in _raised_names(ast.parse(path.read_text())):
            if name[0].isupper() and name not in allowed:
                offenders.append(f"{path.relative_to(SRC)}:{line}: {name}")
    assert offenders == []


def test_mismatch_report_format_and_pickling():
    ms = [errors.Mismatch("args[0]", "shape", (2,), (3,)), errors.Mismatch("a", "dtype", 1, 2)]
    text = errors.describe_mismatches("f: inputs differ", ms, "Fix it.")
    assert text == (
        "f: inputs differ in 2 place(s):\n"
        "  args[0]: shape expected (2,), received (3,)\n"
        "  a: dtype expected 1, received 2\n"
        "Fix it."
    )
    err = pickle.loads(pickle.dumps(errors.CudaGraphInputError(text, ms)))
    assert err.mismatches == ms and str(err) == text
    sig = pickle.loads(pickle.dumps(errors.SignatureMismatchError("inputs", ms)))
    assert sig.mismatches == ms and "Nothing was copied" in str(sig)


def test_key_error_prints_its_message_without_quotes():
    assert str(errors.CudaGraphsKeyError("no leaf type named 'x'")) == "no leaf type named 'x'"


# ---- environment switches ---------------------------------------------------------------
@pytest.mark.parametrize("raw", ["1", "true", "YES", " on ", "True"])
def test_env_flag_true_values(monkeypatch, raw):
    monkeypatch.setenv("CUDAGRAPHS_TEST_FLAG", raw)
    assert env_flag("CUDAGRAPHS_TEST_FLAG") is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "OFF", "", "  "])
def test_env_flag_false_and_empty_values(monkeypatch, raw):
    monkeypatch.setenv("CUDAGRAPHS_TEST_FLAG", raw)
    assert env_flag("CUDAGRAPHS_TEST_FLAG") is False
    assert env_flag("CUDAGRAPHS_TEST_FLAG", default=True) is (raw.strip() == "")


@pytest.mark.parametrize("raw", ["2", "y", "enable", "disabled"])
def test_env_flag_other_values_are_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("CUDAGRAPHS_TEST_FLAG", raw)
    with pytest.raises(errors.CudaGraphsValueError, match=f"CUDAGRAPHS_TEST_FLAG={raw!r}"):
        env_flag("CUDAGRAPHS_TEST_FLAG")


@pytest.mark.parametrize(
    "raw, want", [(None, "b"), ("", "b"), ("  ", "b"), ("a", "a"), (" C.D ", "c.d"), ("B", "b")]
)
def test_env_choice_values(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("CUDAGRAPHS_TEST_CHOICE", raising=False)
    else:
        monkeypatch.setenv("CUDAGRAPHS_TEST_CHOICE", raw)
    assert env_choice("CUDAGRAPHS_TEST_CHOICE", ("a", "b", "c.d"), "b") == want


def test_env_choice_other_values_are_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_TEST_CHOICE", "e")
    with pytest.raises(errors.CudaGraphsValueError) as info:
        env_choice("CUDAGRAPHS_TEST_CHOICE", ("a", "b"), "a")
    assert str(info.value) == (
        "environment variable CUDAGRAPHS_TEST_CHOICE='e' is not one of a, b; "
        "set it to one of them, or unset it"
    )


def test_disable_switch_is_read_each_time(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert graphs_disabled() is False
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert graphs_disabled() is True
    monkeypatch.setenv(DISABLE_ENV, "maybe")
    with pytest.raises(ValueError, match="CUDAGRAPHS_DISABLE='maybe'"):
        graphs_disabled()


# ---- argument checks --------------------------------------------------------------------
@pytest.mark.parametrize("value", [True, 1.0, "3", None])
def test_check_int_refuses_other_types_by_name(value):
    with pytest.raises(errors.CudaGraphsTypeError, match="num_things must be an int, got"):
        check_int("num_things", value)


def test_check_int_minimum_and_numpy_ints():
    np = pytest.importorskip("numpy")
    assert check_int("n", np.int64(3), minimum=1) == 3
    with pytest.raises(errors.CudaGraphsValueError, match="n must be an int >= 1, got 0"):
        check_int("n", 0, minimum=1)


@pytest.mark.parametrize("value", ["0.5", True, torch.tensor(1.0), None])
def test_check_number_refuses_non_numbers(value):
    with pytest.raises(errors.CudaGraphsTypeError, match="pad must be a number"):
        check_number("pad", value)


def test_check_callable_names_the_argument():
    with pytest.raises(errors.CudaGraphsTypeError, match="forward must be callable, got int"):
        check_callable("forward", 3)


# ---- no CUDA device: our error first ----------------------------------------------------
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


@no_cuda
@pytest.mark.parametrize(
    "call, what",
    [
        (lambda: cudagraphs.new_pool(), r"new_pool\(\)"),
        (lambda: cudagraphs.CudaGraphPool(), "CudaGraphPool"),
        (lambda: cudagraphs.CudaGraphPool("cuda:0"), "CudaGraphPool"),
        (
            lambda: cudagraphs.CudaGraphProgram.capture(
                lambda x: x, example_inputs=(torch.ones(1),)
            ),
            r"CudaGraphProgram\.capture",
        ),
        (lambda: cudagraphs.make_graphed_callables(lambda: torch.ones(1), ()), "make_graphed"),
        (lambda: cudagraphs.capture_into_graph(lambda: None, what="bucket 8"), "bucket 8"),
    ],
    ids=["new_pool", "pool", "pool_index", "program", "function_without_tensors", "capture"],
)
def test_entry_points_say_no_cuda_device_first(call, what):
    with pytest.raises(errors.NoCudaDeviceError, match=f"{what}.*needs a CUDA device"):
        call()


@no_cuda
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"function": 3}, errors.CudaGraphsTypeError, "function"),
        ({"warmup": -1}, errors.CudaGraphsValueError, "warmup"),
        ({"example_inputs": "x"}, errors.CudaGraphsTypeError, "example_inputs"),
        ({"staging": "sometimes"}, errors.CudaGraphsValueError, "staging"),
    ],
    ids=["function", "warmup", "example_inputs", "staging"],
)
def test_program_capture_names_a_wrong_argument_before_the_missing_gpu(kwargs, error, match):
    call = {"function": lambda x: x, "example_inputs": (torch.ones(1),), **kwargs}
    function = call.pop("function")
    with pytest.raises(error, match=match):
        cudagraphs.CudaGraphProgram.capture(function, **call)


@pytest.mark.parametrize("device", [3.5, None, [0]])
def test_program_pool_device_argument_is_typed(device):
    with pytest.raises(errors.CudaGraphsTypeError, match="CudaGraphPool\\(device=...\\)"):
        cudagraphs.CudaGraphPool(device)


@pytest.mark.parametrize("argument", [(), (object(),)])
def test_programs_are_built_from_a_capture_not_directly(argument):
    with pytest.raises(errors.CudaGraphsTypeError, match=r"CudaGraphProgram\.capture\(function"):
        cudagraphs.CudaGraphProgram(*argument)


# ---- lossless dtype conversion ----------------------------------------------------------
@pytest.mark.parametrize(
    "src, dst, ok",
    [
        (torch.float16, torch.float32, True),
        (torch.bfloat16, torch.float32, True),
        (torch.float32, torch.float64, True),
        (torch.float32, torch.bfloat16, False),
        (torch.float16, torch.bfloat16, False),
        (torch.bfloat16, torch.float16, False),
        (torch.float64, torch.float32, False),
        (torch.int32, torch.int64, True),
        (torch.int64, torch.int32, False),
        (torch.uint8, torch.int16, True),
        (torch.int8, torch.uint8, False),
        (torch.int16, torch.float32, True),
        (torch.int32, torch.float32, False),
        (torch.int32, torch.float64, True),
        (torch.bool, torch.int64, True),
        (torch.float32, torch.int64, False),
        (torch.float32, torch.bool, False),
        (torch.float32, torch.complex64, False),
        (torch.float8_e4m3fn, torch.float32, False),
        (torch.quint8, torch.float32, False),
    ],
)
def test_lossless_conversion_rule(src, dst, ok):
    assert converts_losslessly(src, dst) is ok


@pytest.mark.parametrize(
    "dtype, plain",
    [
        (torch.float32, True),
        (torch.float8_e5m2, True),
        (torch.complex128, True),
        (torch.bool, True),
        (torch.uint32, True),
        (torch.int8, True),
        (torch.qint8, False),
        (torch.uint2, False),
        (torch.bits16, False),
    ],
)
def test_plain_value_dtypes(dtype, plain):
    from cudagraphs.dtypes import holds_plain_values

    assert holds_plain_values(dtype) is plain


# ---- the core's replay-side checks ------------------------------------------------------
def _entry(fn, sample_args, sample_kwargs=None):
    from cudagraphs.core.canonicalize import canonicalize
    from cudagraphs.core.capture_phase import eager_entry_graphs

    plan = canonicalize(fn, sample_args, sample_kwargs=sample_kwargs)
    return plan, eager_entry_graphs(plan, 0)


def test_core_input_check_reports_every_mismatch_as_records():
    _, entry = _entry(lambda a, b, scale: a * b * scale, (torch.ones(2, 3), torch.ones(3), 2.0))
    with pytest.raises(cudagraphs.CudaGraphInputError) as info:
        entry.user_tensors((torch.ones(2, 4), torch.ones(3, dtype=torch.int64), 2.0), {})
    assert info.value.mismatches == [
        errors.Mismatch("args[0]", "shape", (2, 3), (2, 4)),
        errors.Mismatch("args[1]", "dtype", torch.float32, torch.int64),
    ]
    assert "in 2 place(s)" in str(info.value) and "Capture another graph" in str(info.value)
    with pytest.raises(cudagraphs.CudaGraphInputError) as info:
        entry.user_tensors((torch.ones(2, 3), "b", 3.0), {})
    assert info.value.mismatches == [
        errors.Mismatch("args[1]", "type", "Tensor", "str"),
        errors.Mismatch("args[2]", "constant", 2.0, 3.0),
    ]
    with pytest.raises(cudagraphs.CudaGraphInputError) as info:
        entry.user_tensors((torch.ones(2, 3), [torch.ones(3)], 2.0), {})
    assert info.value.mismatches == [
        errors.Mismatch("args[1]", "type", "a leaf (tensor or constant)", "list")
    ]


def test_core_structure_mismatches_name_arguments_and_keywords():
    _, entry = _entry(lambda x, mask=None: x, (torch.ones(2),), {"mask": torch.ones(2)})
    with pytest.raises(cudagraphs.CudaGraphInputError) as info:
        entry.user_tensors((torch.ones(2), torch.ones(2)), {})
    assert info.value.mismatches == [
        errors.Mismatch("args", "length", 1, 2),
        errors.Mismatch("kwargs", "keys", ["mask"], []),
    ]
    _, nested = _entry(lambda t: t, ({"a": (torch.ones(1), torch.ones(1))},))
    with pytest.raises(cudagraphs.CudaGraphInputError) as info:
        nested.user_tensors(({"a": (torch.ones(1),)},), {})
    assert info.value.mismatches == [errors.Mismatch("args[0]['a']", "length", 2, 1)]


def test_lossless_dtypes_are_accepted_and_lossy_ones_refused():
    _, entry = _entry(lambda x, ids: x, (torch.ones(4), torch.arange(4)))
    half, ids32 = torch.ones(4, dtype=torch.bfloat16), torch.arange(4, dtype=torch.int32)
    got = entry.user_tensors((half, ids32), {})
    assert got[0] is half and got[1] is ids32  # the staging copy converts them
    with pytest.raises(cudagraphs.CudaGraphInputError) as info:
        entry.user_tensors((torch.ones(4, dtype=torch.float64), torch.arange(4)), {})
    assert info.value.mismatches == [
        errors.Mismatch("args[0]", "dtype", torch.float32, torch.float64)
    ]


def test_the_staging_copy_converts_a_lossless_dtype():
    from cudagraphs.core.runtime import copy_into

    buf = [torch.zeros(3), torch.zeros(2, dtype=torch.int64)]
    copy_into(
        buf,
        [
            torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16),
            torch.tensor([7, 8], dtype=torch.int32),
        ],
    )
    assert buf[0].tolist() == [1.5, 2.5, 3.5] and buf[1].tolist() == [7, 8]


# ---- CUDAGRAPHS_DISABLE: the same path, eagerly ----------------------------------------
def test_disabled_core_entries_validate_then_run_eagerly():
    from cudagraphs.core.graphed import GraphedCallable

    def f(x, y):
        return x * y + 1

    plan, entry = _entry(f, (torch.ones(3), torch.ones(3)))
    graphed = GraphedCallable(entry, eager=f, module=None, captured_training=None)
    x, y = torch.randn(3), torch.randn(3)
    assert torch.equal(graphed(x, y), f(x, y))
    with pytest.raises(cudagraphs.CudaGraphInputError, match=r"args\[1\]: shape"):
        graphed(x, torch.randn(4))  # validated as a replay would be
    graphed.reset()
    with pytest.raises(cudagraphs.GraphReleasedError, match="released by reset"):
        graphed(x, y)


def test_disabled_core_entries_keep_autograd_eager():
    from cudagraphs.core.graphed import GraphedCallable

    layer = nn.Linear(3, 2)
    plan, entry = _entry(layer, (torch.ones(4, 3),))
    graphed = GraphedCallable(entry, eager=layer.forward, module=layer, captured_training=True)
    x = torch.randn(4, 3)
    graphed(x).sum().backward()
    expected = nn.Linear(3, 2)
    expected.load_state_dict(layer.state_dict())
    expected(x).sum().backward()
    assert torch.equal(layer.weight.grad, expected.weight.grad)


@no_cuda
def test_disabled_make_graphed_callables_still_needs_cuda(monkeypatch):
    # The same checks as a graphed run, the device included.
    monkeypatch.setenv(DISABLE_ENV, "1")
    with pytest.raises(errors.NoCudaDeviceError, match="make_graphed_callables needs a CUDA"):
        cudagraphs.make_graphed_callables(nn.Linear(2, 2), (torch.ones(1, 2),))


def test_capture_eagerly_copies_each_run_into_the_same_outputs():
    from cudagraphs.capture import capture_eagerly

    state = {"x": torch.ones(2)}
    graph, out = capture_eagerly(lambda: {"y": state["x"] * 2, "n": 3}, what="f")
    assert torch.equal(out["y"], torch.tensor([2.0, 2.0])) and out["n"] == 3
    y = out["y"]
    state["x"] = torch.tensor([5.0, 6.0])
    graph.replay()
    assert out["y"] is y and y.tolist() == [10.0, 12.0] and graph.replays == 1
    state["x"] = torch.ones(3)
    with pytest.raises(cudagraphs.CudaGraphOutputError, match="f: run eagerly"):
        graph.replay()  # an eager run cannot stand in for a graph if its outputs change
    graph.reset()
    with pytest.raises(cudagraphs.CudaGraphsStateError, match=r"replay\(\) after reset"):
        graph.replay()


# ---- accept what users pass -------------------------------------------------------------
def test_graph_stack_takes_a_module_list_or_sequential_as_its_layers(monkeypatch):
    import cudagraphs.core.api as api

    seen = []

    def fake(stack, sample_args, **options):
        seen.append(list(stack.layers))
        return stack

    monkeypatch.setattr(api, "make_graphed_callables", fake)
    layers = [nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)]
    for container in (nn.ModuleList(layers), nn.Sequential(*layers), layers):
        stack = cudagraphs.graph_stack(container, (torch.ones(1, 2),))
        assert seen[-1] == layers
        assert torch.equal(stack(torch.ones(1, 2)), nn.Sequential(*layers)(torch.ones(1, 2)))
    single = nn.Linear(2, 2)
    cudagraphs.graph_stack(single, (torch.ones(1, 2),))
    assert seen[-1] == [single]
    with pytest.raises(errors.CudaGraphsTypeError, match="layers must be a sequence of modules"):
        cudagraphs.graph_stack("layers", (torch.ones(1, 2),))


# ---- the main job's command line --------------------------------------------------------
def test_main_job_help_is_plain_text_with_defaults(capsys):
    from cudagraphs.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--layers LAYERS" in out and "(default: 8)" in out
    assert "``" not in out and ":class:" not in out  # not reStructuredText


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "0"], "argument --layers: must be at least 1, got 0"),
        (["--iters", "-3"], "argument --iters: must be at least 1"),
        (["--hidden", "x"], "argument --hidden: 'x' is not an integer"),
        (["--hidden", "100", "--heads", "8"], "must be a multiple of --heads"),
    ],
)
def test_main_job_refuses_bad_arguments(capsys, argv, message):
    from cudagraphs.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_env_command_prints_what_a_bug_report_needs(capsys, monkeypatch):
    import json

    import torch

    import cudagraphs
    from cudagraphs.__main__ import main

    monkeypatch.setenv(DISABLE_ENV, "maybe")  # a malformed value is reported, not raised
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cudagraphs"] == cudagraphs.__version__
    assert report["torch"] == torch.__version__
    assert report[DISABLE_ENV].startswith("invalid") and "maybe" in report[DISABLE_ENV]
    assert report["CUDAGRAPHS_CUDA_BINDING"] == "auto"
    monkeypatch.setenv("CUDAGRAPHS_CUDA_BINDING", "cupy")  # reported, not raised
    assert main(["env", "--json"]) == 0
    bad = json.loads(capsys.readouterr().out)["CUDAGRAPHS_CUDA_BINDING"]
    assert bad.startswith("invalid") and "cupy" in bad
    monkeypatch.delenv("CUDAGRAPHS_CUDA_BINDING")
    for key in ("python", "cuda_device", "cuda-bindings", "transformers", "torch_cuda"):
        assert key in report
    if not torch.cuda.is_available():
        assert report["cuda_device"].startswith("none")
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == ["cudagraphs", cudagraphs.__version__]


@no_cuda
def test_main_job_without_a_gpu_says_so(capsys, caplog):
    from cudagraphs.__main__ import main

    assert main([]) == 0
    out = capsys.readouterr()
    assert "no CUDA device is present" in out.err and out.out == ""
    assert main(["--require-gpu"]) == 2


@no_cuda
@pytest.mark.parametrize(("argv", "code"), [(["--json"], 0), (["--json", "--require-gpu"], 2)])
def test_main_job_json_without_a_gpu_is_an_object_that_says_why(capsys, argv, code):
    import json

    from cudagraphs.__main__ import main

    assert main(argv) == code
    report = json.loads(capsys.readouterr().out)
    assert report["ran"] is False and "no CUDA device" in report["reason"]
    assert report["require_gpu"] is ("--require-gpu" in argv)


def test_disabled_warning_is_a_warning(caplog, monkeypatch):
    # The switch itself logs nothing; each layer says once that it runs eagerly.
    monkeypatch.setenv(DISABLE_ENV, "1")
    with caplog.at_level(logging.WARNING):
        assert graphs_disabled()
    assert caplog.records == []
