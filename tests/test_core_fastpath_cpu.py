"""The training fast path's logic on the CPU: accumulation targets and their guard,
whole-stack argument checks and chaining."""

import pytest
import torch
from torch import nn

import cudagraphs
from cudagraphs import CudaGraphInputError, GraphedStack, graph_stack
from cudagraphs.core import prepare_grad_targets


def _params(*shapes):
    return tuple(nn.Parameter(torch.randn(s)) for s in shapes)


def test_grad_targets_allocate_missing_grads_as_zeros_and_keep_existing_ones():
    a, b = _params(3, (2, 2))
    b.grad = torch.ones(2, 2)
    existing = b.grad
    t = prepare_grad_targets("layer", (a, b), ("a", "b"), "grad")
    assert torch.equal(a.grad, torch.zeros(3)) and t.targets[0] is a.grad
    assert t.targets[1] is existing


def test_grad_targets_on_another_attribute_must_exist_with_the_right_shape():
    (a,) = _params(3)
    with pytest.raises(
        ValueError, match=r"layer: parameter w\.weight has no tensor attribute 'main_grad'"
    ):
        prepare_grad_targets("layer", (a,), ("w.weight",), "main_grad")
    a.main_grad = torch.zeros(4)
    with pytest.raises(ValueError, match=r"w\.weight\.main_grad has shape \(4,\)"):
        prepare_grad_targets("layer", (a,), ("w.weight",), "main_grad")
    a.main_grad = torch.zeros(3, dtype=torch.float64)  # another dtype is fine (fp32 main grads)
    assert prepare_grad_targets("layer", (a,), ("w.weight",), "main_grad").targets[0] is a.main_grad


def test_guard_rebinds_grads_set_to_none_zeroed():
    a, b = _params(3, 3)
    t = prepare_grad_targets("layer", (a, b), ("a", "b"), "grad")
    a.grad.fill_(5.0)
    b.grad.fill_(7.0)
    target_a = a.grad
    a.grad = None  # zero_grad(set_to_none=True) on one of them
    t.check_and_rebind()
    assert a.grad is target_a and torch.equal(a.grad, torch.zeros(3))
    assert torch.equal(b.grad, torch.full((3,), 7.0)), "a bound grad must be left alone"


def test_guard_refuses_replaced_or_reallocated_grads():
    (a,) = _params(3)
    t = prepare_grad_targets("stack", (a,), ("layers.0.weight",), "grad")
    a.grad = torch.zeros(3)  # a new tensor: the graph would not write it
    with pytest.raises(CudaGraphInputError, match=r"stack: parameter layers\.0\.weight\.grad"):
        t.check_and_rebind()
    a.grad = t.targets[0]
    t.check_and_rebind()
    a.grad.data = torch.zeros(3)  # same object, new storage
    with pytest.raises(CudaGraphInputError, match="replaced or re-allocated"):
        t.check_and_rebind()


def test_main_grad_attr_needs_in_graph_accumulation():
    layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="main_grad_attr needs accumulate_grads_in_graph"):
        cudagraphs.make_graphed_callables(layer, (torch.randn(2, 4),), main_grad_attr="main_grad")
    with pytest.raises(ValueError, match="must be an attribute name"):
        cudagraphs.make_graphed_callables(
            layer, (torch.randn(2, 4),), accumulate_grads_in_graph=True, main_grad_attr="a.b"
        )


@pytest.mark.parametrize(
    "layers, sample, options, match",
    [
        ([], (torch.randn(2),), {}, "at least one layer"),
        ([nn.Linear(2, 2), torch.tanh], (torch.randn(2),), {}, r"layers\[1\] \("),
        ([nn.Linear(2, 2)], torch.randn(2), {}, "must be a tuple"),
        ([nn.Linear(2, 2)], (torch.randn(2),), {"_order": [1, -1]}, "no pipeline schedule"),
    ],
    ids=["empty", "function_layer", "sample_not_tuple", "order"],
)
def test_graph_stack_rejects_bad_arguments(layers, sample, options, match):
    with pytest.raises(TypeError, match=match):
        graph_stack(layers, sample, **options)


def test_graphed_stack_chains_outputs_and_splats_tuples():
    class Split(nn.Module):
        def forward(self, x):
            return x, x * 2

    class Join(nn.Module):
        def forward(self, a, b):
            return a + b

    stack = GraphedStack([nn.Identity(), Split(), Join()])
    x = torch.randn(3)
    assert torch.equal(stack(x), x * 3)
