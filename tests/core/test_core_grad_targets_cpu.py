"""GradTargets.check_and_rebind on the CPU, parameter by parameter: every parameter is
looked at (an early one in place or re-bound does not end the walk), a missing
attribute counts as unbound, and the first replaced tensor raises naming it."""

import pytest
import torch
from torch import nn

from cudagraphs.core.grad_targets import prepare_grad_targets
from cudagraphs.errors import CudaGraphInputError


def params(n=3, attr="grad"):
    ps = tuple(nn.Parameter(torch.randn(2)) for _ in range(n))
    if attr != "grad":
        for p in ps:
            setattr(p, attr, torch.zeros(2))
    return ps


def targets(ps, attr="grad"):
    return prepare_grad_targets("layer", ps, tuple(f"p{i}" for i in range(len(ps))), attr)


def test_every_unbound_gradient_after_one_in_place_is_bound_again_zeroed():
    ps = params()
    t = targets(ps)
    for target in t.targets:
        target.fill_(5.0)
    ps[1].grad = None
    ps[2].grad = None
    t.check_and_rebind()
    assert ps[0].grad is t.targets[0] and torch.equal(ps[0].grad, torch.full((2,), 5.0))
    for p, target in zip(ps[1:], t.targets[1:]):
        assert p.grad is target and torch.equal(target, torch.zeros(2))


def test_a_replaced_gradient_after_an_unbound_one_raises_naming_it():
    ps = params()
    t = targets(ps)
    ps[0].grad = None
    ps[2].grad = torch.zeros(2)  # a new tensor, not the target
    with pytest.raises(CudaGraphInputError, match=r"layer: parameter p2\.grad is not the tensor"):
        t.check_and_rebind()


def test_a_missing_attribute_counts_as_unbound():
    ps = params(2, attr="main_grad")
    t = targets(ps, attr="main_grad")
    t.targets[1].fill_(3.0)
    del ps[1].main_grad
    t.check_and_rebind()
    assert ps[1].main_grad is t.targets[1] and torch.equal(ps[1].main_grad, torch.zeros(2))
    assert ps[0].main_grad is t.targets[0]


def test_targets_no_backward_graph_writes_are_dropped_and_their_grad_given_back_none():
    # allow_unused_input=True: an unused parameter's .grad stays None, as eagerly; a
    # zero tensor there would let AdamW's weight decay move it at every step.
    ps = params()
    kept = torch.ones(2)
    ps[2].grad = kept  # the user's own tensor: left as it was
    t = targets(ps)
    t.note_written([torch.ones(2), None, None])  # one entry's backward capture
    t.note_written([torch.ones(2), None, None])  # another microbatch, the same
    t.keep_written()
    assert t.names == ("p0",) and t.params == (ps[0],)
    assert ps[1].grad is None  # allocated for the capture: given back
    assert ps[2].grad is kept
    ps[0].grad = None  # zero_grad(set_to_none=True): only the written one comes back
    t.check_and_rebind()
    assert ps[0].grad is t.targets[0] and ps[1].grad is None


def test_a_target_any_entry_writes_is_kept():
    ps = params(2)
    t = targets(ps)
    t.note_written([torch.ones(2), None])
    t.note_written([None, torch.ones(2)])
    t.keep_written()
    assert t.names == ("p0", "p1")
