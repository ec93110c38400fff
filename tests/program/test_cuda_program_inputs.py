"""CudaGraphProgram on a real GPU: bad inputs are rejected before any copy (every
mismatch reported), and capture arguments are checked.

Replays run the kernels that eager execution runs, so every comparison with eager is
bitwise (``torch.equal``). Inputs are drawn on the CPU, so values do not depend on the
CUDA generator's state (some tests break captures on purpose).
"""

import functools

import pytest
import torch

from cudagraphs import (
    CudaGraphInputError,
    CudaGraphPool,
    CudaGraphProgram,
)
from cudagraphs.program import SignatureMismatchError
from helpers.asserts import assert_bitwise_equal
from helpers.leaf_types import LEAF_TYPES, PackedTensor, QuantizedTensor
from helpers.program_cuda import (
    _assert_tree_equal,
    _assert_unchanged,
    _capture,
    _close,
    _double,
    _quantized,
    _randn,
    _snapshot,
)

pytestmark = pytest.mark.cuda

POOL_MODES = [pytest.param(False, id="own_pool"), pytest.param(True, id="shared_pool")]


# ---- 7. bad inputs ----------------------------------------------------------------------


def _bad_example(seed):
    tree = {
        "a": _randn(4, 8, seed=seed),
        "b": (_randn(8, 3, seed=seed + 1), [_randn(5, seed=seed + 2), _randn(2, 6, seed=seed + 3)]),
        "c": [_randn(6, seed=seed + 4)],
        "q": _quantized(4, 8, seed=seed + 5),
    }
    return tree, _randn(3, seed=seed + 6)


def _bad_fn(tree, v):
    b0, (b10, b11) = tree["b"]
    y = tree["a"] @ b0 + b10.sum() + b11.sum() + v
    deq = tree["q"].data.float() * tree["q"].scale
    return {"y": y, "c": tree["c"][0] * 2, "deq": deq @ b0}


def _replace(tree, loc, new):
    """A copy of ``tree`` with ``new`` at ``loc`` (containers rebuilt along the way)."""
    if not loc:
        return new
    head, rest = loc[0], loc[1:]
    if type(tree) is dict:
        return {**tree, head: _replace(tree[head], rest, new)}
    items = list(tree)
    items[head] = _replace(tree[head], rest, new)
    return items if type(tree) is list else tuple(items)


def _without(tree, key):
    return {k: v for k, v in tree.items() if k != key}


def _requant(q, **changes):
    fields = {"data": q.data, "scale": q.scale, "block": q.block, "zero_point": q.zero_point}
    return QuantizedTensor(**{**fields, **changes})


A, B, B1, C, Q, V = (
    "inputs[0]['a']",
    "inputs[0]['b']",
    "inputs[0]['b'][1]",
    "inputs[0]['c']",
    "inputs[0]['q']",
    "inputs[1]",
)

