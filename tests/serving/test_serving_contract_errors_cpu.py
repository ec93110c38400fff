"""The serving runner's contract on the CPU: CUDAGRAPHS_DISABLE, typed errors that name the
bucket and the fix, input checks, and argument checks."""

import logging

import pytest
import torch

from cudagraphs.capture import EagerGraph as StandIn
from cudagraphs.errors import (
    CudaGraphInputError,
    CudaGraphOutputError,
    CudaGraphsError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    NoCudaDeviceError,
)
from cudagraphs.serving import (
    STRICT_BUCKETS_ENV,
    Bucket,
    BucketConfig,
    GraphRunner,
    InputSpec,
)
from cudagraphs.settings import DISABLE_ENV
from helpers.serving_contract import (
    RUNNER_LOG,
    SMALL,
    SPECS,
    small_runner,
    warnings_about,
)
from helpers.serving_runner import (
    HIDDEN,
    batch,
    dummy,
    eager_backend,
    forward,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(STRICT_BUCKETS_ENV, raising=False)


# --------------------------------------------------------------------------- disabled


def test_disabled_runs_the_runner_path_eagerly_on_the_cpu(monkeypatch, caplog):
    monkeypatch.setenv(DISABLE_ENV, "1")
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    calls, padded = [], []

    def counted(x, scale):
        calls.append(x.shape[0])
        return forward(x, scale)

    def plan(bucket, slot):
        # Called after staging: the padding rows of the bucket are already reset.
        padded.append(runner.slot_inputs[slot].view("scale", bucket.rows)[3:].sum().item())

    runner = GraphRunner(counted, SPECS, SMALL, device="cpu", plan=plan)  # the real backend
    runner.capture(dummy, warmup=5)
    assert calls == [4, 2, 1]  # no warmup: one eager "capture" per bucket
    assert all(isinstance(g.graph, StandIn) for g in runner.graphs.values())
    first = runner.run(batch(3, seed=1))
    kept = first.clone()
    assert torch.equal(first, forward(**batch(3, seed=1)))
    runner.run(batch(3, seed=2))
    assert not torch.equal(first, kept)  # borrowed views of the bucket's output buffers
    for n in (1, 2, 5):
        assert torch.equal(runner.run(batch(n, seed=n)), forward(**batch(n, seed=n)))
    assert padded == [0.0, 0.0, 0.0, 0.0]
    stats = runner.stats()
    assert stats["disabled"] is True and stats["captured"] == []
    assert stats["replays"] == {"bucket(bs=4)": 2, "bucket(bs=2)": 1, "bucket(bs=1)": 1}
    assert stats["eager_runs"] == {"disabled": 4, "too_large": 1}
    assert len(warnings_about(caplog, "CUDAGRAPHS_DISABLE=1")) == 1


def test_disabled_keeps_every_check(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "true")
    runner = small_runner(output_row_dim=1)
    # Bucket 4's [4, 4] output holds 4 in dim 1 by chance; bucket 2's does not.
    with pytest.raises(
        CudaGraphOutputError,
        match=r"bucket\(bs=2\)[\s\S]*output: shape expected 2 rows in dim 1, received \(2, 4\)",
    ):
        runner.capture(dummy)
    runner = small_runner()
    runner.capture(dummy)
    bad = batch(3)
    bad["x"] = bad["x"].double()
    with pytest.raises(CudaGraphInputError, match=r"inputs\['x'\]: dtype expected torch.float32"):
        runner.run(bad)


def test_disabled_skips_the_memory_plan(monkeypatch, caplog):
    monkeypatch.setenv(DISABLE_ENV, "1")
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    measured = []
    runner = small_runner()
    runner.capture(dummy, plan_memory=True, measure=measured.append)
    assert measured == [] and runner.memory_plan is None
    assert len(warnings_about(caplog, "warmup and the memory plan skipped")) == 1
    assert runner.stats()["disabled"] is True


def test_disabled_stand_in_refuses_outputs_that_change_shape(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    state = {"rows": None}

    def varying(x, scale):
        out = forward(x, scale)
        return out if state["rows"] is None else out[: state["rows"]]

    runner = small_runner(varying)
    runner.capture(dummy)
    state["rows"] = 1
    with pytest.raises(
        CudaGraphOutputError,
        match=r"bucket\(bs=4\): run eagerly \(graphs disabled\), it returned outputs that differ",
    ):
        runner.run(batch(3))


def test_a_bad_disable_flag_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "sometimes")
    with pytest.raises(CudaGraphsValueError, match="CUDAGRAPHS_DISABLE='sometimes'"):
        small_runner(backend=eager_backend()).capture(dummy)


# --------------------------------------------------------------------------- errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("disabled", [False, True])
@pytest.mark.parametrize("backend", [None, eager_backend()])
def test_capture_on_cuda_without_cuda_raises_no_cuda_device(monkeypatch, disabled, backend):
    if disabled:
        monkeypatch.setenv(DISABLE_ENV, "1")
    runner = GraphRunner(forward, SPECS, SMALL, capture_backend=backend)  # device "cuda"
    with pytest.raises(NoCudaDeviceError, match=r"GraphRunner.capture needs a CUDA device"):
        runner.capture(dummy)
    assert runner.static is None


@pytest.mark.parametrize("static_outputs", [False, True])
def test_real_capture_off_cuda_says_graphs_need_cuda(static_outputs):
    runner = GraphRunner(forward, SPECS, SMALL, device="cpu", static_outputs=static_outputs)
    with pytest.raises(
        CudaGraphsValueError,
        match=r"GraphRunner\(device='cpu'\): CUDA graphs need a CUDA device[\s\S]*CUDAGRAPHS_DISABLE=1",
    ):
        runner.capture(dummy)


def test_capture_twice_needs_close_between():
    runner = small_runner(backend=eager_backend())
    runner.capture(dummy)
    with pytest.raises(CudaGraphsStateError, match=r"captured already; close\(\) it first"):
        runner.capture(dummy)
    runner.close()
    runner.capture(dummy)
    assert torch.equal(runner.run(batch(2)), forward(**batch(2)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"make_inputs": 3}, CudaGraphsTypeError, "make_inputs must be callable"),
        ({"warmup": -1}, CudaGraphsValueError, "warmup must be an int >= 0"),
        ({"warmup": 1.5}, CudaGraphsTypeError, "warmup must be an int"),
        ({"free_bytes": "lots"}, CudaGraphsTypeError, "free_bytes must be an int"),
        ({"headroom_bytes": -1}, CudaGraphsValueError, "headroom_bytes must be an int >= 0"),
        ({"measure": 3}, CudaGraphsTypeError, "measure must be callable"),
    ],
)
def test_capture_arguments_are_checked(kwargs, error, match):
    runner = small_runner(backend=eager_backend())
    kwargs = dict(kwargs)  # the parametrized dict is shared by every run of the test
    make_inputs = kwargs.pop("make_inputs", dummy)
    with pytest.raises(error, match=match):
        runner.capture(make_inputs, **kwargs)
    assert runner.static is None


