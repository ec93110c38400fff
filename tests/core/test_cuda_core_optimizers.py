"""On the GPU, ``make_graphed_callables(..., optimizers=...)`` after eager steps: the
optimizer's state made in the eager steps' holes is packed before the warmup, keeps
its identity and values, and the graphed steps that follow equal eager ones bitwise."""

from __future__ import annotations

import pytest
import torch

import cudagraphs
from helpers.core_cuda import count_backward_replays

pytestmark = pytest.mark.cuda


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(4)]
    return torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.GELU())]).cuda()


def _step(model, opt, x) -> None:
    model(x).square().mean().backward()
    opt.step()
    # The gradients go before the capture, as in a set_to_none loop: only the state
    # stays in the segments the step's activations left.
    opt.zero_grad(set_to_none=True)


def test_state_made_by_eager_steps_is_packed_and_the_graphed_steps_equal_eager():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    graphed_model, eager_model = _model(), _model()
    opts = [
        torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (graphed_model, eager_model)
    ]
    # 16 MiB activations: the state (4 MiB a tensor) is cut out of their holes. The
    # inputs and the capture's sample are made first, so that none lands in a hole
    # beside the state.
    xs = [torch.randn(4096, 1024, device="cuda") for _ in range(5)]
    sample = xs[0].clone().requires_grad_()
    for x in xs[:2]:
        # Large activations beside the state, as a training step's are.
        for model, opt in zip((graphed_model, eager_model), opts):
            _step(model, opt, x)
    # Both models' state shares the holes: both optimizers are named (the twin's state
    # keeps its values too, so the comparison below is unchanged by packing).
    state = [t for o in opts for s in o.state.values() for t in s.values() if t.numel() > 1]
    # Host copies: copies on the device would fill the very holes packing frees.
    before = {id(t): (t.data_ptr(), t.cpu()) for t in state}
    graphed = cudagraphs.make_graphed_callables(graphed_model, (sample,), optimizers=opts)
    moved = [t for t in state if t.data_ptr() != before[id(t)][0]]
    assert moved, "no state tensor was packed"
    # One buffer per dtype: the moved tensors share storages now.
    assert len({t.untyped_storage().data_ptr() for t in moved}) < len(moved)
    for t in state:
        assert torch.equal(t.cpu(), before[id(t)][1])
    counts = count_backward_replays(graphed.cuda_graph.graphs)
    for x in xs[2:]:
        _step(graphed, opts[0], x)
        _step(eager_model, opts[1], x)
    assert counts() == 3
    for a, b in zip(graphed_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