# (edit of a valid (tree, v) into bad positional args, expected {(path, field)}).
BAD_INPUTS = [
    pytest.param(lambda t, v: (_replace(t, ("a",), _randn(5, 8)), v), {(A, "shape")}, id="shape"),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(4, 8, dtype=torch.float64)), v),
        {(A, "dtype")},
        id="dtype",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(8, 4).t()), v), {(A, "stride")}, id="transposed"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(4, 8).requires_grad_()), v),
        {(A, "requires_grad")},
        id="requires_grad",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _randn(5, 8, dtype=torch.float16)), v),
        {(A, "shape"), (A, "dtype")},
        id="shape_and_dtype_of_one_tensor",
    ),
    pytest.param(
        lambda t, v: (t, _randn(())), {(V, "shape"), (V, "stride")}, id="scalar_for_vector"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 1), t["b"][1][:1]), v),
        {(B1, "length")},
        id="missing_list_element",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 1), [*t["b"][1], _randn(2)]), v),
        {(B1, "length")},
        id="extra_list_element",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b",), list(t["b"])), v), {(B, "type")}, id="list_for_tuple"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("c",), tuple(t["c"])), v), {(C, "type")}, id="tuple_for_list"
    ),
    pytest.param(
        lambda t, v: (_without(t, "c"), v), {("inputs[0]", "keys")}, id="missing_dict_key"
    ),
    pytest.param(
        lambda t, v: ({**t, "d": _randn(2)}, v), {("inputs[0]", "keys")}, id="extra_dict_key"
    ),
    pytest.param(
        lambda t, v: ({**_without(t, "c"), "C": t["c"]}, v),
        {("inputs[0]", "keys")},
        id="renamed_dict_key",
    ),
    pytest.param(lambda t, v: (list(t.values()), v), {("inputs[0]", "type")}, id="list_for_dict"),
    pytest.param(lambda t, v: (t, 3), {(V, "type")}, id="int_leaf"),
    pytest.param(
        lambda t, v: (_replace(t, ("c", 0), None), v), {(C + "[0]", "type")}, id="none_leaf"
    ),
    pytest.param(lambda t, v: (_replace(t, ("a",), "a"), v), {(A, "type")}, id="str_leaf"),
    pytest.param(lambda t, v: (t, {"v": v}), {(V, "type")}, id="dict_for_tensor"),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], block=8)), v),
        {(Q, "metadata")},
        id="leaf_metadata",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), PackedTensor(t["q"].data, t["q"].scale, 4)), v),
        {(Q, "type")},
        id="other_leaf_type",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), t["q"].data), v), {(Q, "type")}, id="tensor_for_leaf"
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("a",), _quantized(4, 8, seed=1)), v),
        {(A, "type")},
        id="leaf_for_tensor",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], data=t["q"].data[:2])), v),
        {(Q + ".data", "shape")},
        id="leaf_tensor_shape",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], scale=t["q"].scale.double())), v),
        {(Q + ".scale", "dtype")},
        id="leaf_tensor_dtype",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("q",), _requant(t["q"], zero_point=t["q"].scale + 1)), v),
        {(Q, "tensor names")},
        id="leaf_tensor_names",
    ),
    pytest.param(lambda t, v: (t,), {("inputs", "length")}, id="too_few_args"),
    pytest.param(lambda t, v: (t, v, v), {("inputs", "length")}, id="too_many_args"),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 1, 1), _randn(3, 6)), v),
        {(B1 + "[1]", "shape")},
        id="deep_shape",
    ),
    pytest.param(
        lambda t, v: (_replace(t, ("b", 0), _randn(8, 3, dtype=torch.float16, device="cpu")), v),
        {(B + "[0]", "dtype")},
        id="cpu_source_dtype",
    ),
    pytest.param(
        lambda t, v: (
            {
                **t,
                "a": t["a"].double(),
                "c": tuple(t["c"]),
                "q": _requant(t["q"], block=8),
            },
            _randn(4),
        ),
        {(A, "dtype"), (C, "type"), (Q, "metadata"), (V, "shape")},
        id="errors_in_four_places",
    ),
]


@pytest.fixture
def bad_input_program():
    program = _capture(_bad_fn, *_bad_example(0), leaf_types=LEAF_TYPES)
    yield program
    program.close()


@pytest.mark.parametrize("edit, expected", BAD_INPUTS)
def test_bad_inputs_are_rejected_before_any_copy(bad_input_program, edit, expected):
    program = bad_input_program
    good = _bad_example(1)
    program.replay(*good)
    handle = program.copy_inputs_from(*good)
    snapshot = _snapshot(program)
    bad = edit(*_bad_example(2))
    for name in ("replay", "copy_inputs_from"):
        with pytest.raises(SignatureMismatchError) as info:
            getattr(program, name)(*bad)
        assert isinstance(info.value, CudaGraphInputError)
        got = [(m.path, m.field) for m in info.value.mismatches]
        assert sorted(got) == sorted(expected), f"{name}: mismatches {info.value.mismatches}"
        for path, _ in expected:
            assert path in str(info.value), f"{name}: the message does not name {path}"
        _assert_unchanged(program, snapshot, f"after the rejected {name}")
    # Nothing was copied, so the handle of the last good copy is still the latest.
    out = program.replay_prepared(copy_handle=handle)
    _assert_tree_equal(out, _bad_fn(*good), "replay_prepared after the rejected inputs")


def test_mismatches_report_expected_and_received(bad_input_program):
    tree, v = _bad_example(2)
    tree = _replace(tree, ("a",), _randn(5, 8))
    tree = _replace(tree, ("b", 1), tree["b"][1][:1])
    tree = _replace(tree, ("q",), _requant(tree["q"], block=8))
    with pytest.raises(SignatureMismatchError) as info:
        bad_input_program.replay(tree, v)
    found = {(m.path, m.field): (m.expected, m.received) for m in info.value.mismatches}
    assert found == {
        (A, "shape"): ((4, 8), (5, 8)),
        (B1, "length"): (2, 1),
        (Q, "metadata"): ({"block": 4}, {"block": 8}),
    }


# ---- 9. capture argument validation -----------------------------------------------------


def _add(a, b):
    return a + b


def _return_int(t):
    return 3


def _with_cpu_output(t):
    return t * 2, torch.ones(2)  # a CPU tensor: never written by a replay


