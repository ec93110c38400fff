"""The training fast path on a GPU: whole-stack capture and in-graph gradient
accumulation give the losses and gradients of eager training, bitwise, over several
AdamW steps with gradient accumulation over microbatches; and every guard case."""

import pytest
import torch

from cudagraphs import CudaGraphInputError, graph_stack, make_graphed_callables
from cudagraphs.models import BlockConfig, make_block_stack
from helpers.asserts import assert_bitwise_equal

pytestmark = pytest.mark.cuda

CFG = BlockConfig(hidden=64, heads=4, ffn=128)
LAYERS, BATCH, SEQ = 3, 2, 16
STEPS, MICROBATCHES = 3, 2


def _blocks():
    return make_block_stack(LAYERS, CFG, dtype=torch.float32).train()


def _x(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ, CFG.hidden, generator=g).cuda()


def _samples():
    return tuple(
        (torch.randn(BATCH, SEQ, CFG.hidden, device="cuda", requires_grad=i > 0),)
        for i in range(LAYERS)
    )


def _train(forward, blocks, *, grad_attr="grad", set_to_none=True):
    """STEPS AdamW steps of MICROBATCHES microbatches each; per step the losses and a
    snapshot of every parameter's accumulated gradient."""
    params = list(blocks.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    history = []
    for step in range(STEPS):
        losses = []
        for mb in range(MICROBATCHES):
            loss = forward(_x(100 * step + mb)).pow(2).mean()
            loss.backward()
            losses.append(loss.detach().clone())
        grads = [getattr(p, grad_attr).clone() for p in params]
        history.append((losses, grads))
        if grad_attr != "grad":
            for p in params:
                p.grad = p.main_grad.clone()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if grad_attr != "grad":
            for p in params:
                p.main_grad.zero_()
    return history


def _run_layers(layers):
    def forward(x):
        for layer in layers:
            x = layer(x)
        return x

    return forward


def _assert_same_history(got, want, what):
    for step, ((losses, grads), (ref_losses, ref_grads)) in enumerate(zip(got, want)):
        for mb, (a, b) in enumerate(zip(losses, ref_losses)):
            assert_bitwise_equal(a, b, f"{what}: step {step} microbatch {mb} loss")
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            assert_bitwise_equal(a, b, f"{what}: step {step} gradient of parameter {i}")


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_in_place"])
def test_in_graph_accumulation_per_layer_equals_eager(set_to_none):
    eager = _blocks()
    want = _train(_run_layers(eager), eager, set_to_none=set_to_none)
    blocks = _blocks()
    graphed = make_graphed_callables(tuple(blocks), _samples(), accumulate_grads_in_graph=True)
    got = _train(_run_layers(graphed), blocks, set_to_none=set_to_none)
    _assert_same_history(got, want, "per-layer graphs, in-graph accumulation")


@pytest.mark.parametrize("in_graph", [False, True], ids=["autograd_accumulation", "in_graph"])
def test_whole_stack_equals_eager(in_graph):
    eager = _blocks()
    want = _train(_run_layers(eager), eager)
    blocks = _blocks()
    stack = graph_stack(list(blocks), (_x(7),), accumulate_grads_in_graph=in_graph)
    got = _train(stack, blocks)
    _assert_same_history(got, want, f"whole stack (in_graph={in_graph})")
    stack.reset()


def test_whole_stack_accumulates_into_main_grad():
    eager = _blocks()
    # The eager reference accumulates into .grad; with fp32 parameters the graph's
    # fp32 main_grad holds the same sums.
    want = _train(_run_layers(eager), eager)
    blocks = _blocks()
    for p in blocks.parameters():
        p.main_grad = torch.zeros_like(p)
    stack = graph_stack(
        list(blocks), (_x(7),), accumulate_grads_in_graph=True, main_grad_attr="main_grad"
    )
    got = _train(stack, blocks, grad_attr="main_grad")
    _assert_same_history(got, want, "whole stack into main_grad")


def test_a_replaced_grad_is_refused_before_the_backward_replay():
    blocks = _blocks()
    stack = graph_stack(list(blocks), (_x(7),), accumulate_grads_in_graph=True)
    first = blocks[0].qkv.weight
    first.grad = torch.zeros_like(first)  # a new tensor the graph does not write
    loss = stack(_x(1)).pow(2).mean()
    with pytest.raises(CudaGraphInputError, match=r"layers\.0\.qkv\.weight\.grad"):
        loss.backward()


def test_set_to_none_grads_are_rebound_zeroed():
    blocks = _blocks()
    stack = graph_stack(list(blocks), (_x(7),), accumulate_grads_in_graph=True)
    targets = [p.grad for p in blocks.parameters()]
    stack(_x(1)).pow(2).mean().backward()
    first = [t.clone() for t in targets]
    for p in blocks.parameters():
        p.grad = None
    stack(_x(1)).pow(2).mean().backward()
    for p, t, f in zip(blocks.parameters(), targets, first):
        assert p.grad is t, "the captured target must be bound again"
        assert_bitwise_equal(p.grad, f, "one backward after set_to_none: no stale sum")
