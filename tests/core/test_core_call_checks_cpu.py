"""How a graphed entry checks each call against the captured one, on the CPU: the
entries are the core's own (``eager_entry_graphs``: the same checks as a captured
entry, without graphs), so every rule below runs as on the GPU.

The rules: a call must repeat the captured structure, its constants and each tensor's
shape and dtype (a dtype that converts without loss is accepted); a parameter read in
place must be the captured one with its storage; a keyword the capture did not have
is refused unless it cannot change the call; each error lists every difference
(path, field, expected, received) with the fix, and the next good call works."""

from __future__ import annotations

import pytest
import torch

from cudagraphs.core.canonicalize import canonicalize
from cudagraphs.core.capture_phase import eager_entry_graphs
from cudagraphs.errors import (
    CudaGraphInputError,
    GraphReleasedError,
    Mismatch,
    describe_mismatches,
)
from helpers.stand_in_graphs import positional_entry


def _entry(fn, sample_args, sample_kwargs=None):
    kwargs = None if sample_kwargs is None else sample_kwargs
    return eager_entry_graphs(canonicalize(fn, sample_args, sample_kwargs=kwargs), 0)


def _mismatches(call):
    with pytest.raises(CudaGraphInputError) as err:
        call()
    return err.value


def _scale(t, factor):
    return t * factor


def test_a_positional_call_of_tensors_takes_the_fast_path_and_returns_them():
    entry = _entry(lambda a, b: a + b, (torch.zeros(2), torch.zeros(3)))
    a, b = torch.ones(2), torch.ones(3)
    assert entry.positional_only
    got = entry.user_tensors((a, b), {})
    assert got[0] is a and got[1] is b


def test_the_fast_path_checks_shapes_too():
    entry = _entry(lambda a, b: a + b, (torch.zeros(2), torch.zeros(3)))
    err = _mismatches(lambda: entry.user_tensors((torch.ones(4), torch.ones(3)), {}))
    assert err.mismatches == [Mismatch("args[0]", "shape", (2,), (4,))]
    text = str(err)
    assert "inputs differ from the captured ones" in text and "pad the inputs" in text
    assert entry.name in text


def test_a_non_tensor_where_a_tensor_was_captured_is_a_type_mismatch():
    entry = _entry(lambda a, b: a + b, (torch.zeros(2), torch.zeros(3)))
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2), 3.0), {}))
    assert err.mismatches == [Mismatch("args[1]", "type", "Tensor", "float")]
    assert "call differs from the captured one" in str(err)
    assert "Non-tensor arguments are baked into the graph" in str(err)


def test_a_changed_constant_is_named_with_both_values():
    entry = _entry(_scale, (torch.zeros(2), 2.5))
    assert entry.user_tensors((torch.ones(2), 2.5), {})[0].tolist() == [1.0, 1.0]
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2), 3.0), {}))
    assert err.mismatches == [Mismatch("args[1]", "constant", 2.5, 3.0)]


def test_nan_and_array_constants_compare_by_value_and_never_raise_their_own_errors():
    np = pytest.importorskip("numpy")
    nan = _entry(_scale, (torch.zeros(2), float("nan")))
    nan.user_tensors((torch.ones(2), float("nan")), {})  # NaN as captured: accepted
    array = _entry(_scale, (torch.zeros(2), np.array([1.0, 2.0])))
    array.user_tensors((torch.ones(2), np.array([1.0, 2.0])), {})  # equal values
    for other in (np.array([1.0, 3.0]), np.array([1.0, 2.0, 3.0]), "x"):
        err = _mismatches(lambda o=other: array.user_tensors((torch.ones(2), o), {}))
        assert [(m.path, m.field) for m in err.mismatches] == [("args[1]", "constant")]


def test_a_tensor_where_a_constant_was_captured_is_refused():
    entry = _entry(_scale, (torch.zeros(2), 2.5))
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2), torch.ones(1)), {}))
    assert [(m.path, m.field) for m in err.mismatches] == [("args[1]", "constant")]


def test_every_difference_is_listed_at_once():
    entry = _entry(lambda a, b, c: a + b + c, (torch.zeros(2), torch.zeros(3), 1))
    err = _mismatches(lambda: entry.user_tensors((torch.ones(5), 7, 2), {}))
    assert err.mismatches == [
        Mismatch("args[1]", "type", "Tensor", "int"),
        Mismatch("args[2]", "constant", 1, 2),
    ]
    assert "in 2 place(s)" in str(err)


