"""The training fast path's logic on the CPU: accumulation targets and their guard,
whole-stack argument checks and chaining."""

from types import SimpleNamespace

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
        ([nn.Linear(2, 2)], (torch.randn(2),), {"sample_kwargs": {}}, "sample_kwargs"),
    ],
    ids=["empty", "function_layer", "sample_not_tuple", "order", "sample_kwargs"],
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


def test_a_stacks_training_flag_is_its_layers_so_a_model_mode_switch_reaches_it():
    # The stack sits outside the user's model: model.eval() reaches the layers only.
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    stack = GraphedStack(list(model))
    assert stack.training is True
    model.eval()
    assert stack.training is False
    model[0].train()
    assert stack.training is None  # mixed: matches no captured mode, so runs eagerly
    stack.eval()  # nn.Module.eval() on the stack still reaches every layer
    assert [m.training for m in model] == [False, False] and stack.training is False


def test_a_stack_captured_in_training_runs_eagerly_once_the_model_is_in_eval():
    from cudagraphs.core.graphed import GraphedCallable

    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    stack = GraphedStack(list(model))
    calls = []
    graphs = SimpleNamespace(replay_keywords=None)  # nothing of it is replayed
    graphed = GraphedCallable(graphs, lambda x: calls.append(x) or x, stack, True)
    model.eval()
    x = torch.randn(2)
    assert graphed(x) is x and calls == [x]  # the eager forward, not the training graph


def test_graph_stack_refuses_layers_in_mixed_modes_naming_the_eval_ones():
    layers = [nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)]
    layers[1].eval()
    with pytest.raises(ValueError, match=r"layers \[1\] are in eval mode"):
        graph_stack(layers, (torch.randn(2),))


class _FakeGraph:
    """Stands in for a CUDA graph on the CPU: replay() runs a Python function."""

    def __init__(self, run):
        self.run, self.replays = run, 0

    def replay(self):
        self.replays += 1
        self.run()

    def reset(self):
        pass


def _in_graph_entry(weights):
    """out = x * w0 (+ w1 ...), with a fake backward graph that adds each weight's
    gradient into its accumulation target, as an in-graph-accumulating capture does."""
    from torch.utils import _pytree as pytree

    from cudagraphs.core.graphed import GraphedCallable
    from cudagraphs.core.runtime import EntryGraphs

    x_buf, out_buf, go_buf = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    targets = prepare_grad_targets(
        "f", weights, tuple(f"w{i}" for i in range(len(weights))), "grad"
    )

    def forward():
        out_buf.copy_(x_buf * sum(w.detach() for w in weights))

    def backward():
        for t in targets.targets:
            t.add_(go_buf * x_buf)

    leaves, spec = pytree.tree_flatten(((x_buf,), {}))
    _, out_spec = pytree.tree_flatten(out_buf)
    g = EntryGraphs(
        name="f",
        in_spec=spec,
        leaves=leaves,
        tensor_positions=(0,),
        paths=("args[0]",),
        input_meta=((x_buf.shape, x_buf.dtype, False),),
        static_inputs=[x_buf],
        params=tuple(weights),
        fwd_graph=_FakeGraph(forward),
        bwd_graph=_FakeGraph(backward),
        out_spec=out_spec,
        out_leaves=[out_buf],
        out_tensor_positions=(0,),
        out_differentiable=(True,),
        static_grad_outputs=[go_buf],
        static_grad_inputs=(None,) * len(weights),
        grad_targets=targets,
    )

    return g, GraphedCallable(g, eager=None, module=None, captured_training=None)


def test_in_graph_accumulation_tracks_one_parameter_and_hands_autograd_no_gradient():
    w0, w1 = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    g, graphed = _in_graph_entry((w0, w1))
    assert g.autograd_params == (w0,), "one anchor parameter, not one edge per parameter"
    x = torch.tensor([1.0, 2.0, 3.0])  # requires no grad: the anchor keeps y differentiable
    y = graphed(x)
    assert y.requires_grad
    y.sum().backward()
    assert g.bwd_graph.replays == 1
    # Only the graph's own addition: autograd added nothing on top (no doubling).
    assert torch.equal(w0.grad, x) and torch.equal(w1.grad, x)
    graphed(x).sum().backward()
    assert torch.equal(w0.grad, 2 * x), "accumulates across backwards"
    w0.grad = None  # zero_grad(set_to_none=True)
    graphed(x).sum().backward()
    assert torch.equal(w0.grad, x) and torch.equal(w1.grad, 3 * x)


def test_in_graph_accumulation_refuses_a_backward_that_adds_into_no_grad():
    # torch.autograd.grad (a gradient penalty, a saliency map): eager leaves .grad
    # alone, so the graph, which adds into .grad itself, must not replay.
    w0 = nn.Parameter(torch.ones(3))
    g, graphed = _in_graph_entry((w0,))
    x = torch.tensor([1.0, 2.0, 3.0])
    y = graphed(x)
    with pytest.raises(cudagraphs.CudaGraphsStateError, match="accumulate_grads_in_graph"):
        torch.autograd.grad(y.sum(), w0)
    # .grad as the capture left it (zeros, allocated for the graph to add into).
    assert torch.equal(w0.grad, torch.zeros(3)) and g.bwd_graph.replays == 0
    graphed(x).sum().backward()  # the next plain backward works
    assert torch.equal(w0.grad, x)
