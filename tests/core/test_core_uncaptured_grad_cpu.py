"""A call that needs a gradient no captured graph computes, on the CPU: the graphs are
stand-ins that write what a captured forward would, so the replay path runs as on the
GPU.

The rule under test (pytorch#124582, torch's own ``test_graph_make_graphed_callables_
parameterless_nograd_module``): an input that requires grad where the sample did not
replays, and any backward that reaches the replay raises
:class:`~cudagraphs.UncapturedGradientError` naming that input; torch's helper returns
an output with no gradient path, so ``graphed(x) + x`` comes out silently short.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from cudagraphs import CudaGraphInputError, UncapturedGradientError
from cudagraphs.core.graphed import GraphedCallable
from cudagraphs.core.runtime import EntryGraphs
from helpers.stand_in_graphs import positional_entry


class _Doubling:
    """out = 2 * x into the static output, as a forward replay would; counts replays."""

    def __init__(self, x, out):
        self.x, self.out, self.replays = x, out, 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.x * 2)

    def reset(self):
        pass


def _graphed(params=(), sample_requires_grad=False, frozen=()):
    """A parameterless doubling captured with ``{"x": x}`` (x not requiring grad), no
    backward graph; ``params``: (name, parameter) pairs that required grad at a capture
    without a backward (grad disabled, eval mode)."""
    x = torch.zeros(3, requires_grad=sample_requires_grad)
    out = torch.zeros(3)
    leaves, in_spec = pytree.tree_flatten((({"x": x},), {}))
    _, out_spec = pytree.tree_flatten({"output": out})
    forward = _Doubling(x.detach(), out)
    graphs = EntryGraphs(
        name="callables[0] (Parameterless)",
        in_spec=in_spec,
        leaves=leaves,
        tensor_positions=(0,),
        paths=("args[0]['x']",),
        input_meta=((x.shape, x.dtype, sample_requires_grad),),
        static_inputs=[forward.x],
        params=(),
        untracked_params=tuple(params),
        frozen_params=tuple(frozen),
        fwd_graph=forward,
        out_spec=out_spec,
        out_leaves=[out],
        out_tensor_positions=(0,),
        out_differentiable=(False,),
    )
    return GraphedCallable(graphs, eager=None, module=None, captured_training=None), forward


def test_a_forward_only_call_with_an_input_that_requires_grad_replays():
    fn, forward = _graphed()
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = fn({"x": x})["output"]
    assert forward.replays == 1, "the call must replay, not be refused"
    assert out.tolist() == [2.0, 4.0, 6.0]
    assert out.requires_grad, "a backward through the output must reach the replay"


@pytest.mark.parametrize("loss", ["through_the_output", "through_output_and_input"])
def test_a_backward_that_reaches_the_replay_raises_naming_the_input(loss):
    fn, _ = _graphed()
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = fn({"x": x})["output"]
    total = out.sum() if loss == "through_the_output" else (out + x).sum()
    with pytest.raises(UncapturedGradientError) as err:
        total.backward()
    text = str(err.value)
    assert "args[0]['x']" in text and "callables[0] (Parameterless)" in text
    assert "sample inputs that require grad" in text and "torch.no_grad()" in text
    assert isinstance(err.value, CudaGraphInputError)
    assert [m.path for m in err.value.mismatches] == ["args[0]['x']"]
    assert x.grad is None, "no partial gradient may be left behind"


def test_the_next_good_call_after_the_error_works():
    fn, forward = _graphed()
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(UncapturedGradientError):
        fn({"x": x})["output"].sum().backward()
    out = fn({"x": torch.full((3,), 4.0)})["output"]
    assert forward.replays == 2 and out.tolist() == [8.0, 8.0, 8.0]
    assert not out.requires_grad, "a call like the sample gets no autograd node"


def test_under_no_grad_nothing_is_tracked():
    fn, forward = _graphed()
    with torch.no_grad():
        out = fn({"x": torch.ones(3, requires_grad=True)})["output"]
    assert forward.replays == 1 and not out.requires_grad


def test_a_parameter_without_a_backward_graph_is_named():
    weight = torch.nn.Parameter(torch.ones(3))
    fn, _ = _graphed(params=[("lin.weight", weight)])
    out = fn({"x": torch.ones(3)})["output"]
    assert out.requires_grad, "as eager's output would, since the parameter requires grad"
    with pytest.raises(UncapturedGradientError, match=r"lin\.weight: requires_grad"):
        (out * weight).sum().backward()
    weight.requires_grad_(False)  # frozen since the capture: nothing to miss
    assert not fn({"x": torch.ones(3)})["output"].requires_grad


def test_a_parameter_frozen_at_capture_and_unfrozen_since_is_named():
    # Gradual unfreezing or an adapter switch: the graphs compute no gradient for it,
    # so a backward that needs one raises instead of leaving .grad at None.
    weight = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    fn, forward = _graphed(frozen=[("lin.weight", weight)])
    assert not fn({"x": torch.ones(3)})["output"].requires_grad  # still frozen: as captured
    weight.requires_grad_(True)
    out = fn({"x": torch.ones(3)})["output"]
    assert forward.replays == 2 and out.requires_grad
    with pytest.raises(UncapturedGradientError, match=r"lin\.weight: requires_grad \(frozen"):
        (out * weight).sum().backward()
    assert weight.grad is None


def test_integer_outputs_stay_non_differentiable():
    x = torch.zeros(3)
    out = torch.zeros(3, dtype=torch.int64)

    class _Argsort(_Doubling):
        def replay(self):
            self.out.copy_(torch.argsort(self.x))

    graphs = positional_entry("callables[0] (argsort)", x, out, _Argsort(x, out))
    fn = GraphedCallable(graphs, eager=None, module=None, captured_training=None)
    got = fn(torch.tensor([3.0, 1.0, 2.0], requires_grad=True))
    assert got.tolist() == [1, 2, 0] and not got.requires_grad
