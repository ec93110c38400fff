"""What torch's own tests of make_graphed_callables ask of a helper, on a real GPU: a
process that froze the cudnn flags (torch's harness does), a parameterless module
captured with inputs that do not require grad and called with inputs that do
(pytorch#124582), and a forward-only capture called with grad enabled."""

import copy
import inspect

import pytest
import torch
from torch import nn

from cudagraphs import UncapturedGradientError, make_graphed_callables
from helpers.core_cuda import _mlp, _randn, count_replays

pytestmark = pytest.mark.cuda

N, D = 64, 32


class _Parameterless(nn.Module):
    def forward(self, input_dict):
        x = input_dict["x"]
        idx = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx)}


@pytest.fixture
def frozen_cudnn_flags_with_benchmark():
    keep = dict.fromkeys(inspect.signature(torch.backends.cudnn.flags).parameters)
    with torch.backends.cudnn.flags(**{**keep, "benchmark": True}):
        torch.backends.disable_global_flags()
        try:
            yield
        finally:
            globals_ = torch.backends.disable_global_flags.__globals__
            globals_["__allow_nonbracketed_mutation_flag"] = True


def test_graphing_works_where_the_cudnn_flags_are_frozen(frozen_cudnn_flags_with_benchmark):
    module = _mlp()
    eager = copy.deepcopy(module)
    make_graphed_callables(module, (_randn(4, 32, seed=1, requires_grad=True),))
    assert torch.backends.cudnn.benchmark is True, "the caller's flag is restored"
    replays = count_replays(module.cuda_graph.graphs, "fwd_graph")
    x = _randn(4, 32, seed=2, requires_grad=True)
    assert torch.equal(module(x), eager(x)) and replays() == 1


def test_a_parameterless_module_called_with_inputs_that_require_grad_replays():
    module = _Parameterless()
    sample = {"x": _randn(N, D, seed=1), "unused_input": _randn(N, D, seed=2)}
    make_graphed_callables(module, (sample,), allow_unused_input=True)
    replays = count_replays(module.cuda_graph.graphs, "fwd_graph")
    unused = _randn(N, D, seed=3)
    for seed in range(4, 7):  # forward-only use, as torch's test makes it
        x = _randn(N, D, seed=seed, requires_grad=True)
        got = module({"x": x, "unused_input": unused})["output"]
        want = _Parameterless()({"x": x, "unused_input": unused})["output"]
        assert torch.equal(got, want)
    assert replays() == 3, "every call must have replayed"

    x = _randn(N, D, seed=8, requires_grad=True)
    for loss in (
        lambda: module({"x": x, "unused_input": unused})["output"].sum(),
        lambda: (module({"x": x, "unused_input": unused})["output"] + x).sum(),
    ):
        with pytest.raises(UncapturedGradientError, match=r"args\[0\]\['x'\]") as err:
            loss().backward()
        assert "sample inputs that require grad" in str(err.value)
        assert x.grad is None, "no gradient may be left short"
    # After the error, a good call works and replays.
    y = _randn(N, D, seed=9)
    got = module({"x": y, "unused_input": unused})["output"]
    assert torch.equal(got, _Parameterless()({"x": y, "unused_input": unused})["output"])
    assert replays() == 6


def test_a_forward_only_capture_called_with_grad_names_the_parameters():
    module = _mlp()
    eager = copy.deepcopy(module)
    with torch.no_grad():
        make_graphed_callables(module, (_randn(4, 32, seed=1),))
    assert module.cuda_graph.graphs.bwd_graph is None
    x = _randn(4, 32, seed=2)
    out = module(x)
    assert torch.equal(out, eager(x)) and out.requires_grad  # as eager's would
    with pytest.raises(UncapturedGradientError, match=r"0\.weight: requires_grad"):
        out.sum().backward()
    assert all(p.grad is None for p in module.parameters())
    with torch.no_grad():
        assert torch.equal(module(x), eager(x))
