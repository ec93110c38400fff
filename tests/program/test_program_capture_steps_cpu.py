"""A program's capture-time steps (example checks, warmup, output description and the
first-replay comparison) on the CPU, with tensors standing in for the GPU ones."""

import contextlib

import pytest
import torch

from cudagraphs.errors import CudaGraphCaptureError, SignatureMismatchError
from cudagraphs.program import graph_capture
from cudagraphs.program.graph_capture import (
    check_capture_arguments,
    check_examples,
    check_output_device,
    detached,
    first_replay_mismatch,
    output_signature,
    warm_up,
)
from cudagraphs.program.signature import ValueTreeSignature
from helpers.leaf_types import LEAF_TYPES, QuantizedTensor

CUDA0 = torch.device("cuda", 0)
_NOTHING_COPIED = (
    "Nothing was copied. Pass values with the captured structure, shapes, strides and "
    "dtypes (devices may differ), or capture another program."
)


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that reports cuda:0: the example checks read only metadata and
    storage addresses, so they run without a GPU."""

    @property
    def device(self):
        return CUDA0


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_ReportsCuda)


class _Pool:
    def __init__(self, device=CUDA0, open_=True):
        self.device = device
        self.open = open_
        self.checked = 0

    def check_open(self):
        self.checked += 1
        if not self.open:
            raise RuntimeError("pool is closed")


def _fn(*args):
    return args


def _check(example_inputs, warmup=1, pool=None, leaf_types=None):
    return check_capture_arguments(_fn, example_inputs, warmup, pool, leaf_types, "auto")


def _mismatch(what: str, *lines: str) -> str:
    body = "\n  ".join(lines)
    return f"{what} differs from the captured signature in {len(lines)} place(s):\n  {body}\n" + (
        _NOTHING_COPIED
    )


# ---- check_capture_arguments / check_examples ---------------------------------------------


def test_examples_on_one_cuda_device_give_inputs_signature_and_device():
    a, b = _cuda(torch.zeros(2)), _cuda(torch.ones(3))
    inputs, signature, device = _check([a, {"k": b}])
    assert type(inputs) is tuple and inputs[0] is a and inputs[1]["k"] is b
    assert signature == ValueTreeSignature.from_value((a, {"k": b}), path="inputs")
    assert device == CUDA0


def test_registered_leaf_examples_are_described_with_the_leaf_types():
    q = QuantizedTensor(_cuda(torch.zeros(4, dtype=torch.int8)), _cuda(torch.ones(1)), 2)
    _, signature, device = _check((q,), leaf_types=LEAF_TYPES)
    assert signature == ValueTreeSignature.from_value((q,), leaf_types=LEAF_TYPES)
    assert signature.children[0].kind == "value"
    assert device == CUDA0


def test_an_example_a_copy_cannot_read_is_reported_under_inputs():
    with pytest.raises(SignatureMismatchError) as info:
        _check((torch.zeros(2, device="meta"),))
    assert str(info.value) == _mismatch(
        "inputs", "inputs[0]: device expected 'a CPU or CUDA tensor', received 'meta'"
    )


def test_examples_on_two_devices_are_refused_listing_both():
    with pytest.raises(ValueError) as info:
        _check((_cuda(torch.zeros(2)), torch.zeros(2)))
    assert str(info.value) == (
        "example_inputs must all sit on one CUDA device, found ['cpu', 'cuda:0']"
    )


def test_expanded_examples_are_refused_by_flatten_index():
    inputs = (_cuda(torch.zeros(2)), _cuda(torch.zeros(1).expand(3)))
    with pytest.raises(ValueError) as info:
        _check(inputs)
    assert str(info.value) == (
        "example input tensors [1] (in flatten order) are expanded views (stride 0); "
        "each input needs storage of its own (pass .contiguous() copies)"
    )


def test_examples_sharing_storage_are_refused_naming_both():
    x = torch.zeros(4)
    inputs = (_cuda(x[:2]), _cuda(torch.zeros(2)), _cuda(x[2:]))
    with pytest.raises(ValueError) as info:
        _check(inputs)
    assert str(info.value) == (
        "example input tensors 0 and 2 (in flatten order) share storage; every input leaf "
        "needs its own storage, since each gets its own fixed buffer (pass clones)"
    )


def test_an_empty_view_may_share_storage():
    x = torch.zeros(4)
    signature = ValueTreeSignature.from_value((x, x[:0]))
    assert check_examples(signature, [_cuda(x), _cuda(x[:0])]) == CUDA0


def test_a_pool_capture_needs_warmup():
    pool = _Pool()
    with pytest.raises(ValueError) as info:
        _check((_cuda(torch.zeros(2)),), warmup=0, pool=pool)
    assert str(info.value) == "capture into a CudaGraphPool needs warmup >= 1"
    assert pool.checked == 1


def test_a_pool_on_the_examples_device_with_one_warmup_is_accepted():
    pool = _Pool()
    _, _, device = _check((_cuda(torch.zeros(2)),), warmup=1, pool=pool)
    assert device == CUDA0 and pool.checked == 1


def test_a_closed_pool_is_refused_before_the_warmup_check():
    with pytest.raises(RuntimeError, match="pool is closed"):
        _check((_cuda(torch.zeros(2)),), warmup=0, pool=_Pool(open_=False))


def test_a_pool_on_another_device_is_refused():
    with pytest.raises(ValueError) as info:
        _check((_cuda(torch.zeros(2)),), pool=_Pool(device=torch.device("cuda", 1)))
    assert str(info.value) == "pool is on cuda:1 but example_inputs on cuda:0"


# ---- output_signature / check_output_device / detached ------------------------------------


def _quantized(seed=0.0):
    return QuantizedTensor(torch.arange(4, dtype=torch.int8), torch.tensor([1.0 + seed]), 2)


def test_output_signature_describes_none_tensors_and_leaves():
    out = {"a": torch.zeros(2), "b": None, "q": _quantized()}
    expected = ValueTreeSignature.from_value(out, leaf_types=LEAF_TYPES)
    assert output_signature(out, LEAF_TYPES) == expected
    assert output_signature(None, None) == ValueTreeSignature("none")


def test_output_signature_refuses_other_leaves_naming_the_output_path():
    with pytest.raises(TypeError) as info:
        output_signature((torch.zeros(1), 3), None)
    assert str(info.value) == (
        "output[1]: unsupported leaf of type int. Leaves are tensors, None and registered "
        "leaf types (registered here: none) nested in lists, tuples, dicts and containers "
        "registered with torch's pytree (namedtuples, OrderedDict, register_dataclass); "
        "bind Python scalars and other objects in the function (closure or "
        "functools.partial).. A program's output must be CUDA tensors, registered leaves "
        "or None, nested in lists, tuples and dicts."
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_outputs_on_the_program_device_pass():
    assert check_output_device([torch.zeros(1), torch.ones(2)], torch.device("cpu")) is None
    assert check_output_device([], torch.device("cpu")) is None


def test_outputs_on_other_devices_are_refused_listing_them_once():
    tensors = [torch.zeros(1), torch.zeros(1, device="meta"), torch.zeros(2, device="meta")]
    with pytest.raises(TypeError) as info:
        check_output_device(tensors, torch.device("cpu"))
    assert str(info.value) == (
        "the function returned tensors on ['meta']; a program's outputs must be tensors on "
        "its device cpu (a graph replay never writes other devices)"
    )


def test_detached_keeps_structure_and_storage_without_grad():
    w = torch.ones(3, requires_grad=True)
    y = w * 2
    q = _quantized()
    out = detached({"y": y, "n": None, "q": q}, LEAF_TYPES)
    assert set(out) == {"y", "n", "q"} and out["n"] is None
    assert not out["y"].requires_grad and out["y"].grad_fn is None
    assert out["y"].data_ptr() == y.data_ptr() and torch.equal(out["y"], y)
    assert type(out["q"]) is QuantizedTensor and out["q"] is not q and out["q"].block == 2
    assert out["q"].data.data_ptr() == q.data.data_ptr()


def test_detached_reports_unreadable_outputs_under_output():
    with pytest.raises(SignatureMismatchError) as info:
        detached((torch.zeros(2, device="meta"),), None)
    assert str(info.value) == _mismatch(
        "output", "output[0]: device expected 'a CPU or CUDA tensor', received 'meta'"
    )


# ---- first_replay_mismatch ----------------------------------------------------------------


def _outputs(second=1.0):
    return (torch.zeros(2), torch.full((2,), second), torch.ones(3))


def test_an_equal_first_replay_is_no_mismatch():
    out = _outputs()
    sig = output_signature(out, None)
    w = torch.ones(2, requires_grad=True)
    last = (w * 0, torch.ones(2) * 1.0, torch.ones(3))
    assert first_replay_mismatch(sig, out, last, None, "p") is None


def test_an_equal_first_replay_with_leaves_is_no_mismatch():
    sig = output_signature([_quantized()], LEAF_TYPES)
    assert first_replay_mismatch(sig, [_quantized()], [_quantized()], LEAF_TYPES, "p") is None


def test_a_differing_first_replay_names_the_tensors_and_the_fix():
    sig = output_signature(_outputs(), None)
    message = first_replay_mismatch(sig, _outputs(5.0), _outputs(), None, "decode")
    assert message == (
        "program decode: the first replay's output differs from the last warmup output at "
        "output tensors [1] (in flatten order). The function is not a fixed schedule "
        "(host-side control flow, random numbers, reading state outside its inputs?). For "
        "functions that draw random numbers pass check_first_replay=False."
    )


def test_a_replay_output_of_another_shape_is_reported_under_output():
    sig = output_signature((torch.zeros(2),), None)
    with pytest.raises(SignatureMismatchError) as info:
        first_replay_mismatch(sig, (torch.zeros(3),), (torch.zeros(2),), None, "p")
    assert str(info.value) == _mismatch("output", "output[0]: shape expected (2,), received (3,)")


def test_a_warmup_output_of_another_shape_is_reported_under_output():
    sig = output_signature((torch.zeros(2),), None)
    with pytest.raises(SignatureMismatchError) as info:
        first_replay_mismatch(sig, (torch.zeros(2),), (torch.zeros(3),), None, "p")
    assert str(info.value) == _mismatch("output", "output[0]: shape expected (2,), received (3,)")


# ---- warm_up ------------------------------------------------------------------------------


@pytest.fixture
def cpu_warmup(monkeypatch):
    """Record the stream warm_up enters and the device it synchronizes (CPU stand-ins)."""
    events = []

    @contextlib.contextmanager
    def fake_side_stream(stream):
        events.append(("enter", stream))
        yield
        events.append(("exit", stream))

    monkeypatch.setattr(graph_capture, "side_stream", fake_side_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: events.append(("sync", d)))
    return events


def test_warm_up_runs_on_fresh_copies_on_the_stream(cpu_warmup):
    x, y = torch.arange(3.0), torch.ones(2)
    inputs = (x, {"k": y})
    sig = ValueTreeSignature.from_value(inputs, path="inputs")
    calls = []

    def function(a, d):
        calls.append((a, d["k"], list(cpu_warmup)))
        return len(calls)

    stream = object()
    last = warm_up(function, sig, inputs, torch.device("cpu"), 3, stream, "p")
    assert last == 3 and len(calls) == 3
    for a, k, seen in calls:
        assert a is not x and k is not y and a.device.type == "cpu"
        assert torch.equal(a, x) and torch.equal(k, y)
        assert seen == [("enter", stream)]
    assert calls[0][0] is not calls[1][0]
    assert cpu_warmup == [("enter", stream), ("exit", stream), ("sync", torch.device("cpu"))]


def test_warm_up_without_warmup_returns_none(cpu_warmup):
    inputs = (torch.zeros(2),)
    sig = ValueTreeSignature.from_value(inputs, path="inputs")
    assert warm_up(lambda a: a, sig, inputs, torch.device("cpu"), 0, None, "p") is None
    assert cpu_warmup == [("enter", None), ("exit", None), ("sync", torch.device("cpu"))]


def test_a_failing_warmup_names_the_program_and_chains_the_cause(cpu_warmup):
    inputs = (torch.zeros(2),)
    sig = ValueTreeSignature.from_value(inputs, path="inputs")
    boom = ValueError("boom")

    def function(a):
        raise boom

    with pytest.raises(CudaGraphCaptureError) as info:
        warm_up(function, sig, inputs, torch.device("cpu"), 2, None, "decode")
    assert str(info.value) == "warmup of program decode failed: boom"
    assert info.value.__cause__ is boom


def test_warmup_inputs_off_the_signature_are_reported_under_inputs(cpu_warmup):
    sig = ValueTreeSignature.from_value((torch.zeros(2),), path="inputs")
    with pytest.raises(CudaGraphCaptureError) as info:
        warm_up(lambda a: a, sig, (torch.zeros(3),), torch.device("cpu"), 1, None, "p")
    assert str(info.value) == "warmup of program p failed: " + _mismatch(
        "inputs", "inputs[0]: shape expected (2,), received (3,)"
    )
