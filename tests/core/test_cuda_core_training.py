"""make_graphed_callables on a real GPU: training equal to eager, unused inputs, inference
and train/eval switching, random numbers.

Graphed results must equal eager results exactly where the same kernels run, so every
comparison here is ``torch.equal``. The eager reference is a deep copy taken before
graphing, fed with identical inputs.
"""

import copy

import pytest
import torch
from torch import nn

from cudagraphs import (
    GraphedCallable,
    make_graphed_callables,
)
from cudagraphs.models import BlockConfig, PreNormBlock
from helpers.core_cuda import (
    HIDDEN,
    _assert_equal,
    _assert_param_grads_equal,
    _check_train_step,
    _detached_copies,
    _mlp,
    _randn,
)

pytestmark = pytest.mark.cuda

BATCH = 4


# ---- training equality -----------------------------------------------------------------


def test_mlp_training_equals_eager():
    module = _mlp()
    eager = copy.deepcopy(module)
    sample = _randn(BATCH, HIDDEN, seed=100, requires_grad=True)
    graphed = make_graphed_callables(module, (sample,))
    assert graphed is module, "a single module is returned itself"
    assert isinstance(module.cuda_graph, GraphedCallable)
    for it in range(4):
        module.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        _check_train_step(
            module, eager, 10 + it, 20 + it, (BATCH, HIDDEN), torch.float32, f"iteration {it}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prenorm_block_with_sdpa_training_equals_eager(dtype):
    torch.manual_seed(0)
    block = PreNormBlock(BlockConfig(hidden=64, heads=4, ffn=128)).to(device="cuda", dtype=dtype)
    eager = copy.deepcopy(block)
    shape = (2, 8, 64)
    make_graphed_callables(block, (_randn(*shape, seed=1, dtype=dtype, requires_grad=True),))
    for it in range(3):
        block.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        _check_train_step(block, eager, 30 + it, 40 + it, shape, dtype, f"iteration {it}")


class _ScaledMasked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, *, scale_tensor, mask=None):
        y = self.lin(x) * scale_tensor
        if mask is not None:
            y = torch.where(mask, y, torch.zeros_like(y))
        return y


def _kwargs_inputs(seed):
    x = _randn(BATCH, HIDDEN, seed=seed, requires_grad=True)
    scale = _randn(HIDDEN, seed=seed + 1, requires_grad=True)
    mask = _randn(BATCH, HIDDEN, seed=seed + 2) > 0
    return x, scale, mask


def _check_kwargs_step(module, eager, seed, reverse_kwargs):
    x, scale, mask = _kwargs_inputs(seed)
    x_ref, scale_ref, mask_ref = _detached_copies(x, scale, mask)
    if reverse_kwargs:
        out = module(x, mask=mask, scale_tensor=scale)
    else:
        out = module(x, scale_tensor=scale, mask=mask)
    out_ref = eager(x_ref, scale_tensor=scale_ref, mask=mask_ref)
    _assert_equal(out, out_ref, f"seed {seed}: output")
    grad = _randn(BATCH, HIDDEN, seed=seed + 3)
    out.backward(grad)
    out_ref.backward(grad)
    _assert_equal(x.grad, x_ref.grad, f"seed {seed}: grad of x")
    _assert_equal(scale.grad, scale_ref.grad, f"seed {seed}: grad of kwarg scale_tensor")
    _assert_param_grads_equal(module, eager, f"seed {seed}")


def test_kwargs_inputs_replay_and_get_grads():
    torch.manual_seed(0)
    module = _ScaledMasked().cuda()
    eager = copy.deepcopy(module)
    x, scale, mask = _kwargs_inputs(1)
    make_graphed_callables(module, (x,), sample_kwargs={"scale_tensor": scale, "mask": mask})
    for it in range(3):
        module.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        _check_kwargs_step(module, eager, 10 * (it + 1), reverse_kwargs=False)


def test_kwargs_order_at_the_call_site_does_not_matter():
    # Python keyword arguments have no meaningful order; a replay that passes the same
    # keywords in another order than sample_kwargs is the same call.
    torch.manual_seed(0)
    module = _ScaledMasked().cuda()
    eager = copy.deepcopy(module)
    x, scale, mask = _kwargs_inputs(1)
    make_graphed_callables(module, (x,), sample_kwargs={"scale_tensor": scale, "mask": mask})
    _check_kwargs_step(module, eager, 50, reverse_kwargs=True)


# ---- unused inputs ---------------------------------------------------------------------


def _uses_first_only(a, b):
    return a * 2