def test_a_different_structure_is_refused_with_where_it_differs():
    entry = _entry(lambda a, b: a + b, (torch.zeros(2), torch.zeros(2)))
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2),), {}))
    text = str(err)
    assert "call structure differs from the captured one" in text
    assert "same nesting and keyword names" in text and err.mismatches


def test_a_dtype_that_converts_without_loss_is_accepted_and_a_lossy_one_refused():
    entry = _entry(lambda a: a * 2, (torch.zeros(2, dtype=torch.float32),))
    entry.user_tensors((torch.ones(2, dtype=torch.bfloat16),), {})  # bf16 into fp32: exact
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2, dtype=torch.float64),), {}))
    assert err.mismatches == [Mismatch("args[0]", "dtype", torch.float32, torch.float64)]


def test_shape_and_dtype_of_one_input_are_two_mismatches():
    entry = _entry(lambda a: a * 2, (torch.zeros(2, dtype=torch.float32),))
    err = _mismatches(lambda: entry.user_tensors((torch.ones(3, dtype=torch.float64),), {}))
    assert [m.field for m in err.mismatches] == ["shape", "dtype"]


def test_keywords_go_through_the_full_check():
    entry = _entry(lambda t, *, bias: t + bias, (torch.zeros(2),), {"bias": torch.zeros(2)})
    assert not entry.positional_only
    got = entry.user_tensors((torch.ones(2),), {"bias": torch.full((2,), 3.0)})
    assert [t.tolist() for t in got] == [[1.0, 1.0], [3.0, 3.0]]
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2),), {"bias": torch.ones(4)}))
    assert err.mismatches == [Mismatch("kwargs['bias']", "shape", (2,), (4,))]


def test_an_added_keyword_that_could_change_the_call_is_refused_with_the_fixes():
    def fn(t, *, bias, scale=None):
        return t + bias if scale is None else (t + bias) * scale

    entry = _entry(fn, (torch.zeros(2),), {"bias": torch.zeros(2)})
    # A keyword whose default is None, passed as None, leaves the call as captured.
    entry.user_tensors((torch.ones(2),), {"bias": torch.zeros(2), "scale": None})
    err = _mismatches(
        lambda: entry.user_tensors((torch.ones(2),), {"bias": torch.zeros(2), "scale": 2.0})
    )
    assert err.mismatches == [
        Mismatch("kwargs['scale']", "keyword", "not in sample_kwargs", "float")
    ]
    text = str(err)
    assert "the call passes keywords the capture did not have" in text
    assert "pass them in sample_kwargs too" in text


def test_a_call_with_keywords_of_a_positional_capture_is_checked_fully():
    entry = _entry(lambda a, b=None: a if b is None else a + b, (torch.zeros(2),))
    assert entry.positional_only
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2),), {"b": torch.ones(2)}))
    assert [m.path for m in err.mismatches] == ["kwargs['b']"]


def test_a_parameter_read_in_place_must_be_the_captured_one_with_its_storage():
    weight = torch.nn.Parameter(torch.ones(2))
    entry = _entry(lambda w, t: w * t, (weight, torch.zeros(2)))
    assert [p for _, _, p in entry.pinned] == [weight]
    entry.user_tensors((weight, torch.ones(2)), {})
    other = torch.nn.Parameter(torch.ones(2))
    err = _mismatches(lambda: entry.user_tensors((other, torch.ones(2)), {}))
    text = str(err)
    assert "a parameter read in place was replaced" in text and "args[0]" in text
    assert "graph again" in text
    (mismatch,) = err.mismatches
    assert (mismatch.path, mismatch.field) == ("args[0]", "parameter")
    assert mismatch.expected == "the parameter captured there"
    assert mismatch.received.startswith("Parameter (2,) torch.float32 at 0x")
    weight.data = torch.zeros(2)  # new storage: the graph would read freed memory
    with pytest.raises(CudaGraphInputError, match="replaced or re-allocated"):
        entry.user_tensors((weight, torch.ones(2)), {})


