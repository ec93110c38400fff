"""GraphedCallable.replay_checked on a GPU: from a call's tensor leaves it replays what
a call with the arguments replays (outputs and every gradient bitwise equal), still
refuses a replaced parameter read in place, and refuses graphs made under
CUDAGRAPHS_DISABLE."""

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import cudagraphs
from cudagraphs.errors import CudaGraphInputError, CudaGraphsStateError
from cudagraphs.settings import DISABLE_ENV

pytestmark = pytest.mark.cuda


def fn(params, x, *, scale):
    (w,) = params
    return torch.tanh(x @ w) * scale


def graphed_fn():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8, device="cuda"))
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    scale = torch.full((1,), 2.0, device="cuda")
    g = cudagraphs.make_graphed_callables(fn, ((w,), x), sample_kwargs={"scale": scale})
    return g, w


def leaves(w, x, scale):
    flat, _ = pytree.tree_flatten((((w,), x), {"scale": scale}))
    return [t for t in flat if isinstance(t, torch.Tensor)]


def test_replay_from_checked_tensors_equals_the_call_with_arguments():
    g, w = graphed_fn()
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    scale = torch.full((1,), 3.0, device="cuda")
    out = g((w,), x, scale=scale).clone()
    out.sum().backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    again = g.replay_checked(leaves(w, x, scale))
    assert torch.equal(again, out)
    again.sum().backward()
    assert torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])


def test_a_replaced_parameter_is_refused_from_checked_tensors_too():
    g, w = graphed_fn()
    other = nn.Parameter(w.detach().clone())
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with pytest.raises(CudaGraphInputError, match="parameter read in place was replaced"):
        g.replay_checked(leaves(other, x, torch.ones(1, device="cuda")))


def test_graphs_made_under_disable_have_nothing_to_replay(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    g, w = graphed_fn()
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with pytest.raises(CudaGraphsStateError, match="CUDAGRAPHS_DISABLE"):
        g.replay_checked(leaves(w, x, torch.ones(1, device="cuda")))
