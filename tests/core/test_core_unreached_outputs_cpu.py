"""Outputs no backward reaches (``_unreached_outputs``), on the CPU: the capture path
with an eager stand-in for ``capture_into_graph``. Such an output gets no
incoming-gradient buffer and the backward is taken without it; a replay's backward
that gives it a gradient raises before anything is copied or replayed, and one that
gives it none goes on to the graph. Validation of the argument itself is checked
against a plain reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudagraphs.core.canonicalize import canonicalize
from cudagraphs.core.capture_phase import capture_plan, check_unreached_outputs
from cudagraphs.errors import (
    CudaGraphsTypeError,
    CudaGraphsValueError,
    Mismatch,
    UncapturedGradientError,
)
from helpers.stand_in_capture import StandInCapture, cpu_options


class LossAndLogits(nn.Module):
    """A loss and the logits beside it, as an HF causal LM returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.relu(self.body(x)))
        return logits.square().mean(), logits


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def _captured(unreached, calls=None, module_type=None):
    torch.manual_seed(0)
    module = (module_type or LossAndLogits)()
    x = torch.randn(3, 4, requires_grad=True)
    plan = canonicalize((module,), ((x,),))
    real_grad = torch.autograd.grad

    def grad(outputs, inputs, grad_outputs=None, **kwargs):
        if calls is not None:
            calls.append([tuple(o.shape) for o in outputs])
        return real_grad(outputs, inputs, grad_outputs=grad_outputs, **kwargs)

    mp = pytest.MonkeyPatch()
    try:
        StandInCapture().install(mp)
        mp.setattr(torch.autograd, "grad", grad)
        (graphs,) = capture_plan(plan, cpu_options(unreached=unreached))
    finally:
        mp.undo()
    return module, x, graphs


def test_an_unreached_output_gets_no_buffer_and_the_backward_is_the_loss_alone():
    calls = []
    _, _, graphs = _captured({0: frozenset({1})}, calls)
    assert graphs.unreached_outputs == (1,)
    assert graphs.static_grad_outputs[0] is not None
    assert graphs.static_grad_outputs[1] is None  # no 6-wide buffer for the logits
    # The backward capture differentiated the loss alone.
    assert calls == [[()]]


def test_without_unreached_outputs_every_differentiable_output_gets_a_buffer():
    calls = []
    _, _, graphs = _captured({}, calls)
    assert graphs.unreached_outputs == ()
    assert calls == [[(), (3, 6)]]
    assert all(b is not None for b in graphs.static_grad_outputs)


def test_a_gradient_that_reaches_an_unreached_output_raises_before_the_replay():
    _, x, graphs = _captured({0: frozenset({1})})
    loss_grad, logits_grad = torch.ones(()), torch.ones(3, 6)
    with pytest.raises(UncapturedGradientError) as err:
        graphs.replay_backward((loss_grad, logits_grad), (x,))
    assert err.value.mismatches == [Mismatch("output[1] (leaf 1)", "gradient", None, "a tensor")]
    text = str(err.value)
    assert text.startswith(
        "callables[0] (LossAndLogits): a backward pass gave a gradient to outputs captured as "
        "getting none"
    ), text
    assert "output[1] (leaf 1)" in text and "record a step whose loss uses these outputs" in text
    # None there (autograd's "no gradient reached it") goes on to the backward graph:
    # the stand-in's graph says it was replayed.
    with pytest.raises(AssertionError, match="replayed"):
        graphs.replay_backward((loss_grad, None), (x,))


def test_positions_past_the_outputs_are_refused_naming_the_entry_and_the_count():
    with pytest.raises(CudaGraphsValueError, match=r"positions \[5\].*returns 2 tensor") as err:
        _captured({0: frozenset({1, 5})})
    assert str(err.value).startswith("callables[0] (LossAndLogits): ")
    # The first position past the end is refused too; the last one is not.
    with pytest.raises(CudaGraphsValueError, match=r"positions \[2\]"):
        _captured({0: frozenset({2})})
    _captured({0: frozenset({1})})