def test_inputs_that_require_grad_where_the_sample_did_not_are_reported():
    entry = _entry(lambda a, b: a * b, (torch.zeros(2), torch.zeros(2, requires_grad=True)))
    assert entry.gradients_not_captured([torch.ones(2), torch.ones(2, requires_grad=True)]) == []
    missing = entry.gradients_not_captured(
        [torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)]
    )
    assert [(m.path, m.field, m.expected, m.received) for m in missing] == [
        (
            "args[0]",
            "requires_grad (the sample did not: no gradient was captured for it)",
            False,
            True,
        )
    ]


def test_parameters_that_require_grad_without_a_backward_graph_are_reported():
    # A capture for inference (grad off, or modules in eval) records the parameters
    # that required grad; a later call in training mode would be silently short.
    weight, bias = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    x = torch.zeros(2)
    entry = positional_entry(
        "callables[0] (Linear)",
        x,
        torch.zeros(2),
        None,
        untracked_params=(("weight", weight), ("bias", bias)),
    )
    missing = entry.gradients_not_captured([torch.ones(2)])
    assert [(m.path, m.field, m.expected, m.received) for m in missing] == [
        ("weight", "requires_grad (captured without a backward graph)", False, True),
        ("bias", "requires_grad (captured without a backward graph)", False, True),
    ]
    bias.requires_grad_(False)
    assert [m.path for m in entry.gradients_not_captured([torch.ones(2)])] == ["weight"]


def test_after_an_error_the_next_good_call_works():
    entry = _entry(_scale, (torch.zeros(2), 2.5))
    _mismatches(lambda: entry.user_tensors((torch.ones(3), 2.5), {}))
    assert entry.user_tensors((torch.full((2,), 4.0), 2.5), {})[0].tolist() == [4.0, 4.0]


def test_a_released_entry_refuses_replays_naming_the_fix():
    entry = _entry(_scale, (torch.zeros(2), 2.5))
    entry.check_live()
    entry.release()
    entry.release()  # idempotent
    with pytest.raises(GraphReleasedError) as err:
        entry.check_live()
    assert str(err.value) == (
        f"{entry.name}: its graphs were released by reset(); graph it again with "
        "make_graphed_callables"
    )
    assert entry.static_inputs == [] and entry.pinned == () and entry.out_leaves == []


# ---- the messages, exactly: a headline naming the entry, one line per difference, the fix


def _exact(entry, err, what, fix):
    assert str(err) == describe_mismatches(f"{entry.name}: {what}", err.mismatches, fix)


def test_each_refusal_says_what_differs_and_the_fix_word_for_word():
    def fn(t, *, bias, scale=None):
        return t + bias

    entry = _entry(fn, (torch.zeros(2),), {"bias": torch.zeros(2)})
    err = _mismatches(
        lambda: entry.user_tensors((torch.ones(2),), {"bias": torch.zeros(2), "scale": 2.0})
    )
    _exact(
        entry,
        err,
        "the call passes keywords the capture did not have",
        "1. pass them in sample_kwargs too, and graph again; 2. leave them out "
        "(a keyword whose default is None may be passed as None).",
    )
    err = _mismatches(lambda: entry.user_tensors((torch.ones(2), 1), {"bias": torch.zeros(2)}))
    _exact(
        entry,
        err,
        "call structure differs from the captured one",
        "Pass arguments with the same nesting and keyword names as sample_args/sample_kwargs.",
    )
    err = _mismatches(lambda: entry.user_tensors((torch.ones(3),), {"bias": torch.zeros(2)}))
    _exact(
        entry,
        err,
        "inputs differ from the captured ones (graphs have fixed shapes)",
        "Capture another graph for this shape or dtype, or pad the inputs.",
    )
    scaled = _entry(_scale, (torch.zeros(2), 2.5))
    err = _mismatches(lambda: scaled.user_tensors((torch.ones(2), 3.0), {}))
    _exact(
        scaled,
        err,
        "call differs from the captured one",
        "Non-tensor arguments are baked into the graph: pass the captured values, "
        "or graph the callable again for new ones.",
    )
    weight = torch.nn.Parameter(torch.ones(2))
    pinned = _entry(lambda w, t: w * t, (weight, torch.zeros(2)))
    err = _mismatches(
        lambda: pinned.user_tensors((torch.nn.Parameter(torch.ones(2)), torch.ones(2)), {})
    )
    _exact(
        pinned,
        err,
        "a parameter read in place was replaced",
        "args[0] must be the parameter captured there, with the storage it had at "
        "capture (it was replaced or re-allocated, e.g. by resharding or .data "
        "assignment); graph again.",
    )
