"""Drop-in at Transformer Engine, Megatron and torch call sites, on a real GPU: calls in
Transformer Engine's positional order with its quantization arguments off, the pools
users have, the capturing state other code reads, and a call made the way
Megatron-Core's graph helper makes it, replayed over an interleaved schedule."""

import copy
import sys

import pytest
import torch
from torch import nn

from cudagraphs import (
    CudaGraphCaptureError,
    CudaGraphPool,
    CudaGraphProgram,
    GraphedCallable,
    is_graph_capturing,
    make_graphed_callables,
    new_pool,
)
from cudagraphs.capture_state import TE_GRAPH_MODULE
from cudagraphs.settings import DISABLE_ENV
from helpers.asserts import assert_bitwise_equal
from helpers.dropin import FakeTE
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

HIDDEN = 32


def _randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)
    return t.requires_grad_(requires_grad)


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(HIDDEN, 64), nn.GELU(), nn.Linear(64, HIDDEN)).to(
        device="cuda", dtype=dtype
    )


def _train_step_equal(graphed, eager, seed, what):
    x = _randn(4, HIDDEN, seed=seed, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = _randn(4, HIDDEN, seed=seed + 1)
    out, ref = graphed(x), eager(x_ref)
    assert_bitwise_equal(out, ref, f"{what}: output")
    out.backward(grad)
    ref.backward(grad)
    assert_bitwise_equal(x.grad, x_ref.grad, f"{what}: input grad")
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        assert_bitwise_equal(p.grad, q.grad, f"{what}: grad of {name}")


# ---- Transformer Engine's positional order --------------------------------------------------
def test_transformer_engine_positional_call_with_quantization_off_equals_eager():
    module, eager = _mlp(), _mlp()
    sample = (_randn(4, HIDDEN, requires_grad=True),)
    # TE 1.x order: ..., sample_kwargs, fp8_enabled, fp8_calibrating, fp8_recipe,
    # fp8_group, fp8_weight_caching, _order, _num_layers_per_chunk, pool, retain_graph.
    result = make_graphed_callables(
        module, sample, 2, False, None, False, False, object(), None, True, None, None, None, False
    )
    assert result is module and module.cuda_graph.graphs.fwd_graph is not None
    for seed in (1, 3):
        _train_step_equal(module, eager, seed, f"TE-positional call, seed {seed}")


# ---- pools users have ----------------------------------------------------------------------
def _pool(name):
    if name == "graph_pool_handle":
        return torch.cuda.graph_pool_handle()
    if name == "new_pool":
        return new_pool()
    if name == "MemPool":
        mem_pool = getattr(torch.cuda, "MemPool", None)
        if not isinstance(mem_pool, type):
            pytest.skip("this torch has no torch.cuda.MemPool")
        return mem_pool()
    if name == "CudaGraphPool":
        return CudaGraphPool()
    return CudaGraphPool().graph_pool


@pytest.mark.parametrize(
    "name",
    ["graph_pool_handle", "new_pool", "MemPool", "CudaGraphPool", "CudaGraphPool.graph_pool"],
)
def test_every_kind_of_pool_is_accepted(name):
    module, eager = _mlp(seed=5), _mlp(seed=5)
    make_graphed_callables(module, (_randn(4, HIDDEN, requires_grad=True),), pool=_pool(name))
    _train_step_equal(module, eager, 11, f"pool={name}")


def test_a_program_pool_built_on_a_graph_pool_shares_it_with_core_graphs():
    shared = new_pool()
    program_pool = CudaGraphPool(pool=shared)
    assert program_pool.graph_pool is shared
    module, eager = _mlp(seed=6), _mlp(seed=6)
    make_graphed_callables(module, (_randn(4, HIDDEN, requires_grad=True),), pool=shared)
    program = CudaGraphProgram.capture(
        lambda a: (a @ a.t()).relu(), example_inputs=(_randn(8, 8),), pool=program_pool
    )
    try:
        _train_step_equal(module, eager, 21, "core graph in the shared pool")
        a = _randn(8, 8, seed=22)
        assert_bitwise_equal(program.replay(a, synchronize=True), (a @ a.t()).relu(), "program")
    finally:
        program_pool.close()


# ---- the capturing state -------------------------------------------------------------------
class _Observer(nn.Module):
    """An MLP that records, at each forward, our flag and Transformer Engine's."""

    def __init__(self, te):
        super().__init__()
        self.mlp, self.te, self.seen = _mlp(seed=9), te, []

    def forward(self, x):
        self.seen.append((is_graph_capturing(), self.te.is_graph_capturing()))
        return self.mlp(x)


@pytest.fixture
def fake_te(monkeypatch):
    te = FakeTE()
    monkeypatch.setitem(sys.modules, TE_GRAPH_MODULE, te)
    return te


def test_warmup_and_capture_see_the_capturing_state_and_replays_do_not(fake_te):
    module = _Observer(fake_te)
    hook_states = []
    hooks = [{"forward_pre_hooks": {"h": lambda m: hook_states.append(is_graph_capturing())}}]
    make_graphed_callables(
        module,
        (_randn(4, HIDDEN, requires_grad=True),),
        num_warmup_iters=2,
        capture_time_hooks=hooks,
    )
    # Two warmup forwards and the captured one, all inside the scope.
    assert module.seen == [(True, True)] * 3
    assert hook_states == [True] * 3
    assert fake_te.calls == ["start", "end"] and not is_graph_capturing()
    module.seen.clear()
    module(_randn(4, HIDDEN, seed=1))
    assert module.seen == []  # a replay runs no Python of the module
    program_states = []

    def double(x):
        program_states.append(is_graph_capturing())
        return x * 2

    program = CudaGraphProgram.capture(double, example_inputs=(_randn(4),), warmup=1)
    try:
        program.replay(_randn(4, seed=3), synchronize=True)
    finally:
        program.close()
    assert program_states == [True, True]  # one warmup and the capture; the replay runs none
    assert fake_te.calls == ["start", "end"] * 2


def test_a_failed_capture_leaves_neither_flag_set(fake_te):
    def syncs(x):
        return x * x.sum().item()  # a host sync: the capture fails

    with pytest.raises(CudaGraphCaptureError, match=r"capture of forward of callables\[0\]"):
        make_graphed_callables(syncs, (_randn(4),), num_warmup_iters=1)
    assert not is_graph_capturing() and not fake_te.is_graph_capturing()
    assert fake_te.calls == ["start", "end"]
    graphed = make_graphed_callables(lambda x: x * 3, (_randn(4),))  # the next one works
    x = _randn(4, seed=2)
    assert_bitwise_equal(graphed(x), x * 3, "capture after the failure")


def test_disabled_graphs_are_never_capturing(fake_te, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    module = _Observer(fake_te)
    make_graphed_callables(module, (_randn(4, HIDDEN, requires_grad=True),))
    module(_randn(4, HIDDEN, seed=1))
    assert module.seen == [(False, False)] and fake_te.calls == []


# ---- a Megatron-Core style call ----------------------------------------------------------
def _megatron_layers(seed):
    """bf16 layers whose parameters carry an fp32 main_grad, as Megatron's DDP makes."""
    layers = [
        _mlp(seed=seed + i, dtype=torch.bfloat16) for i in range(NUM_CHUNKS * LAYERS_PER_CHUNK)
    ]
    for layer in layers:
        for p in layer.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return layers


def _accumulate_like_megatron(layers):
    # Megatron's eager path: each gradient is added into main_grad as it is produced.
    def hook(p):
        p.main_grad.add_(p.grad)
        p.grad = None

    for layer in layers:
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(hook)


def test_megatron_style_interleaved_pipeline_equals_eager_bitwise():
    check_order(INTERLEAVED_ORDER, NUM_CHUNKS, NUM_MICROBATCHES)
    layers = _megatron_layers(40)
    eager_layers = copy.deepcopy(layers)
    for layer, ref in zip(layers, eager_layers):
        for p, q in zip(layer.parameters(), ref.parameters()):
            q.main_grad = p.main_grad.clone()
    _accumulate_like_megatron(eager_layers)
    num_entries = NUM_CHUNKS * NUM_MICROBATCHES * LAYERS_PER_CHUNK
    sample_args = [
        (_randn(4, HIDDEN, seed=700 + i, dtype=torch.bfloat16, requires_grad=True),)
        for i in range(num_entries)
    ]
    # Transformer Engine's positional order, as Megatron-Core's helper passes it:
    # quantization off (with its caching flag set), _order with _num_layers_per_chunk,
    # retain_graph_in_backward and buffer reuse; main_grad accumulation by keyword.
    graphed = make_graphed_callables(
        tuple(layers),
        sample_args,
        3,  # num_warmup_iters
        True,  # allow_unused_input
        None,  # sample_kwargs
        False,  # enabled
        False,  # calibrating
        None,  # recipe
        None,  # amax_reduction_group
        True,  # cache_quantized_params (meaningless with quantization off)
        list(INTERLEAVED_ORDER),
        [LAYERS_PER_CHUNK] * NUM_CHUNKS,
        None,  # pool
        True,  # retain_graph_in_backward
        True,  # _reuse_graph_input_output_buffers
        accumulate_grads_in_graph=True,
        main_grad_attr="main_grad",
    )
    assert len(graphed) == num_entries and all(isinstance(g, GraphedCallable) for g in graphed)

    def graphed_layer(c, m, i):
        return graphed[entry_index(c, m, i, LAYERS_PER_CHUNK, NUM_MICROBATCHES)]

    def eager_layer(c, m, i):
        return eager_layers[c * LAYERS_PER_CHUNK + i]

    kwargs = dict(num_chunks=NUM_CHUNKS, layers_per_chunk=LAYERS_PER_CHUNK)
    for iteration in range(2):  # main_grad accumulates over both iterations
        inputs = [
            _randn(
                4, HIDDEN, seed=900 + 10 * iteration + m, dtype=torch.bfloat16, requires_grad=True
            )
            for m in range(NUM_MICROBATCHES)
        ]
        grads = [
            _randn(4, HIDDEN, seed=950 + 10 * iteration + m, dtype=torch.bfloat16)
            for m in range(NUM_MICROBATCHES)
        ]
        ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
        run = run_pipeline(graphed_layer, INTERLEAVED_ORDER, inputs, grads, **kwargs)
        ref = run_pipeline(eager_layer, INTERLEAVED_ORDER, ref_inputs, grads, **kwargs)
        for m in range(NUM_MICROBATCHES):
            assert_bitwise_equal(run.outputs[m], ref.outputs[m], f"iter {iteration} mb {m}: output")
            assert_bitwise_equal(
                inputs[m].grad, ref_inputs[m].grad, f"iter {iteration} mb {m}: data grad"
            )
        for k, (g, r) in enumerate(zip(run.boundary_grads, ref.boundary_grads)):
            assert_bitwise_equal(g, r, f"iter {iteration}: chunk-boundary grad {k}")
    for i, (layer, ref_layer) in enumerate(zip(layers, eager_layers)):
        for (name, p), q in zip(layer.named_parameters(), ref_layer.parameters()):
            assert p.grad is None, f"layer {i} {name}: the graph accumulated into .grad"
            assert_bitwise_equal(p.main_grad, q.main_grad, f"layer {i} {name}: main_grad")
            assert p.main_grad.abs().sum() > 0, f"layer {i} {name}: no gradient reached main_grad"