def test_unused_input_needs_allow_unused_input():
    a = _randn(8, seed=1, requires_grad=True)
    b = _randn(8, seed=2, requires_grad=True)
    with pytest.raises(ValueError, match="allow_unused_input"):
        make_graphed_callables(_uses_first_only, (a, b))

    graphed = make_graphed_callables(_uses_first_only, (a, b), allow_unused_input=True)
    assert isinstance(graphed, GraphedCallable)
    a2 = _randn(8, seed=3, requires_grad=True)
    b2 = _randn(8, seed=4, requires_grad=True)
    out = graphed(a2, b2)
    _assert_equal(out, a2.detach() * 2, "output")
    grad = _randn(8, seed=5)
    out.backward(grad)
    _assert_equal(a2.grad, grad * 2, "grad of the used input")
    assert b2.grad is None, f"the unused input must get no gradient, got {b2.grad}"


class _WithUnusedParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.unused = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x):
        return self.lin(x)


def test_unused_parameter_needs_allow_unused_input():
    torch.manual_seed(0)
    module = _WithUnusedParam().cuda()
    eager = copy.deepcopy(module)
    sample = _randn(BATCH, HIDDEN, seed=1, requires_grad=True)
    with pytest.raises(ValueError, match="allow_unused_input"):
        make_graphed_callables(module, (sample,))
    assert "forward" not in module.__dict__, "a failed graphing must leave the module alone"

    make_graphed_callables(module, (sample,), allow_unused_input=True)
    _check_train_step(module, eager, 2, 3, (BATCH, HIDDEN), torch.float32, "unused param")
    assert module.unused.grad is None, "the unused parameter must get no gradient"


# ---- inference, train/eval switching ---------------------------------------------------


def test_inference_graph_and_eager_fallback_in_train_mode():
    module = _mlp().eval()
    eager = copy.deepcopy(module)
    with torch.no_grad():
        make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1),))
        for seed in (2, 3):
            x = _randn(BATCH, HIDDEN, seed=seed)
            out = module(x)
            _assert_equal(out, eager(x), f"inference output (seed {seed})")
            assert not out.requires_grad, "an inference replay must not require grad"
    assert module.cuda_graph.graphs.bwd_graph is None, "inference captures no backward graph"

    # In train mode the module runs its original forward: autograd flows eagerly.
    module.train()
    eager.train()
    x = _randn(BATCH, HIDDEN, seed=4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = module(x)
    assert out.requires_grad and out.grad_fn is not None
    assert "Replay" not in type(out.grad_fn).__name__, (
        f"train mode must run eagerly, got grad_fn {type(out.grad_fn).__name__}"
    )
    out_ref = eager(x_ref)
    _assert_equal(out, out_ref, "eager train-mode output")
    grad = _randn(BATCH, HIDDEN, seed=5)
    out.backward(grad)
    out_ref.backward(grad)
    _assert_equal(x.grad, x_ref.grad, "eager train-mode input grad")
    _assert_param_grads_equal(module, eager, "eager train mode")

    # Back in eval mode the graph replays again.
    module.eval()
    eager.eval()
    with torch.no_grad():
        x = _randn(BATCH, HIDDEN, seed=6)
        _assert_equal(module(x), eager(x), "inference output after switching back")


# ---- RNG -------------------------------------------------------------------------------


def test_dropout_gets_a_fresh_mask_each_replay_and_backward_uses_it():
    module = nn.Dropout(p=0.5).cuda()
    shape = (64, 256)
    make_graphed_callables(module, (torch.ones(*shape, device="cuda", requires_grad=True),))
    masks = []
    for it in range(3):
        x = torch.ones(*shape, device="cuda", requires_grad=True)
        out = module(x)
        values = set(torch.unique(out.detach()).tolist())
        assert values <= {0.0, 2.0}, f"replay {it}: dropout(p=0.5) of ones gave {values}"
        zeros = (out == 0).float().mean().item()
        assert 0.45 < zeros < 0.55, f"replay {it}: {zeros:.3f} of the elements were dropped"
        out.backward(torch.ones_like(out))
        # d(out)/dx = mask * 2 = out for x = 1: the backward replay used this forward's mask.
        _assert_equal(x.grad, out.detach(), f"replay {it}: grad vs the forward mask")
        masks.append(out.detach().clone())
    assert not torch.equal(masks[0], masks[1]), "replays 0 and 1 used the same dropout mask"
    assert not torch.equal(masks[1], masks[2]), "replays 1 and 2 used the same dropout mask"