def test_a_call_whose_only_output_is_unreached_has_no_backward_graph_and_refuses_one():
    _, x, graphs = _captured({0: frozenset({0})}, module_type=LogitsOnly)
    assert graphs.bwd_graph is None and graphs.unreached_outputs == (0,)
    with pytest.raises(UncapturedGradientError, match=r"output\[0\]"):
        graphs.replay_backward((torch.ones(3, 6),), (x,))
    # No gradient reached it: nothing to compute, no input gets one.
    assert all(g is None for g in graphs.replay_backward((None,), (x,)))


# ---- the argument ------------------------------------------------------------------


def _reference(value, n):
    """What check_unreached_outputs accepts, written plainly: ``None``, or a dict of
    in-range int entries to collections (not strings) of non-negative ints."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        return "type"
    out = {}
    for entry, positions in value.items():
        if type(entry) is not int:
            return "type"
        if not 0 <= entry < n:
            return "value"
        if isinstance(positions, str) or not isinstance(positions, (list, tuple, set, frozenset)):
            return "type"
        if any(type(p) is not int or p < 0 for p in positions):
            return "value"
        out[entry] = frozenset(positions)
    return out


keys = st.one_of(st.integers(-2, 4), st.booleans(), st.just("0"))
positions = st.one_of(
    st.lists(st.one_of(st.integers(-1, 3), st.booleans()), max_size=3),
    st.frozensets(st.integers(0, 3), max_size=3),
    st.just("01"),
    st.integers(0, 2),
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.none(), st.dictionaries(keys, positions, max_size=3), st.just([1])),
    st.integers(1, 4),
)
def test_the_argument_is_checked_like_a_plain_reference(value, n):
    expected = _reference(value, n)
    if expected == "type":
        with pytest.raises(CudaGraphsTypeError) as err:
            check_unreached_outputs(value, n)
    elif expected == "value":
        with pytest.raises(CudaGraphsValueError) as err:
            check_unreached_outputs(value, n)
    else:
        assert check_unreached_outputs(value, n) == expected
        return
    # What was wrong and where: the argument, and the entry or the type it got.
    text = str(err.value)
    assert text.startswith("_unreached_outputs"), text
    if not isinstance(value, dict):
        assert type(value).__name__ in text, text
    else:
        assert any(repr(k) in text or f"[{k}]" in text or f"entry {k}" in text for k in value)


def test_position_zero_and_every_collection_kind_are_accepted():
    assert check_unreached_outputs({0: [0]}, 1) == {0: frozenset({0})}
    assert check_unreached_outputs({1: (0, 2), 0: {3}}, 2) == {1: frozenset({0, 2}), 0: {3}}
    assert check_unreached_outputs(None, 3) == {} and check_unreached_outputs({}, 3) == {}


def test_each_refusal_names_what_it_got():
    with pytest.raises(CudaGraphsTypeError, match="got list"):
        check_unreached_outputs([1], 2)
    with pytest.raises(CudaGraphsTypeError, match=r"entry index '0' is not an int"):
        check_unreached_outputs({"0": [1]}, 2)
    with pytest.raises(CudaGraphsValueError, match=r"entry 3 is out of range \(there are 2"):
        check_unreached_outputs({3: [1]}, 2)
    with pytest.raises(CudaGraphsTypeError, match=r"_unreached_outputs\[1\] must be .* got int"):
        check_unreached_outputs({1: 5}, 2)
    with pytest.raises(CudaGraphsValueError, match=r"_unreached_outputs\[0\]: \[-1\] are not"):
        check_unreached_outputs({0: [1, -1]}, 2)
    for bad in (True, 1.5, "1"):
        with pytest.raises(CudaGraphsValueError, match=r"are not output positions"):
            check_unreached_outputs({0: [0, bad]}, 1)
