"""make_graphed_callables and graph_stack on the GPU over the layers of a tiny OLMoE
(2 layers, hidden 64, 4 experts): float32 with transformers' default grouped_mm experts
ends in the UnsupportedModelError naming the experts and the fixes, before anything is
captured (or, on a torch whose grouped GEMM runs float32 on the device, replays); the
two fixes (bfloat16 weights, batched_mm experts) replay, their forward equal to the
eager layers' and their gradients close."""

import copy

import pytest
import torch

from cudagraphs import graph_stack, make_graphed_callables
from cudagraphs.errors import UnsupportedModelError
from cudagraphs.moe_kernels import GroupedMMProbe
from helpers.asserts import assert_bitwise_equal
from helpers.moe_models import FIXES, moe, roped_layers

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

SHAPE = (2, 16, 64)
# Gradients: the index backward of the experts' gathers adds with atomics, in any order.
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}


def olmoe_layers(dtype, implementation=None):
    model = moe("olmoe", dtype, implementation, device="cuda").train()
    hidden = torch.randn(*SHAPE, device="cuda", dtype=dtype, requires_grad=True)
    return roped_layers(model, hidden), hidden


def float32_syncs():
    return not GroupedMMProbe().on_device(torch.zeros(1, device="cuda"))


def counting_forward_replays(graphed_modules):
    """Count forward-graph replays of each graphed module (a stand-in around each graph)."""
    count = [0]
    for module in graphed_modules:
        graphs = module.cuda_graph.graphs
        real = graphs.fwd_graph

        class Counting:
            def replay(self, real=real):
                count[0] += 1
                real.replay()

            def reset(self, real=real):
                real.reset()

        graphs.fwd_graph = Counting()
    return lambda: count[0]


def chain(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_float32_grouped_mm_layers_end_in_the_named_fixes():
    layers, hidden = olmoe_layers(torch.float32)
    if not float32_syncs():
        pytest.skip("this torch runs float32 grouped GEMMs on the device: the layers graph")
    with pytest.raises(UnsupportedModelError) as err:
        make_graphed_callables(tuple(layers), tuple((hidden,) for _ in layers))
    text = str(err.value)
    assert "callables[0] (RopedLayer).layer.mlp.experts" in text
    assert "callables[1] (RopedLayer).layer.mlp.experts" in text
    assert "float32 on cuda:0" in text and all(fix in text for fix in FIXES), text
    assert not any(hasattr(layer, "cuda_graph") for layer in layers), "nothing was graphed"
    chain(layers, hidden).sum().backward()  # the layers still train eagerly


def test_graph_stack_of_float32_grouped_mm_layers_ends_in_the_named_fixes():
    layers, hidden = olmoe_layers(torch.float32)
    if not float32_syncs():
        pytest.skip("this torch runs float32 grouped GEMMs on the device: the stack graphs")
    with pytest.raises(UnsupportedModelError, match=r"\(GraphedStack\)\.layers\.0\.layer\.mlp"):
        graph_stack(layers, (hidden,))


@pytest.mark.parametrize(
    "dtype, implementation",
    [(torch.bfloat16, None), (torch.float32, "batched_mm")],
    ids=["bfloat16_grouped_mm", "float32_batched_mm"],
)
def test_the_fixed_layers_replay(dtype, implementation):
    if dtype == torch.bfloat16 and not GroupedMMProbe().on_device(
        torch.zeros(1, device="cuda", dtype=dtype)
    ):
        pytest.skip("torch's bfloat16 grouped GEMM is not on the device on this GPU")
    layers, hidden = olmoe_layers(dtype, implementation)
    eager = copy.deepcopy(layers)
    graphed = make_graphed_callables(tuple(layers), tuple((hidden,) for _ in layers))
    replays = counting_forward_replays(graphed)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*SHAPE, generator=g).to("cuda", dtype).requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        out, ref = chain(graphed, x), chain(eager, x_ref)
        assert_bitwise_equal(out, ref, f"step {seed}: output")
        out.float().pow(2).mean().backward()
        ref.float().pow(2).mean().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, **TOLERANCE[dtype])
    assert replays() == 3 * len(layers), "every forward replayed its graph"
    for (name, p), (_, q) in zip(layers[0].named_parameters(), eager[0].named_parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOLERANCE[dtype], msg=name)


def test_a_bfloat16_stack_replays():
    if not GroupedMMProbe().on_device(torch.zeros(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch's bfloat16 grouped GEMM is not on the device on this GPU")
    layers, hidden = olmoe_layers(torch.bfloat16)
    eager = copy.deepcopy(layers)
    stack = graph_stack(layers, (hidden,))
    replays = counting_forward_replays([stack])
    x = torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert_bitwise_equal(stack(x), chain(eager, x), "stack output")
    assert replays() == 1