CAPTURE_ARGUMENT_CASES = [
    pytest.param(lambda x: {"example_inputs": ()}, ValueError, "hold no tensor", id="no_inputs"),
    pytest.param(
        lambda x: {"example_inputs": ([], {"k": ()})}, ValueError, "hold no tensor", id="no_tensor"
    ),
    pytest.param(
        lambda x: {"example_inputs": (x.cpu(),)}, ValueError, "one CUDA device", id="cpu_tensor"
    ),
    pytest.param(
        lambda x: {"function": _add, "example_inputs": (x, x.cpu())},
        ValueError,
        r"one CUDA device, found \['cpu', 'cuda:0'\]",
        id="cpu_and_cuda",
    ),
    pytest.param(
        lambda x: {"function": _add, "example_inputs": (x, x[1:])},
        ValueError,
        "tensors 0 and 1 .* share storage",
        id="tensor_and_view",
    ),
    pytest.param(
        lambda x: {"function": _add, "example_inputs": (x, x)},
        ValueError,
        "tensors 0 and 1 .* share storage",
        id="same_tensor_twice",
    ),
    pytest.param(
        lambda x: {"example_inputs": (x,), "warmup": -1},
        ValueError,
        "warmup must be an int >= 0",
        id="warmup_-1",
    ),
    pytest.param(
        lambda x: {"example_inputs": (x,), "warmup": 0, "pool": CudaGraphPool()},
        ValueError,
        "CudaGraphPool needs warmup >= 1",
        id="pool_without_warmup",
    ),
    pytest.param(
        lambda x: {"function": _return_int, "example_inputs": (x,)},
        TypeError,
        "output: unsupported leaf of type int",
        id="int_output",
    ),
    pytest.param(
        lambda x: {"function": _return_int, "example_inputs": (x,), "pool": CudaGraphPool()},
        TypeError,
        "output: unsupported leaf of type int",
        id="int_output_in_pool",
    ),
    pytest.param(
        lambda x: {"function": _with_cpu_output, "example_inputs": (x,)},
        TypeError,
        r"returned tensors on \['cpu'\]",
        id="cpu_tensor_output",
    ),
    pytest.param(
        lambda x: {"function": 42, "example_inputs": (x,)},
        TypeError,
        "function must be callable, got int",
        id="not_callable",
    ),
    pytest.param(
        lambda x: {"example_inputs": x},
        TypeError,
        "example_inputs must be a sequence of positional arguments",
        id="example_inputs_not_a_sequence",
    ),
    pytest.param(
        lambda x: {"example_inputs": (x, 3)},
        TypeError,
        r"inputs\[1\]: unsupported leaf of type int",
        id="int_input_leaf",
    ),
]


@pytest.mark.parametrize("build, error, match", CAPTURE_ARGUMENT_CASES)
def test_capture_rejects_bad_arguments(build, error, match):
    kwargs = {"function": _double, **build(_randn(16))}
    try:
        with pytest.raises(error, match=match):
            CudaGraphProgram.capture(**kwargs)
    finally:
        _close(kwargs.get("pool"))


def test_capture_as_decorator_returns_a_program():
    x = _randn(16)

    @CudaGraphProgram.capture(example_inputs=(x,), warmup=1)
    def doubled_plus_one(t):
        return t * 2 + 1

    try:
        assert isinstance(doubled_plus_one, CudaGraphProgram)
        y = _randn(16, seed=3)
        assert_bitwise_equal(doubled_plus_one.replay(y), y * 2 + 1, "decorated program")
    finally:
        doubled_plus_one.close()


class _Project:
    def __init__(self, w):
        self.w = w

    def __call__(self, t):
        return t @ self.w


def _project_shift(t, *, w, shift):
    return t @ w + shift


def test_static_state_bound_by_partial_or_callable_object():
    w, shift = _randn(16, 16, seed=5), _randn(16, seed=6)
    functions = [functools.partial(_project_shift, w=w, shift=shift), _Project(w)]
    for function in functions:
        program = _capture(function, _randn(8, 16))
        try:
            y = _randn(8, 16, seed=7)
            assert_bitwise_equal(program.replay(y), function(y), repr(program))
        finally:
            program.close()


def test_a_copy_handle_or_wait_for_of_the_wrong_kind_is_a_type_error_and_the_next_call_works(
    bad_input_program,
):
    from cudagraphs import CudaGraphsTypeError

    program = bad_input_program
    good = _bad_example(1)
    with pytest.raises(CudaGraphsTypeError, match="wait_for must be a torch.cuda.Event"):
        program.copy_inputs_from(*good, wait_for=3)
    with pytest.raises(CudaGraphsTypeError, match="copy_handle must be the CopyHandle"):
        program.replay_prepared(copy_handle="h")
    handle = program.copy_inputs_from(*good)
    out = program.replay_prepared(copy_handle=handle)
    _assert_tree_equal(out, _bad_fn(*good), "replay_prepared after the refused arguments")
