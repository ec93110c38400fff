"""Replay from checked tensors (CPU): a variant captured by the core's graphs replays
through ``GraphedCallable.replay_checked`` with the parameters then the call's tensors,
so a call is flattened and checked once (by the partial contract); any other capture
backend is called with the arguments. The GPU tests run the real graphs both ways."""

from types import SimpleNamespace

import torch
from torch import nn

from cudagraphs.core.graphed import GraphedCallable
from cudagraphs.partial import PartialCudaGraphManager
from cudagraphs.partial.contract import flatten_call
from cudagraphs.partial.graphing import replay_from_tensors
from cudagraphs.partial.recording import RecordedVariant


def graphed(in_spec, eager_only=False):
    graphs = SimpleNamespace(
        in_spec=in_spec, eager_only=eager_only, name="g", release=lambda: None, released=False
    )
    return GraphedCallable(graphs, eager=lambda *a, **k: None, module=None, captured_training=None)


PARAMS = (nn.Parameter(torch.ones(2)),)
ARGS = (torch.zeros(3), 4)
KWARGS = {"mask": None, "scale": torch.ones(1)}


def spec_of(params, args, kwargs):
    return flatten_call((tuple(params), *args), kwargs)[1]


def test_the_core_graph_of_the_same_call_replays_from_checked_tensors():
    g = graphed(spec_of(PARAMS, ARGS, KWARGS))
    assert replay_from_tensors(g, PARAMS, ARGS, KWARGS) == g.replay_checked


def test_another_call_structure_or_no_samples_keep_the_argument_call():
    assert replay_from_tensors(graphed(spec_of(PARAMS, ARGS, {})), PARAMS, ARGS, KWARGS) is None
    two = PARAMS + (nn.Parameter(torch.ones(1)),)
    assert replay_from_tensors(graphed(spec_of(two, ARGS, KWARGS)), PARAMS, ARGS, KWARGS) is None
    assert replay_from_tensors(graphed(spec_of(PARAMS, ARGS, KWARGS)), PARAMS, None, None) is None


def test_eager_graphs_and_other_backends_keep_the_argument_call():
    spec = spec_of(PARAMS, ARGS, KWARGS)
    assert replay_from_tensors(graphed(spec, eager_only=True), PARAMS, ARGS, KWARGS) is None
    assert replay_from_tensors(lambda *a, **k: None, PARAMS, ARGS, KWARGS) is None


def test_captured_drops_the_samples_after_deciding():
    v = RecordedVariant(args=ARGS, kwargs=KWARGS)
    g = graphed(spec_of(PARAMS, ARGS, KWARGS))
    v.captured(g, replay_from_tensors(g, PARAMS, v.args, v.kwargs))
    assert v.graph is g and v.replay_checked == g.replay_checked
    assert v.args is None and v.kwargs is None


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x, mask=None, *, scale):
        return x * self.w * scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Scaled()

    def forward(self, x):
        return self.inner(x, None, scale=torch.full((1,), 3.0))


def test_dispatch_hands_the_parameters_then_the_call_tensors_in_flatten_order():
    # A backend that returns GraphedCallables over fake graphs: replay_checked is spied,
    # the argument call must not happen.
    seen = []

    def backend(callables, sample_args, sample_kwargs):
        out = []
        for fn, args, kwargs in zip(callables, sample_args, sample_kwargs):
            g = graphed(flatten_call(args, kwargs)[1])

            def replay(tensors, fn=fn):
                seen.append(tensors)
                return fn(tuple(tensors[:1]), tensors[1], None, scale=tensors[2])

            g.replay_checked = replay
            out.append(g)
        return out

    net = Net()
    mgr = PartialCudaGraphManager.from_model_parts(
        net, include=["inner"], scopes=(), capture_backend=backend
    )
    mgr.start_recording()
    x = torch.ones(3, requires_grad=True)
    net(x).sum().backward()
    mgr.capture()
    y = torch.arange(3.0, requires_grad=True)
    out = net(y)
    assert torch.equal(out.detach(), y.detach() * 6.0)
    (tensors,) = seen
    assert (
        tensors[0] is net.inner.w
        and tensors[1] is y
        and torch.equal(tensors[2], torch.tensor([3.0]))
    )
    assert mgr.stats()["replayed"] == 1 and mgr.stats()["fallbacks"] == 0
    mgr.close()
