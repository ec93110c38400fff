"""Helpers of the GPU tests of make_graphed_callables (tests/core/test_cuda_core_*.py):
small blocks and stacks, inputs drawn from seeds, and the eager reference they are
compared with."""

import torch
from torch import nn

from helpers.asserts import assert_bitwise_equal, contain_failed_capture

HIDDEN = 32
FFN = 64


def _randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    # Drawn on the CPU so that values do not depend on the CUDA generator's state.
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)
    return t.requires_grad_(requires_grad)


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).to(
        device="cuda", dtype=dtype
    )


_assert_equal = assert_bitwise_equal


def _assert_param_grads_equal(graphed, eager, what):
    for (name, p), (_, q) in zip(graphed.named_parameters(), eager.named_parameters()):
        if p.grad is None and q.grad is None:
            continue  # e.g. an unused parameter
        _assert_equal(p.grad, q.grad, f"{what}: grad of {name}")


_contain_failed_capture = contain_failed_capture


def _check_train_step(graphed, eager, x_seed, g_seed, shape, dtype, what):
    x = _randn(*shape, seed=x_seed, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = _randn(*shape, seed=g_seed, dtype=dtype)
    out = graphed(x)
    out_ref = eager(x_ref)
    _assert_equal(out, out_ref, f"{what}: output")
    out.backward(grad)
    out_ref.backward(grad)
    _assert_equal(x.grad, x_ref.grad, f"{what}: input grad")
    _assert_param_grads_equal(graphed, eager, what)


def _detached_copies(*tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def count_replays(graphs, which="bwd_graph"):
    """Wrap an entry's ``which`` graph (``"fwd_graph"`` or ``"bwd_graph"`` of an
    ``EntryGraphs``) so that its replays are counted; returns a function giving the
    count."""
    real = getattr(graphs, which)
    count = [0]

    class _Counting:
        def replay(self):
            count[0] += 1
            real.replay()

        def reset(self):
            real.reset()

    setattr(graphs, which, _Counting())
    return lambda: count[0]


def count_backward_replays(graphs):
    """:func:`count_replays` of the backward graph."""
    return count_replays(graphs, "bwd_graph")
