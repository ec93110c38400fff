"""Parity with eager training, after the non-FP8 cases of Transformer Engine's CUDA-graph
tests, with plain torch modules in place of TE's.

Each case builds a small model, deep-copies it as the eager reference, graphs the
original, runs the same few training steps (gradient accumulation, SGD) on both and
requires bitwise-equal outputs, input gradients, parameters and parameter gradients:
the graphs replay the same kernels that eager runs.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cudagraphs import GraphedCallable, make_graphed_callables
from cudagraphs.models import BlockConfig, PreNormBlock
from helpers.asserts import assert_bitwise_equal
from helpers.pipeline import (
    INTERLEAVED_ORDER,
    LAYERS_PER_CHUNK,
    NUM_CHUNKS,
    NUM_MICROBATCHES,
    check_order,
    entry_index,
    run_pipeline,
)

pytestmark = pytest.mark.cuda

BATCH, SEQ, HIDDEN, HEADS = 2, 8, 32, 4
NUM_LAYERS = 3
STEPS, ACCUMULATION = 3, 2
LR = 0.01

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


# ---- modules ---------------------------------------------------------------------------


class LayerNormMLP(nn.Module):
    """LayerNorm, then a GELU MLP; optionally with activation checkpointing (the MLP is
    recomputed in the backward pass, so the backward graph holds a forward too)."""

    def __init__(self, hidden, ffn, *, checkpointed=False):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.checkpointed = checkpointed

    def _mlp(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x):
        h = self.ln(x)
        if self.checkpointed:
            return checkpoint(self._mlp, h, use_reentrant=False, preserve_rng_state=False)
        return self._mlp(h)


class SelfAttention(nn.Module):
    """Fused QKV projection, scaled-dot-product attention, output projection."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, *, attn_mask=None):
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class CoreAttention(nn.Module):
    """Attention without parameters: gradients flow only to the q, k, v inputs."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class KwargsSequential(nn.Sequential):
    """A Sequential that hands its keyword arguments to every layer."""

    def forward(self, x, **kwargs):
        for layer in self:
            x = layer(x, **kwargs)
        return x


def _make_layer(kind):
    if kind == "linear":
        return nn.Linear(HIDDEN, HIDDEN)
    if kind == "layernorm_linear":
        return nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    if kind == "layernorm_mlp":
        return LayerNormMLP(HIDDEN, 2 * HIDDEN)
    if kind == "layernorm_mlp_checkpoint":
        return LayerNormMLP(HIDDEN, 2 * HIDDEN, checkpointed=True)
    if kind == "transformer":
        return PreNormBlock(BlockConfig(hidden=HIDDEN, heads=HEADS, ffn=2 * HIDDEN))
    if kind == "sdpa_attention":
        return SelfAttention(HIDDEN, HEADS)
    if kind == "ops_sequential":
        return nn.Sequential(
            nn.LayerNorm(HIDDEN),
            nn.Linear(HIDDEN, 2 * HIDDEN, bias=False),
            nn.GELU(approximate="tanh"),
            nn.Linear(2 * HIDDEN, HIDDEN),
        )
    raise ValueError(kind)


KINDS = [
    "linear",
    "layernorm_linear",
    "layernorm_mlp",
    "layernorm_mlp_checkpoint",
    "transformer",
    "sdpa_attention",
    "ops_sequential",
]


def _make_layers(kind, dtype, *, seed=0, num_layers=NUM_LAYERS):
    torch.manual_seed(seed)
    return [_make_layer(kind).to(device="cuda", dtype=dtype) for _ in range(num_layers)]


# ---- data and comparison ---------------------------------------------------------------


def _randn(*shape, seed, dtype, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)
    return t.requires_grad_(requires_grad)


def _hidden(seed, dtype, requires_grad=False):
    return _randn(BATCH, SEQ, HIDDEN, seed=seed, dtype=dtype, requires_grad=requires_grad)


def _mask(seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=g) > 0.5
    # Every query attends to itself, so no row is fully masked (that would give NaNs).
    return (mask | torch.eye(SEQ, dtype=torch.bool)).cuda()


_assert_equal = assert_bitwise_equal


def _assert_same_trace(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_equal(g, w, f"{what} {i}")


def _assert_same_params(graphed_layers, eager_layers, what=""):
    for i, (layer, ref) in enumerate(zip(graphed_layers, eager_layers)):
        for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
            _assert_equal(p, q, f"{what}layer {i} parameter {name}")
            if p.grad is None and q.grad is None:
                continue
            _assert_equal(p.grad, q.grad, f"{what}layer {i} grad of {name}")


def _init_grads(layers):
    # Like Transformer Engine's tests: gradient buffers exist before graphing and the
    # loop zeroes them in place, so gradients accumulate across microbatches.
    for layer in layers:
        for p in layer.parameters():
            p.grad = torch.zeros_like(p)


def _train(model, params, dtype, *, kwargs_fn=None, steps=STEPS, seed=0):
    """SGD steps with gradient accumulation; returns the outputs and input gradients of
    every microbatch (copied, since graphed outputs are overwritten by the next replay)."""
    optimizer = torch.optim.SGD(params, lr=LR)
    outputs, input_grads = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        for micro in range(ACCUMULATION):
            n = 1000 * seed + 10 * step + micro
            x = _hidden(n, dtype, requires_grad=True)
            kwargs = kwargs_fn(n) if kwargs_fn is not None else {}
            out = model(x, **kwargs)
            out.backward(_hidden(n + 500, dtype))
            outputs.append(out.detach().clone())
            input_grads.append(x.grad)
        optimizer.step()
    return outputs, input_grads


def _graph(layers, graph_mode, dtype, *, container=nn.Sequential, sample_kwargs=None, **kw):
    """Graph each layer ("individual") or the whole stack ("full"); return the model."""
    if graph_mode == "individual":
        sample_args = tuple(
            (_hidden(900 + i, dtype, requires_grad=True),) for i in range(len(layers))
        )
        kwargs_list = None if sample_kwargs is None else tuple(sample_kwargs for _ in layers)
        graphed = make_graphed_callables(
            tuple(layers), sample_args, sample_kwargs=kwargs_list, **kw
        )
        # Modules keep their identity (their forward replays); under _order the result
        # is the module's GraphedCallable, as Transformer Engine returns.
        ordered = kw.get("_order") is not None
        assert all(
            g is (layer.cuda_graph if ordered else layer) for g, layer in zip(graphed, layers)
        ), "modules keep their identity"
        return container(*layers)
    model = container(*layers)
    graphed = make_graphed_callables(
        model, (_hidden(900, dtype, requires_grad=True),), sample_kwargs=sample_kwargs, **kw
    )
    assert graphed is model
    return model


def _parameters(layers):
    return [p for layer in layers for p in layer.parameters()]


# ---- the module matrix -----------------------------------------------------------------


@pytest.mark.parametrize("graph_mode", ["individual", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_graphed_training_matches_eager(kind, dtype, graph_mode):
    layers = _make_layers(kind, dtype)
    eager_layers = copy.deepcopy(layers)
    _init_grads(layers)
    _init_grads(eager_layers)
    model = _graph(layers, graph_mode, dtype)
    got = _train(model, _parameters(layers), dtype)
    want = _train(nn.Sequential(*eager_layers), _parameters(eager_layers), dtype)
    _assert_same_trace(got[0], want[0], "output of microbatch")
    _assert_same_trace(got[1], want[1], "input grad of microbatch")
    _assert_same_params(layers, eager_layers)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_graphed_core_attention_matches_eager(dtype):
    shape = (BATCH, HEADS, SEQ, HIDDEN // HEADS)
    graphed = CoreAttention()
    samples = tuple(_randn(*shape, seed=i, dtype=dtype, requires_grad=True) for i in range(3))
    assert make_graphed_callables(graphed, samples) is graphed
    eager = CoreAttention()
    for it in range(3):
        qkv = [_randn(*shape, seed=10 * it + i, dtype=dtype, requires_grad=True) for i in range(3)]
        ref = [t.detach().clone().requires_grad_(True) for t in qkv]
        out = graphed(*qkv)
        out_ref = eager(*ref)
        _assert_equal(out, out_ref, f"iteration {it}: output")
        grad = _randn(*shape, seed=10 * it + 5, dtype=dtype)
        out.backward(grad)
        out_ref.backward(grad)
        for name, t, r in zip("qkv", qkv, ref):
            _assert_equal(t.grad, r.grad, f"iteration {it}: grad of {name}")


@pytest.mark.parametrize("graph_mode", ["individual", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graphed_training_with_kwargs_matches_eager(dtype, graph_mode):
    layers = _make_layers("sdpa_attention", dtype)
    eager_layers = copy.deepcopy(layers)
    _init_grads(layers)
    _init_grads(eager_layers)
    model = _graph(
        layers,
        graph_mode,
        dtype,
        container=KwargsSequential,
        sample_kwargs={"attn_mask": _mask(0)},
    )

    def kwargs_fn(n):
        return {"attn_mask": _mask(n + 1)}

    got = _train(model, _parameters(layers), dtype, kwargs_fn=kwargs_fn)
    want = _train(
        KwargsSequential(*eager_layers), _parameters(eager_layers), dtype, kwargs_fn=kwargs_fn
    )
    _assert_same_trace(got[0], want[0], "output of microbatch")
    _assert_same_trace(got[1], want[1], "input grad of microbatch")
    _assert_same_params(layers, eager_layers)


@pytest.mark.parametrize("grads_from", ["preallocated", "initial_eager_step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["linear", "transformer"])
def test_uncloned_param_grads_training_matches_eager(kind, dtype, grads_from):
    """clone_param_grads_on_return=False: gradients must already exist when the graphed
    backward first runs; the loop zeroes them in place (zero_grad(set_to_none=False))."""
    layers = _make_layers(kind, dtype)
    eager_layers = copy.deepcopy(layers)
    if grads_from == "preallocated":
        _init_grads(layers)
        _init_grads(eager_layers)
    else:
        # One eager training step on both copies creates owned gradient tensors.
        _train(nn.Sequential(*layers), _parameters(layers), dtype, steps=1, seed=7)
        _train(nn.Sequential(*eager_layers), _parameters(eager_layers), dtype, steps=1, seed=7)
        _assert_same_params(layers, eager_layers, "after the initial eager step: ")
    model = _graph(layers, "individual", dtype, clone_param_grads_on_return=False)
    got = _train(model, _parameters(layers), dtype)
    want = _train(nn.Sequential(*eager_layers), _parameters(eager_layers), dtype)
    _assert_same_trace(got[0], want[0], "output of microbatch")
    _assert_same_trace(got[1], want[1], "input grad of microbatch")
    _assert_same_params(layers, eager_layers)


# ---- capture-time hooks ----------------------------------------------------------------

_HOOK_GROUPS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


def _counting_hooks(num_callables):
    counts = {(i, g): 0 for i in range(num_callables) for g in _HOOK_GROUPS}

    def make(i, group):
        def hook(module):
            counts[(i, group)] += 1

        return hook

    hooks = [{g: {"count": make(i, g)} for g in _HOOK_GROUPS} for i in range(num_callables)]
    return counts, hooks


@pytest.mark.parametrize("order", [None, [1, 2, -2, -1]], ids=["unordered", "order"])
def test_capture_time_hooks_are_called_in_training(order):
    dtype = torch.float32
    layers = _make_layers("layernorm_mlp", dtype, num_layers=2)
    eager_layers = copy.deepcopy(layers)
    counts, hooks = _counting_hooks(2)
    warmup = 2
    _graph(
        layers,
        "individual",
        dtype,
        num_warmup_iters=warmup,
        _order=order,
        capture_time_hooks=hooks,
    )
    expected = {key: warmup + 1 for key in counts}
    assert counts == expected, f"hook calls {counts}, expected {expected}"
    got = _train(nn.Sequential(*layers), _parameters(layers), dtype, steps=1)
    want = _train(nn.Sequential(*eager_layers), _parameters(eager_layers), dtype, steps=1)
    _assert_same_trace(got[0], want[0], "output of microbatch")
    _assert_same_params(layers, eager_layers)
    assert counts == expected, "capture-time hooks must not run on replay"


def test_capture_time_hooks_in_inference_run_forward_groups_only():
    dtype = torch.float32
    layers = [layer.eval() for layer in _make_layers("transformer", dtype, num_layers=2)]
    eager_layers = copy.deepcopy(layers)
    counts, hooks = _counting_hooks(2)
    warmup = 2
    with torch.no_grad():
        sample_args = tuple((_hidden(900 + i, dtype),) for i in range(2))
        graphed = make_graphed_callables(
            tuple(layers), sample_args, num_warmup_iters=warmup, capture_time_hooks=hooks
        )
        expected = {(i, g): (warmup + 1 if g.startswith("forward") else 0) for i, g in counts}
        assert counts == expected, f"hook calls {counts}, expected {expected}"
        for seed in (1, 2):
            x = _hidden(seed, dtype)
            out = graphed[1](graphed[0](x))
            _assert_equal(out, eager_layers[1](eager_layers[0](x)), f"inference (seed {seed})")
    assert counts == expected, "capture-time hooks must not run on replay"


# ---- interleaved pipeline parallelism --------------------------------------------------


@pytest.mark.parametrize("reuse", [False, True], ids=["separate_buffers", "reuse_buffers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_interleaved_pipeline_training_matches_eager(dtype, reuse):
    check_order(INTERLEAVED_ORDER, NUM_CHUNKS, NUM_MICROBATCHES)
    layers = _make_layers("linear", dtype, num_layers=NUM_CHUNKS * LAYERS_PER_CHUNK)
    eager_layers = copy.deepcopy(layers)
    _init_grads(layers)
    _init_grads(eager_layers)
    num_entries = NUM_CHUNKS * NUM_MICROBATCHES * LAYERS_PER_CHUNK
    sample_args = tuple((_hidden(900 + i, dtype, requires_grad=True),) for i in range(num_entries))
    graphed = make_graphed_callables(
        tuple(layers),
        sample_args,
        _order=list(INTERLEAVED_ORDER),
        _reuse_graph_input_output_buffers=reuse,
    )
    assert len(graphed) == num_entries and all(isinstance(g, GraphedCallable) for g in graphed)

    def graphed_layer(c, m, i):
        return graphed[entry_index(c, m, i, LAYERS_PER_CHUNK, NUM_MICROBATCHES)]

    def eager_layer(c, m, i):
        return eager_layers[c * LAYERS_PER_CHUNK + i]

    def train(layer, params):
        optimizer = torch.optim.SGD(params, lr=LR)
        outputs = []
        for step in range(2):
            optimizer.zero_grad(set_to_none=False)
            inputs = [
                _hidden(100 * step + m, dtype, requires_grad=True) for m in range(NUM_MICROBATCHES)
            ]
            grads = [_hidden(100 * step + 50 + m, dtype) for m in range(NUM_MICROBATCHES)]
            run = run_pipeline(
                layer,
                INTERLEAVED_ORDER,
                inputs,
                grads,
                num_chunks=NUM_CHUNKS,
                layers_per_chunk=LAYERS_PER_CHUNK,
            )
            outputs += run.outputs + run.boundary_grads + [x.grad for x in inputs]
            optimizer.step()
        return outputs

    got = train(graphed_layer, _parameters(layers))
    want = train(eager_layer, _parameters(eager_layers))
    _assert_same_trace(got, want, "output / boundary grad / input grad")
    _assert_same_params(layers, eager_layers)