# --------------------------------------------------------------------------- inputs


def test_run_with_no_inputs_lists_the_missing_ones():
    runner = small_runner(backend=eager_backend())
    runner.capture(dummy)
    with pytest.raises(CudaGraphInputError, match=r"Missing inputs: \['scale', 'x'\]") as info:
        runner.run({})
    assert [(m.path, m.field, m.received) for m in info.value.mismatches] == [
        ("inputs", "names", [])
    ]


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        (
            {"x": [[0.0] * HIDDEN] * 2, "scale": torch.ones(2, 1)},
            r"inputs\['x'\]: type expected 'Tensor', received 'list'",
        ),
        (
            {"x": torch.zeros(2, HIDDEN), "scale": 1.0},
            r"inputs\['scale'\]: type expected 'Tensor', received 'float'",
        ),
        (
            [torch.zeros(2, HIDDEN), torch.ones(2, 1)],
            r"inputs: type expected 'Mapping\[str, Tensor\]', received 'list'",
        ),
    ],
    ids=["list", "float", "not-a-mapping"],
)
def test_run_with_non_tensors_names_the_input(inputs, match):
    runner = small_runner(backend=eager_backend())
    runner.capture(dummy)
    with pytest.raises(CudaGraphInputError, match=match):
        runner.run(inputs)


def id_forward(ids, h):
    assert ids.dtype == torch.int64 and h.dtype == torch.float32
    return h * 2.0 + ids[:, None].to(torch.float32)


ID_SPECS = [InputSpec("ids", (4,), torch.int64), InputSpec("h", (4, 3), torch.float32)]


def id_dummy(bucket):
    return {"ids": torch.zeros(bucket.rows, dtype=torch.int64), "h": torch.zeros(bucket.rows, 3)}


