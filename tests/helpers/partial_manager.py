"""The partial-graph manager's CPU test kit: the attention-and-router scopes, eager
capture backends standing in for the core (one that records its calls, one that pins
the parameters like a graph does), a recorded manager, and a toy whose attention
takes a keyword argument."""

import torch
from torch import nn

from cudagraphs.partial import PartialCudaGraphManager
from helpers.toy_models import Attn

# Attention and router targets (the scopes these tests are about; the default is
# every scope, which graphs these small blocks whole).
NARROW = ("attention", "moe_router")


def eager_backend(callables, sample_args, sample_kwargs):
    """A capture backend that graphs nothing: the callables run eagerly. Appends
    (count, sample_args, sample_kwargs) of each capture to ``eager_backend.calls``
    (cleared by the caller)."""
    eager_backend.calls.append((len(callables), sample_args, sample_kwargs))
    return list(callables)


eager_backend.calls = []


def pinning_backend(callables, sample_args, sample_kwargs):
    """Like the core: the graph reads its parameters in place and refuses a call whose
    parameters were re-allocated since capture."""
    from cudagraphs import CudaGraphInputError

    graphs = []
    for fn, args in zip(callables, sample_args):
        ptrs = [p.data_ptr() for p in args[0]]

        def graphed(params, *a, _fn=fn, _ptrs=ptrs, **kw):
            if [p.data_ptr() for p in params] != _ptrs:
                raise CudaGraphInputError("parameter re-allocated")
            return _fn(params, *a, **kw)

        graphs.append(graphed)
    return graphs


def step(model, ids):
    """Forward and backward of an HF model's mean squared logits; returns the
    detached logits."""
    out = model(input_ids=ids, use_cache=False).logits
    out.float().pow(2).mean().backward()
    return out.detach()


def recorded(model, ids):
    """A manager of ``model``'s attention and router targets (eager backend), recorded
    on one step of ``ids`` and captured; the gradients of that step are cleared."""
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    step(model, ids)
    mgr.capture()
    model.zero_grad(set_to_none=True)
    return mgr


class MaskedAttn(Attn):
    def forward(self, hidden_states, attention_mask=None):
        return super().forward(hidden_states) * attention_mask


class KwBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = MaskedAttn()

    def forward(self, x):
        return x + self.self_attn(x, attention_mask=torch.full_like(x, 0.5))


class KwToy(nn.Module):
    """Two blocks whose attention multiplies by its ``attention_mask`` keyword."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([KwBlock(), KwBlock()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
