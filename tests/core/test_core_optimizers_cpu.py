"""``make_graphed_callables(optimizers=...)``: what it accepts, and the typed error
(naming the argument, the entry and the fix) for anything else, before any GPU work."""

from __future__ import annotations

import pytest
import torch

import cudagraphs
from cudagraphs.checks import check_optimizers
from cudagraphs.errors import CudaGraphsTypeError


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)


def test_one_optimizer_a_list_a_tuple_or_none_are_accepted():
    a, b = _opt(), _opt()
    assert check_optimizers("optimizers", a) == (a,)
    assert check_optimizers("optimizers", [a, b]) == (a, b)
    assert check_optimizers("optimizers", (b,)) == (b,)
    assert check_optimizers("optimizers", ()) == ()
    assert check_optimizers("optimizers", (o for o in [a])) == (a,)


@pytest.mark.parametrize("bad", [3, "adam", {"opt": 1}, None])
def test_a_non_iterable_is_refused_with_the_fix(bad):
    with pytest.raises(
        CudaGraphsTypeError, match=r"optimizers must be .*optimizers=\(optimizer,\)"
    ):
        check_optimizers("optimizers", bad)


def test_the_first_entry_that_is_not_an_optimizer_is_named():
    with pytest.raises(
        CudaGraphsTypeError, match=r"optimizers\[1\] must be a torch.optim.Optimizer, got str"
    ):
        check_optimizers("optimizers", [_opt(), "adam", 3])


def test_make_graphed_callables_refuses_before_any_gpu_work():
    # On this CPU machine the refusal comes before the missing device's error.
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CudaGraphsTypeError, match=r"optimizers\[0\]"):
        cudagraphs.make_graphed_callables(model, (torch.zeros(1, 2),), optimizers=[model])


def test_graph_stack_passes_them_through():
    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.raises(CudaGraphsTypeError, match=r"optimizers must be"):
        cudagraphs.graph_stack(layers, (torch.zeros(1, 2),), optimizers=1.5)
