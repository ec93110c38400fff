"""make_graphed_callables on a real GPU: who owns the gradients a backward replay hands
out, and failed captures, reset and input checks.

Graphed results must equal eager results exactly where the same kernels run, so every
comparison here is ``torch.equal``. The eager reference is a deep copy taken before
graphing, fed with identical inputs.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphs
from cudagraphs import (
    CudaGraphCaptureError,
    CudaGraphInputError,
    GraphReleasedError,
    KeptGradientViewError,
    make_graphed_callables,
    new_pool,
)
from cudagraphs.torch_private import can_move_storages
from helpers.asserts import assert_bitwise_equal
from helpers.core_cuda import (
    HIDDEN,
    _assert_equal,
    _assert_param_grads_equal,
    _check_train_step,
    _contain_failed_capture,
    _mlp,
    _randn,
    count_backward_replays,
)

pytestmark = pytest.mark.cuda

BATCH = 4


# ---- gradient ownership ----------------------------------------------------------------


def _static_grad_ptrs(module):
    return {t.data_ptr() for t in module.cuda_graph.graphs.static_grad_inputs if t is not None}


# How a backward replay hands out parameter gradients: owned with deferred copies
# (the default, CUDAGRAPHS_OWNED_GRADS=defer), owned with a copy at every replay
# (CUDAGRAPHS_OWNED_GRADS=copy), lent (clone_param_grads_on_return=False).
MODES = ["owned_copy", "owned_deferred", "lent"]


def _graph_in_mode(module, sample, mode, monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_OWNED_GRADS", "copy" if mode == "owned_copy" else "defer")
    make_graphed_callables(module, (sample,), clone_param_grads_on_return=mode != "lent")
    monkeypatch.delenv("CUDAGRAPHS_OWNED_GRADS", raising=False)


@pytest.mark.parametrize("mode", MODES)
def test_param_grads_accumulate_like_eager_owned_or_lent(mode, monkeypatch):
    # Copied at every replay: no .grad is ever a buffer. Deferred or lent: the first
    # backward hands the static buffers out as .grad (no copy); the next replay would
    # overwrite them, so they move to copies of their own first. Either way the sum
    # is eager's bit for bit.
    module = _mlp()
    eager = copy.deepcopy(module)
    _graph_in_mode(module, _randn(BATCH, HIDDEN, seed=1), mode, monkeypatch)
    lent = mode != "owned_copy"
    static = _static_grad_ptrs(module)
    assert static, "the backward graph should produce parameter gradients"
    for it in range(3):  # no zeroing in between: gradients accumulate
        x = _randn(BATCH, HIDDEN, seed=10 + it)
        grad = _randn(BATCH, HIDDEN, seed=20 + it)
        module(x).backward(grad)
        eager(x).backward(grad)
        for name, p in module.named_parameters():
            aliased = p.grad.data_ptr() in static
            assert aliased == (lent and it == 0), (
                f"iteration {it}: {name}.grad {'aliases' if aliased else 'does not alias'} "
                "its static gradient buffer"
            )
        _assert_param_grads_equal(module, eager, f"sum of {it + 1} replays")


@pytest.mark.parametrize("mode", MODES)
def test_param_grads_with_set_to_none_and_an_optimizer_match_eager(mode, monkeypatch):
    # torch's default regime: zero_grad(set_to_none=True) after every optimizer step.
    # Copied at every replay: each backward's gradients are fresh copies; deferred or
    # lent: the buffers themselves, and nothing is ever copied.
    module = _mlp()
    eager = copy.deepcopy(module)
    _graph_in_mode(module, _randn(BATCH, HIDDEN, seed=1), mode, monkeypatch)
    lent = mode != "owned_copy"
    static = _static_grad_ptrs(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=True)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2, foreach=True)
    for it in range(4):
        x = _randn(BATCH, HIDDEN, seed=30 + it)
        grad = _randn(BATCH, HIDDEN, seed=40 + it)
        module(x).backward(grad)
        eager(x).backward(grad)
        assert all((p.grad.data_ptr() in static) == lent for p in module.parameters())
        _assert_param_grads_equal(module, eager, f"step {it}")
        opt.step()
        opt_eager.step()
        opt.zero_grad(set_to_none=True)
        opt_eager.zero_grad(set_to_none=True)
    for (name, p), q in zip(module.named_parameters(), eager.parameters()):
        _assert_equal(p.detach(), q.detach(), f"{name} after 4 AdamW steps")
    lent_grads = module.cuda_graph.graphs.lent
    assert lent_grads.deferred.moves == 0, "set_to_none: nothing was still held"


@pytest.mark.parametrize("mode", ["owned_copy", "owned_deferred"])
def test_a_hook_kept_gradient_survives_later_steps_by_default(mode, monkeypatch):
    # Transformer Engine 2.20's contract (clone_param_grads_on_return=True, TE PR 2937),
    # as its own tests check it: a weight hook keeps the gradients it receives, and
    # later replays change neither their values nor their storage.
    module = _mlp()
    eager = copy.deepcopy(module)
    _graph_in_mode(module, _randn(BATCH, HIDDEN, seed=1), mode, monkeypatch)
    weight, weight_eager = module[0].weight, eager[0].weight
    kept, kept_eager = [], []
    weight.register_hook(kept.append)
    weight_eager.register_hook(kept_eager.append)
    replays = count_backward_replays(module.cuda_graph.graphs)
    for it in range(3):
        x = _randn(BATCH, HIDDEN, seed=70 + it)
        grad = _randn(BATCH, HIDDEN, seed=80 + it)
        module(x).backward(grad)
        eager(x).backward(grad)
        module.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert replays() == 3, "every step must have replayed the backward graph"
    for it, (g, g_eager) in enumerate(zip(kept, kept_eager)):
        _assert_equal(g, g_eager, f"the gradient the hook kept at step {it}")
    assert len({g.untyped_storage().data_ptr() for g in kept}) == 3, "one storage per step"
    if mode == "owned_deferred":
        # The hook's gradient was the buffer: moved out at each next step's forward.
        assert module.cuda_graph.graphs.lent.deferred.moves >= 2


def test_deferred_owned_gradients_are_the_buffers_and_stay_exact_in_a_stack(monkeypatch):
    # The memory point of deferral: a set_to_none loop of a graphed stack hands out
    # every parameter gradient as its graph buffer and copies nothing, bit for bit
    # like eager. A .grad kept past .grad = None keeps its values where torch can
    # exchange storage memory; elsewhere the next forward refuses, then runs once
    # it is dropped.
    torch.manual_seed(0)
    layers = [_mlp() for _ in range(3)]
    refs = [copy.deepcopy(m) for m in layers]
    samples = tuple((_randn(BATCH, HIDDEN, seed=k).requires_grad_(),) for k in range(3))
    monkeypatch.setenv("CUDAGRAPHS_OWNED_GRADS", "defer")
    graphed = make_graphed_callables(tuple(layers), samples)
    entries = [g.cuda_graph.graphs for g in graphed]
    assert all(e._held for e in entries), "every entry defers its copies"
    counts = [count_backward_replays(e) for e in entries]
    static = [p for g in graphed for p in _static_grad_ptrs(g)]
    exchange = can_move_storages()
    kept = None
    for it in range(4):
        x = _randn(BATCH, HIDDEN, seed=90 + it).requires_grad_()
        if it == 2 and not exchange:
            with pytest.raises(KeptGradientViewError, match="CUDAGRAPHS_OWNED_GRADS=copy"):
                graphed[0](x)
            kept = None  # the fix the error names: drop them (or keep clones)
        for seq in (graphed, refs):
            h = x
            for layer in seq:
                h = layer(h)
            h.pow(2).mean().backward()
        for g, r in zip(graphed, refs):
            for pg, pr in zip(g.parameters(), r.parameters()):
                _assert_equal(pg.grad, pr.grad, f"step {it}")
                assert pg.grad.data_ptr() in static, f"step {it}: a .grad was copied"
        if it == 1:
            kept = [(p.grad, p.grad.clone()) for p in graphed[0].parameters()]
        for m in (*graphed, *refs):
            m.zero_grad(set_to_none=True)
    assert [c() for c in counts] == [4, 4, 4], "every step replays every backward graph"
    deferred = entries[0].lent.deferred
    if exchange:
        for k, (g, want) in enumerate(kept):
            _assert_equal(g, want, f"parameter {k}'s gradient kept from step 1")
        assert deferred.moves == len(kept), "only what was kept moved, once"


def test_autograd_grad_returns_owned_param_grads():
    module = _mlp()
    eager = copy.deepcopy(module)
    make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1),))
    static = _static_grad_ptrs(module)
    params, eager_params = list(module.parameters()), list(eager.parameters())
    kept = []
    for it in range(2):
        x = _randn(BATCH, HIDDEN, seed=50 + it)
        grad = _randn(BATCH, HIDDEN, seed=60 + it)
        got = torch.autograd.grad(module(x), params, grad)
        want = torch.autograd.grad(eager(x), eager_params, grad)
        assert all(g.data_ptr() not in static for g in got), "autograd.grad returned a buffer"
        kept.append((got, want))
    for it, (got, want) in enumerate(kept):  # the second replay left the first's alone
        for k, (g, w) in enumerate(zip(got, want)):
            _assert_equal(g, w, f"autograd.grad call {it}, parameter {k}")
    assert all(p.grad is None for p in params)


def test_leaf_input_grads_are_owned_when_fresh_and_accumulate_like_eager():
    # Leaf tensors passed as inputs (the partial-graph path passes parameters so): the
    # first gradient becomes .grad and must be an owned copy; later ones are added.
    w = torch.nn.Parameter(_randn(HIDDEN, HIDDEN, seed=2))
    w_eager = torch.nn.Parameter(w.detach().clone())

    def f(x, weight):
        return torch.tanh(x @ weight)

    graphed = make_graphed_callables(
        f, (_randn(BATCH, HIDDEN, seed=1).requires_grad_(), w.detach().requires_grad_())
    )
    static = {t.data_ptr() for t in graphed.graphs.static_grad_inputs if t is not None}
    for it in range(3):
        x = _randn(BATCH, HIDDEN, seed=10 + it).requires_grad_()
        x_eager = x.detach().clone().requires_grad_()
        grad = _randn(BATCH, HIDDEN, seed=20 + it)
        graphed(x, w).backward(grad)
        f(x_eager, w_eager).backward(grad)
        assert w.grad.data_ptr() not in static, f"iteration {it}: w.grad aliases a buffer"
        assert x.grad.data_ptr() not in static, f"iteration {it}: x.grad aliases a buffer"
        assert_bitwise_equal(x.grad, x_eager.grad, f"iteration {it}: input grad")
        assert_bitwise_equal(w.grad, w_eager.grad, f"iteration {it}: accumulated weight grad")


def test_param_grads_alias_static_buffers_without_cloning():
    module = _mlp()
    eager = copy.deepcopy(module)
    make_graphed_callables(
        module, (_randn(BATCH, HIDDEN, seed=1),), clone_param_grads_on_return=False
    )
    static = _static_grad_ptrs(module)
    assert all(p.grad is None for p in module.parameters())
    x = _randn(BATCH, HIDDEN, seed=10)
    grad = _randn(BATCH, HIDDEN, seed=20)
    module(x).backward(grad)
    eager(x).backward(grad)
    for name, p in module.named_parameters():
        assert p.grad.data_ptr() in static, f"{name}.grad should alias its static gradient buffer"
    _assert_param_grads_equal(module, eager, "aliased grads")


def test_uncloned_param_grads_accumulate_into_existing_grads():
    # The documented way to use clone_param_grads_on_return=False: gradients exist before
    # the first backward and are zeroed in place.
    module = _mlp()
    eager = copy.deepcopy(module)
    for p in list(module.parameters()) + list(eager.parameters()):
        p.grad = torch.zeros_like(p)
    make_graphed_callables(
        module, (_randn(BATCH, HIDDEN, seed=1),), clone_param_grads_on_return=False
    )
    for step in range(2):
        module.zero_grad(set_to_none=False)
        eager.zero_grad(set_to_none=False)
        for micro in range(2):
            x = _randn(BATCH, HIDDEN, seed=10 * step + micro)
            grad = _randn(BATCH, HIDDEN, seed=100 + 10 * step + micro)
            module(x).backward(grad)
            eager(x).backward(grad)
        _assert_param_grads_equal(module, eager, f"step {step}: accumulated over 2 replays")


# ---- failures, reset, input checks -----------------------------------------------------


class _HostSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 1e30:  # host sync: fine eagerly, illegal inside a capture
            y = y * 0
        return y


@pytest.mark.parametrize("pool_kind", ["shared_pool", "own_pools"])
def test_capture_failure_then_graphing_works_again(pool_kind):
    # "shared_pool": both calls capture into one caller pool; "own_pools": each call
    # makes its own pool (pool=None).
    pool = new_pool() if pool_kind == "shared_pool" else None
    bad = _HostSync().cuda()
    good = _mlp()
    eager = copy.deepcopy(good)
    # Inputs are made before the failure (on the CPU generator anyway).
    bad_sample = _randn(BATCH, HIDDEN, seed=1, requires_grad=True)
    good_sample = _randn(BATCH, HIDDEN, seed=2, requires_grad=True)
    stream_before = torch.cuda.current_stream()
    try:
        with pytest.raises(CudaGraphCaptureError) as info:
            make_graphed_callables(bad, (bad_sample,), pool=pool)
        assert info.value.__cause__ is not None, "the underlying error must be chained"
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.cuda.current_stream() == stream_before
        assert "forward" not in bad.__dict__ and not hasattr(bad, "cuda_graph"), (
            "a failed graphing must leave the module unmodified"
        )
        assert bad(bad_sample).shape == (BATCH, HIDDEN), "the module still runs eagerly"

        make_graphed_callables(good, (good_sample,), pool=pool)
        for it in range(2):
            good.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            _check_train_step(
                good, eager, 3 + it, 5 + it, (BATCH, HIDDEN), torch.float32, f"after failure {it}"
            )
    finally:
        _contain_failed_capture(pool)


def test_reset_restores_the_module_forward():
    module = _mlp()
    eager = copy.deepcopy(module)
    make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1, requires_grad=True),))
    graphs = module.cuda_graph
    module.reset()
    assert graphs.graphs.released
    assert "forward" not in module.__dict__, "reset() must restore the class forward"
    assert not hasattr(module, "cuda_graph"), "reset() must remove module.cuda_graph"
    x = _randn(BATCH, HIDDEN, seed=2, requires_grad=True)
    out = module(x)
    assert "Replay" not in type(out.grad_fn).__name__, "after reset() the forward is eager"
    x_ref = x.detach().clone().requires_grad_(True)
    out_ref = eager(x_ref)
    _assert_equal(out, out_ref, "eager output after reset")
    grad = _randn(BATCH, HIDDEN, seed=3)
    out.backward(grad)
    out_ref.backward(grad)
    _assert_equal(x.grad, x_ref.grad, "eager input grad after reset")
    _assert_param_grads_equal(module, eager, "after reset")
    graphs.reset()  # idempotent


def test_reset_removes_the_reset_attribute_it_installed():
    module = _mlp()
    assert not hasattr(module, "reset")
    make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1),))
    assert callable(module.reset), "a graphed module without its own reset() gets one"
    module.reset()
    assert "reset" not in module.__dict__, (
        "reset() must remove the module.reset attribute that graphing installed"
    )


def _sin_times_two(a):
    return a.sin() * 2


def test_reset_of_a_function_releases_it():
    a = _randn(16, seed=1, requires_grad=True)
    graphed = make_graphed_callables(_sin_times_two, (a,))
    x = _randn(16, seed=2, requires_grad=True)
    _assert_equal(graphed(x), _sin_times_two(x.detach()), "replay before reset")
    graphed.reset()
    with pytest.raises(GraphReleasedError, match="released by reset"):
        graphed(x)
    with torch.no_grad(), pytest.raises(GraphReleasedError, match="released by reset"):
        graphed(x)
    graphed.reset()  # idempotent
    assert "released" in repr(graphed)


def test_mismatched_input_shape_is_an_input_error():
    module = _mlp()
    make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1, requires_grad=True),))
    wrong = _randn(2 * BATCH, HIDDEN, seed=2, requires_grad=True)
    with pytest.raises(CudaGraphInputError) as info:
        module(wrong)
    message = str(info.value)
    assert f"({2 * BATCH}, {HIDDEN})" in message, f"message should give the shape: {message}"
    assert f"({BATCH}, {HIDDEN})" in message, f"message should give the captured shape: {message}"
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, cudagraphs.CudaGraphsError)
    # The right shape still replays.
    assert module(_randn(BATCH, HIDDEN, seed=3)).shape == (BATCH, HIDDEN)


def test_function_with_dropout_gets_fresh_masks():
    # A plain function with RNG and no grad inputs is captured forward-only.
    def drop(x):
        return F.dropout(x, p=0.25, training=True)

    ones = torch.ones(128, 128, device="cuda")
    graphed = make_graphed_callables(drop, (ones,))
    first = graphed(ones).clone()
    second = graphed(ones)
    for name, out in (("first", first), ("second", second)):
        zeros = (out == 0).float().mean().item()
        assert 0.2 < zeros < 0.3, f"{name} replay dropped {zeros:.3f} (p=0.25)"
    assert not torch.equal(first, second), "two replays used the same dropout mask"


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.wide = nn.Linear(HIDDEN, 8 * HIDDEN)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return h.sum(), self.wide(h)  # a loss and "logits" beside it


def test_an_output_no_gradient_reaches_gets_zeros_without_a_zero_tensor_per_step():
    # HF's loss and logits: the loss alone is backpropagated. The replay hands the
    # logits no materialized zeros; their buffer, written by an earlier backward that
    # did use the logits, is zeroed in place, so the gradients stay eager's.
    rows = 512  # the logits (rows x 8 HIDDEN) outweigh every parameter gradient
    module = _TwoHeads().cuda()
    eager = copy.deepcopy(module)
    make_graphed_callables(module, (_randn(rows, HIDDEN, seed=1),))
    replays = count_backward_replays(module.cuda_graph.graphs)
    logits_bytes = rows * 8 * HIDDEN * 4
    for it, use_logits in enumerate((True, False, False)):
        x = _randn(rows, HIDDEN, seed=50 + it)
        for net in (module, eager):
            net.zero_grad(set_to_none=True)
            loss, logits = net(x)
            loss = loss + logits.square().sum() if use_logits else loss
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            torch.cuda.synchronize()
            growth = torch.cuda.max_memory_allocated() - before
            if net is module and not use_logits:
                assert growth < logits_bytes, f"step {it}: the backward made {growth} bytes"
        what = f"step {it} (logits used: {use_logits})"
        _assert_param_grads_equal(module.body, eager.body, what)
        if use_logits:
            _assert_param_grads_equal(module.wide, eager.wide, what)
        else:
            # The graph hands every parameter a gradient: zeros where none reached.
            assert all(q.grad is None for q in eager.wide.parameters())
            assert all(not p.grad.any() for p in module.wide.parameters()), what
    assert replays() == 3
