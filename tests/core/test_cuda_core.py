"""make_graphed_callables on a real GPU.

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
from _asserts import assert_bitwise_equal, contain_failed_capture
from _pipeline import (
    INTERLEAVED_ORDER,
    LAYERS_PER_CHUNK,
    NUM_CHUNKS,
    NUM_MICROBATCHES,
    check_order,
    entry_index,
    run_pipeline,
)
from cudagraphs import (
    CaptureTimeHookError,
    CudaGraphCaptureError,
    CudaGraphInputError,
    GraphedCallable,
    GraphReleasedError,
    make_graphed_callables,
    new_pool,
)
from cudagraphs.models import BlockConfig, PreNormBlock

pytestmark = pytest.mark.cuda

HIDDEN = 32
FFN = 64
BATCH = 4


# ---- helpers ---------------------------------------------------------------------------


def _randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    # Drawn on the CPU so that values do not depend on the CUDA generator's state.
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)
    return t.requires_grad_(requires_grad)


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).to(
        device="cuda", dtype=dtype
    )


_assert_equal = assert_bitwise_equal


def _assert_param_grads_equal(graphed, eager, what):
    for (name, p), (_, q) in zip(graphed.named_parameters(), eager.named_parameters()):
        if p.grad is None and q.grad is None:
            continue  # e.g. an unused parameter
        _assert_equal(p.grad, q.grad, f"{what}: grad of {name}")


_contain_failed_capture = contain_failed_capture


def _check_train_step(graphed, eager, x_seed, g_seed, shape, dtype, what):
    x = _randn(*shape, seed=x_seed, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = _randn(*shape, seed=g_seed, dtype=dtype)
    out = graphed(x)
    out_ref = eager(x_ref)
    _assert_equal(out, out_ref, f"{what}: output")
    out.backward(grad)
    out_ref.backward(grad)
    _assert_equal(x.grad, x_ref.grad, f"{what}: input grad")
    _assert_param_grads_equal(graphed, eager, what)


# ---- training equality -----------------------------------------------------------------


def test_mlp_training_equals_eager():
    module = _mlp()
    eager = copy.deepcopy(module)
    sample = _randn(BATCH, HIDDEN, seed=100, requires_grad=True)
    graphed = make_graphed_callables(module, (sample,))
    assert graphed is module, "a single module is returned itself"
    assert isinstance(module.cuda_graph, GraphedCallable)
    for it in range(4):
        module.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        _check_train_step(
            module, eager, 10 + it, 20 + it, (BATCH, HIDDEN), torch.float32, f"iteration {it}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prenorm_block_with_sdpa_training_equals_eager(dtype):
    torch.manual_seed(0)
    block = PreNormBlock(BlockConfig(hidden=64, heads=4, ffn=128)).to(device="cuda", dtype=dtype)
    eager = copy.deepcopy(block)
    shape = (2, 8, 64)
    make_graphed_callables(block, (_randn(*shape, seed=1, dtype=dtype, requires_grad=True),))
    for it in range(3):
        block.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        _check_train_step(block, eager, 30 + it, 40 + it, shape, dtype, f"iteration {it}")


class _ScaledMasked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, *, scale_tensor, mask=None):
        y = self.lin(x) * scale_tensor
        if mask is not None:
            y = torch.where(mask, y, torch.zeros_like(y))
        return y


def _kwargs_inputs(seed):
    x = _randn(BATCH, HIDDEN, seed=seed, requires_grad=True)
    scale = _randn(HIDDEN, seed=seed + 1, requires_grad=True)
    mask = _randn(BATCH, HIDDEN, seed=seed + 2) > 0
    return x, scale, mask


def _detached_copies(*tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _check_kwargs_step(module, eager, seed, reverse_kwargs):
    x, scale, mask = _kwargs_inputs(seed)
    x_ref, scale_ref, mask_ref = _detached_copies(x, scale, mask)
    if reverse_kwargs:
        out = module(x, mask=mask, scale_tensor=scale)
    else:
        out = module(x, scale_tensor=scale, mask=mask)
    out_ref = eager(x_ref, scale_tensor=scale_ref, mask=mask_ref)
    _assert_equal(out, out_ref, f"seed {seed}: output")
    grad = _randn(BATCH, HIDDEN, seed=seed + 3)
    out.backward(grad)
    out_ref.backward(grad)
    _assert_equal(x.grad, x_ref.grad, f"seed {seed}: grad of x")
    _assert_equal(scale.grad, scale_ref.grad, f"seed {seed}: grad of kwarg scale_tensor")
    _assert_param_grads_equal(module, eager, f"seed {seed}")


def test_kwargs_inputs_replay_and_get_grads():
    torch.manual_seed(0)
    module = _ScaledMasked().cuda()
    eager = copy.deepcopy(module)
    x, scale, mask = _kwargs_inputs(1)
    make_graphed_callables(module, (x,), sample_kwargs={"scale_tensor": scale, "mask": mask})
    for it in range(3):
        module.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        _check_kwargs_step(module, eager, 10 * (it + 1), reverse_kwargs=False)


def test_kwargs_order_at_the_call_site_does_not_matter():
    # Python keyword arguments have no meaningful order; a replay that passes the same
    # keywords in another order than sample_kwargs is the same call.
    torch.manual_seed(0)
    module = _ScaledMasked().cuda()
    eager = copy.deepcopy(module)
    x, scale, mask = _kwargs_inputs(1)
    make_graphed_callables(module, (x,), sample_kwargs={"scale_tensor": scale, "mask": mask})
    _check_kwargs_step(module, eager, 50, reverse_kwargs=True)


# ---- unused inputs ---------------------------------------------------------------------


def _uses_first_only(a, b):
    return a * 2


def test_unused_input_needs_allow_unused_input():
    a = _randn(8, seed=1, requires_grad=True)
    b = _randn(8, seed=2, requires_grad=True)
    with pytest.raises(ValueError, match="allow_unused_input"):
        make_graphed_callables(_uses_first_only, (a, b))

    graphed = make_graphed_callables(_uses_first_only, (a, b), allow_unused_input=True)
    assert isinstance(graphed, GraphedCallable)
    a2 = _randn(8, seed=3, requires_grad=True)
    b2 = _randn(8, seed=4, requires_grad=True)
    out = graphed(a2, b2)
    _assert_equal(out, a2.detach() * 2, "output")
    grad = _randn(8, seed=5)
    out.backward(grad)
    _assert_equal(a2.grad, grad * 2, "grad of the used input")
    assert b2.grad is None, f"the unused input must get no gradient, got {b2.grad}"


class _WithUnusedParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.unused = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x):
        return self.lin(x)


def test_unused_parameter_needs_allow_unused_input():
    torch.manual_seed(0)
    module = _WithUnusedParam().cuda()
    eager = copy.deepcopy(module)
    sample = _randn(BATCH, HIDDEN, seed=1, requires_grad=True)
    with pytest.raises(ValueError, match="allow_unused_input"):
        make_graphed_callables(module, (sample,))
    assert "forward" not in module.__dict__, "a failed graphing must leave the module alone"

    make_graphed_callables(module, (sample,), allow_unused_input=True)
    _check_train_step(module, eager, 2, 3, (BATCH, HIDDEN), torch.float32, "unused param")
    assert module.unused.grad is None, "the unused parameter must get no gradient"


# ---- inference, train/eval switching ---------------------------------------------------


def test_inference_graph_and_eager_fallback_in_train_mode():
    module = _mlp().eval()
    eager = copy.deepcopy(module)
    with torch.no_grad():
        make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1),))
        for seed in (2, 3):
            x = _randn(BATCH, HIDDEN, seed=seed)
            out = module(x)
            _assert_equal(out, eager(x), f"inference output (seed {seed})")
            assert not out.requires_grad, "an inference replay must not require grad"
    assert module.cuda_graph.graphs.bwd_graph is None, "inference captures no backward graph"

    # In train mode the module runs its original forward: autograd flows eagerly.
    module.train()
    eager.train()
    x = _randn(BATCH, HIDDEN, seed=4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = module(x)
    assert out.requires_grad and out.grad_fn is not None
    assert "Replay" not in type(out.grad_fn).__name__, (
        f"train mode must run eagerly, got grad_fn {type(out.grad_fn).__name__}"
    )
    out_ref = eager(x_ref)
    _assert_equal(out, out_ref, "eager train-mode output")
    grad = _randn(BATCH, HIDDEN, seed=5)
    out.backward(grad)
    out_ref.backward(grad)
    _assert_equal(x.grad, x_ref.grad, "eager train-mode input grad")
    _assert_param_grads_equal(module, eager, "eager train mode")

    # Back in eval mode the graph replays again.
    module.eval()
    eager.eval()
    with torch.no_grad():
        x = _randn(BATCH, HIDDEN, seed=6)
        _assert_equal(module(x), eager(x), "inference output after switching back")


# ---- RNG -------------------------------------------------------------------------------


def test_dropout_gets_a_fresh_mask_each_replay_and_backward_uses_it():
    module = nn.Dropout(p=0.5).cuda()
    shape = (64, 256)
    make_graphed_callables(module, (torch.ones(*shape, device="cuda", requires_grad=True),))
    masks = []
    for it in range(3):
        x = torch.ones(*shape, device="cuda", requires_grad=True)
        out = module(x)
        values = set(torch.unique(out.detach()).tolist())
        assert values <= {0.0, 2.0}, f"replay {it}: dropout(p=0.5) of ones gave {values}"
        zeros = (out == 0).float().mean().item()
        assert 0.45 < zeros < 0.55, f"replay {it}: {zeros:.3f} of the elements were dropped"
        out.backward(torch.ones_like(out))
        # d(out)/dx = mask * 2 = out for x = 1: the backward replay used this forward's mask.
        _assert_equal(x.grad, out.detach(), f"replay {it}: grad vs the forward mask")
        masks.append(out.detach().clone())
    assert not torch.equal(masks[0], masks[1]), "replays 0 and 1 used the same dropout mask"
    assert not torch.equal(masks[1], masks[2]), "replays 1 and 2 used the same dropout mask"


# ---- capture-time hooks ----------------------------------------------------------------

_GROUPS = {
    "forward_pre_hooks": "forward_pre",
    "forward_hooks": "forward",
    "backward_pre_hooks": "backward_pre",
    "backward_hooks": "backward",
}

_ONE_ITERATION = [
    (0, "forward_pre"),
    (0, "forward"),
    (1, "forward_pre"),
    (1, "forward"),
    (1, "backward_pre"),
    (1, "backward"),
    (0, "backward_pre"),
    (0, "backward"),
]


@pytest.mark.parametrize("order", [None, [1, 2, -2, -1]], ids=["unordered", "order"])
def test_capture_time_hook_order_identity_and_no_replay_calls(order):
    torch.manual_seed(0)
    modules = (nn.Linear(16, 16).cuda(), nn.Linear(16, 16).cuda())
    log = []
    problems = []

    def make_hook(index, name):
        def hook(module):
            log.append((index, name))
            if torch.cuda.is_current_stream_capturing():
                problems.append(f"{(index, name)} ran inside a capture")
            if module is not modules[index]:
                problems.append(f"{(index, name)} got {module!r}, not the original module")

        return hook

    hooks = [
        {group: {"log": make_hook(i, name)} for group, name in _GROUPS.items()} for i in range(2)
    ]
    sample_args = tuple((_randn(4, 16, seed=i, requires_grad=True),) for i in range(2))
    graphed = make_graphed_callables(
        modules,
        sample_args,
        num_warmup_iters=2,
        _order=order,
        pre_warmup_hook=lambda: log.append("pre_warmup"),
        post_warmup_hook=lambda: log.append("post_warmup"),
        capture_time_hooks=hooks,
    )
    assert not problems, problems
    expected = ["pre_warmup"] + _ONE_ITERATION * 2 + ["post_warmup"] + _ONE_ITERATION
    assert log == expected, f"hook log:\n{log}\nexpected:\n{expected}"
    assert log.index("post_warmup") == 1 + 2 * len(_ONE_ITERATION)

    before = len(log)
    for seed in (10, 20):
        x = _randn(4, 16, seed=seed, requires_grad=True)
        y = graphed[1](graphed[0](x))
        y.sum().backward()
        assert x.grad is not None
    assert len(log) == before, f"hooks ran on replay: {log[before:]}"


@pytest.mark.parametrize("phase", ["warmup", "capture"])
def test_capture_time_hook_returning_a_value_is_an_error(phase):
    torch.manual_seed(0)
    module = nn.Linear(16, 16).cuda()
    calls = []
    # num_warmup_iters=1: the forward hook's first call is in warmup, its second in capture.
    fail_on = 1 if phase == "warmup" else 2

    def bad_hook(m):
        calls.append(m)
        return "not None" if len(calls) == fail_on else None

    sample = _randn(4, 16, seed=1, requires_grad=True)
    with pytest.raises(CaptureTimeHookError, match="forward_hooks") as info:
        make_graphed_callables(
            module,
            (sample,),
            num_warmup_iters=1,
            capture_time_hooks=[{"forward_hooks": {"bad": bad_hook}}],
        )
    assert isinstance(info.value, RuntimeError)
    assert len(calls) == fail_on
    assert not torch.cuda.is_current_stream_capturing()
    assert "forward" not in module.__dict__, "a failed graphing must leave the module alone"

    eager = copy.deepcopy(module)
    make_graphed_callables(module, (sample,), num_warmup_iters=1)
    _check_train_step(module, eager, 2, 3, (4, 16), torch.float32, "graphed after hook error")


# ---- interleaved pipeline --------------------------------------------------------------


def _pipeline_layers(seed):
    torch.manual_seed(seed)
    return [_mlp(seed=seed + i) for i in range(NUM_CHUNKS * LAYERS_PER_CHUNK)]


def _pipeline_data(iteration):
    inputs = [
        _randn(BATCH, HIDDEN, seed=1000 * iteration + m, requires_grad=True)
        for m in range(NUM_MICROBATCHES)
    ]
    grads = [
        _randn(BATCH, HIDDEN, seed=1000 * iteration + 100 + m) for m in range(NUM_MICROBATCHES)
    ]
    return inputs, grads


@pytest.mark.parametrize("reuse", [False, True], ids=["separate_buffers", "reuse_buffers"])
def test_interleaved_pipeline_equals_eager(reuse):
    check_order(INTERLEAVED_ORDER, NUM_CHUNKS, NUM_MICROBATCHES)
    layers = _pipeline_layers(0)
    eager_layers = copy.deepcopy(layers)
    num_entries = NUM_CHUNKS * NUM_MICROBATCHES * LAYERS_PER_CHUNK
    sample_args = tuple(
        (_randn(BATCH, HIDDEN, seed=500 + i, requires_grad=True),) for i in range(num_entries)
    )
    graphed = make_graphed_callables(
        tuple(layers),
        sample_args,
        _order=list(INTERLEAVED_ORDER),
        _reuse_graph_input_output_buffers=reuse,
    )
    assert isinstance(graphed, tuple) and len(graphed) == num_entries
    assert all(isinstance(g, GraphedCallable) for g in graphed), [type(g) for g in graphed]

    def graphed_layer(c, m, i):
        return graphed[entry_index(c, m, i, LAYERS_PER_CHUNK, NUM_MICROBATCHES)]

    def eager_layer(c, m, i):
        return eager_layers[c * LAYERS_PER_CHUNK + i]

    kwargs = dict(num_chunks=NUM_CHUNKS, layers_per_chunk=LAYERS_PER_CHUNK)
    for iteration in range(2):  # gradients accumulate over both iterations
        inputs, grads = _pipeline_data(iteration)
        ref_inputs = _detached_copies(*inputs)
        run = run_pipeline(graphed_layer, INTERLEAVED_ORDER, inputs, grads, **kwargs)
        ref = run_pipeline(eager_layer, INTERLEAVED_ORDER, ref_inputs, grads, **kwargs)
        for m in range(NUM_MICROBATCHES):
            _assert_equal(run.outputs[m], ref.outputs[m], f"iter {iteration} mb {m}: output")
            _assert_equal(inputs[m].grad, ref_inputs[m].grad, f"iter {iteration} mb {m}: data grad")
        for k, (g, r) in enumerate(zip(run.boundary_grads, ref.boundary_grads)):
            _assert_equal(g, r, f"iter {iteration}: chunk-boundary grad {k}")
    for i, (layer, ref_layer) in enumerate(zip(layers, eager_layers)):
        _assert_param_grads_equal(layer, ref_layer, f"layer {i} (accumulated over 6 microbatches)")


# ---- gradient ownership ----------------------------------------------------------------


def _static_grad_ptrs(module):
    return {t.data_ptr() for t in module.cuda_graph.graphs.static_grad_inputs if t is not None}


def test_param_grads_are_handed_over_as_is_and_accumulate_like_eager():
    # The first backward hands the static buffers out as .grad (no copy); the next
    # replay would overwrite them, so it moves them to owned copies first, and the
    # accumulated sum is eager's bit for bit.
    module = _mlp()
    eager = copy.deepcopy(module)
    make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1),))
    static = _static_grad_ptrs(module)
    assert static, "the backward graph should produce parameter gradients"
    for it in range(3):  # no zeroing in between: gradients accumulate
        x = _randn(BATCH, HIDDEN, seed=10 + it)
        grad = _randn(BATCH, HIDDEN, seed=20 + it)
        module(x).backward(grad)
        eager(x).backward(grad)
        for name, p in module.named_parameters():
            aliased = p.grad.data_ptr() in static
            assert aliased == (it == 0), (
                f"iteration {it}: {name}.grad {'aliases' if aliased else 'does not alias'} "
                "its static gradient buffer"
            )
        _assert_param_grads_equal(module, eager, f"sum of {it + 1} replays")


def test_param_grads_with_set_to_none_and_an_optimizer_match_eager_without_copies():
    # torch's default regime: zero_grad(set_to_none=True) after every optimizer step,
    # so each backward's gradients become .grad as views of the buffers, never copied.
    module = _mlp()
    eager = copy.deepcopy(module)
    make_graphed_callables(module, (_randn(BATCH, HIDDEN, seed=1),))
    static = _static_grad_ptrs(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=True)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2, foreach=True)
    for it in range(4):
        x = _randn(BATCH, HIDDEN, seed=30 + it)
        grad = _randn(BATCH, HIDDEN, seed=40 + it)
        module(x).backward(grad)
        eager(x).backward(grad)
        assert all(p.grad.data_ptr() in static for p in module.parameters())
        _assert_param_grads_equal(module, eager, f"step {it}")
        opt.step()
        opt_eager.step()
        opt.zero_grad(set_to_none=True)
        opt_eager.zero_grad(set_to_none=True)
    for (name, p), q in zip(module.named_parameters(), eager.parameters()):
        _assert_equal(p.detach(), q.detach(), f"{name} after 4 AdamW steps")


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