@pytest.mark.parametrize("n", [3, 4, 6])  # 6: no bucket, the eager run converts as well
def test_lossless_dtypes_are_accepted_and_converted(n):
    runner = GraphRunner(id_forward, ID_SPECS, SMALL, device="cpu", capture_backend=eager_backend())
    runner.capture(id_dummy)
    ids = torch.arange(n, dtype=torch.int32) + 100
    h = torch.randn(n, 3, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    got = runner.run({"ids": ids, "h": h})
    assert torch.equal(got, id_forward(ids.long(), h.float()))
    replayed = sum(runner.stats()["replays"].values())
    assert replayed == (0 if n > 4 else 1)


@pytest.mark.parametrize(
    ("name", "tensor", "want", "got"),
    [
        ("h", torch.zeros(3, 3, dtype=torch.float64), "torch.float32", "torch.float64"),
        ("ids", torch.zeros(3, dtype=torch.float32), "torch.int64", "torch.float32"),
        ("ids", torch.zeros(3, dtype=torch.uint64), "torch.int64", "torch.uint64"),
    ],
)
@pytest.mark.parametrize("rows", [3, 6])
def test_lossy_dtypes_are_refused_naming_both(name, tensor, want, got, rows):
    runner = GraphRunner(id_forward, ID_SPECS, SMALL, device="cpu", capture_backend=eager_backend())
    runner.capture(id_dummy)
    inputs = {"ids": torch.zeros(rows, dtype=torch.int64), "h": torch.zeros(rows, 3)}
    inputs[name] = torch.cat([tensor, tensor]) if rows == 6 else tensor
    with pytest.raises(
        CudaGraphInputError, match=rf"inputs\['{name}'\]: dtype expected {want}, received {got}"
    ):
        runner.run(inputs)
    assert runner.eager_runs == {}  # refused before it counted as an eager run


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"batch_sizes": 8},
            CudaGraphsTypeError,
            r"batch_sizes must be a sequence of ints such as \(1, 2, 4\), got int 8",
        ),
        ({"batch_sizes": (1, 2.0)}, CudaGraphsTypeError, r"batch_sizes\[1\] must be an int"),
        ({"max_pad_ratio": "0.5"}, CudaGraphsTypeError, "max_pad_ratio must be a number"),
        (
            {"token_counts": [8]},
            CudaGraphsTypeError,
            r"token_counts must be a mapping .*, got list \[8\]",
        ),
        ({"token_counts": {"4": [8]}}, CudaGraphsTypeError, "token_counts key '4' must be an int"),
        (
            {"batch_sizes": (4,), "token_counts": {4: [8.0]}},
            CudaGraphsTypeError,
            r"token_counts\[4\]\[0\] must be an int",
        ),
        (
            {"batch_sizes": (4,), "token_counts": {4: 8}},
            CudaGraphsTypeError,
            r"token_counts\[4\] must be a sequence of ints",
        ),
    ],
)
def test_bucket_config_arguments_are_typed(kwargs, error, match):
    with pytest.raises(error, match=match):
        BucketConfig(**kwargs)


def test_token_counts_none_or_empty_mean_one_token_per_sequence():
    assert BucketConfig(batch_sizes=(2,), token_counts={2: None}).buckets() == [Bucket(2, 2)]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            ("x", (4,), "float32"),
            {},
            CudaGraphsTypeError,
            r"'x': dtype must be a torch.dtype \(pass torch.float32\), got str 'float32'",
        ),
        (
            ("x", (4,), None),
            {},
            CudaGraphsTypeError,
            r"'x': dtype must be a torch.dtype \(pass torch.float32\), got NoneType None",
        ),
        (("x", (4,), "torch.int64"), {}, CudaGraphsTypeError, r"\(pass torch.int64\)"),
        (
            (3, (4,), torch.float32),
            {},
            CudaGraphsTypeError,
            "InputSpec name must be a str .*, got int 3",
        ),
        (
            ("x", 4, torch.float32),
            {},
            CudaGraphsTypeError,
            "'x': shape must be a tuple or list of ints, got int 4",
        ),
        (("x", "64", torch.float32), {}, CudaGraphsTypeError, "'x': shape must be a tuple"),
        (("x", (4, 2.0), torch.float32), {}, CudaGraphsTypeError, "'x': shape must be a tuple"),
        (("x", (4, True), torch.float32), {}, CudaGraphsTypeError, "'x': shape must be a tuple"),
        (
            ("x", (4, 0), torch.float32),
            {},
            CudaGraphsValueError,
            r"'x': shape \(4, 0\) has sizes below 1 in dims \[1\]",
        ),
        (
            ("x", (-1,), torch.float32),
            {},
            CudaGraphsValueError,
            r"'x': shape \(-1,\) has sizes below 1",
        ),
        (("x", (), torch.float32), {}, CudaGraphsValueError, "'x': shape is empty"),
        (
            ("x", (4,), torch.float32),
            {"row_dim": "0"},
            CudaGraphsTypeError,
            "'x': row_dim must be an int",
        ),
        (
            ("x", (4,), torch.float32),
            {"row_dim": 0.0},
            CudaGraphsTypeError,
            "'x': row_dim must be an int",
        ),
        (
            ("x", (4,), torch.float32),
            {"pad_value": "0"},
            CudaGraphsTypeError,
            "'x': pad_value must be a number",
        ),
        (
            ("x", (4,), torch.float32),
            {"pad_value": None},
            CudaGraphsTypeError,
            "'x': pad_value must be a number",
        ),
        (
            ("x", (4,), torch.int64),
            {"pad_value": 0.5},
            CudaGraphsValueError,
            "'x': pad_value 0.5 is not a value of torch.int64",
        ),
        (
            ("x", (4,), torch.uint8),
            {"pad_value": 300},
            CudaGraphsValueError,
            "'x': pad_value 300 is not a value of torch.uint8",
        ),
        (
            ("x", (4,), torch.bool),
            {"pad_value": 2},
            CudaGraphsValueError,
            "'x': pad_value 2 is not a value of torch.bool",
        ),
    ],
)
def test_input_spec_arguments_are_typed(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        InputSpec(*args, **kwargs)


def test_input_spec_takes_a_list_shape_and_integral_float_pad():
    spec = InputSpec("x", [4, 2], torch.int64, pad_value=-1.0)
    assert spec.shape == (4, 2) and hash(spec)
    assert InputSpec("mask", (4,), torch.bool, pad_value=False).pad_value is False


def good_runner_kwargs():
    return {"forward": forward, "inputs": SPECS, "config": SMALL, "device": "cpu"}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"config": [1, 2, 4]},
            CudaGraphsTypeError,
            r"config must be a BucketConfig, got list \[1, 2, 4\]; pass BucketConfig\(batch_sizes=\(1, 2, 4\)\)",
        ),
        (
            {"config": {"batch_sizes": (4,)}},
            CudaGraphsTypeError,
            "config must be a BucketConfig, got dict",
        ),
        (
            {"inputs": {"x": SPECS[0]}},
            CudaGraphsTypeError,
            "inputs must be a sequence .* of InputSpec, got dict",
        ),
        ({"inputs": SPECS[0]}, CudaGraphsTypeError, "inputs must be a sequence .* got InputSpec"),
        (
            {"inputs": [SPECS[0], ("scale", (4, 1))]},
            CudaGraphsTypeError,
            r"inputs\[1\] must be an InputSpec, got tuple",
        ),
        ({"inputs": []}, CudaGraphsValueError, "inputs is empty"),
        ({"inputs": [SPECS[0], SPECS[0]]}, CudaGraphsValueError, "input names repeat"),
        (
            {"inputs": [InputSpec("x", (8, 2), torch.float32)]},
            CudaGraphsValueError,
            r"inputs \['x'\] do not have 4 rows",
        ),
        ({"forward": None}, CudaGraphsTypeError, "forward must be callable, got NoneType"),
        ({"plan": 3}, CudaGraphsTypeError, "plan must be callable"),
        ({"slots": "2"}, CudaGraphsTypeError, "slots must be an int"),
        ({"slots": 0}, CudaGraphsValueError, "slots must be an int >= 1"),
        ({"output_row_dim": 1.0}, CudaGraphsTypeError, "output_row_dim must be an int"),
        ({"output_row_dim": None}, CudaGraphsTypeError, "output_row_dim must be an int"),
        (
            {"compile_options": [("backend", "eager")]},
            CudaGraphsTypeError,
            "compile_options must be a mapping",
        ),
        (
            {"require_all_buckets": "yes"},
            CudaGraphsTypeError,
            "require_all_buckets must be a bool or None",
        ),
        ({"static_outputs": None}, CudaGraphsTypeError, "static_outputs must be a bool"),
        ({"pool": "shared"}, CudaGraphsTypeError, "pool must be a GraphMemoryPool or None"),
        ({"capture_backend": 3}, CudaGraphsTypeError, "capture_backend must be callable"),
        ({"device": 1.5}, CudaGraphsTypeError, "device must be a torch.device or a str"),
        ({"device": "gpu"}, CudaGraphsValueError, "device 'gpu' is not a device torch knows"),
    ],
)
def test_runner_arguments_are_checked_at_construction(change, error, match):
    kwargs = good_runner_kwargs()
    kwargs.update(change)
    with pytest.raises(error, match=match):
        GraphRunner(**kwargs)


def test_every_serving_error_is_a_cudagraphs_error():
    for make in (
        lambda: BucketConfig(batch_sizes=()),
        lambda: BucketConfig(batch_sizes="8"),
        lambda: InputSpec("x", (4,), "float32"),
        lambda: GraphRunner(forward, SPECS, [1]),
        lambda: small_runner(backend=eager_backend()).run(batch(1)),
    ):
        with pytest.raises(CudaGraphsError):
            make()
