"""make_graphed_callables on a real GPU: capture-time hooks and the interleaved pipeline
schedule.

Graphed results must equal eager results exactly where the same kernels run, so every
comparison here is ``torch.equal``. The eager reference is a deep copy taken before
graphing, fed with identical inputs.
"""

import copy

import pytest
import torch
from torch import nn

from cudagraphs import (
    CaptureTimeHookError,
    GraphedCallable,
    make_graphed_callables,
)
from helpers.core_cuda import (
    HIDDEN,
    _assert_equal,
    _assert_param_grads_equal,
    _check_train_step,
    _detached_copies,
    _mlp,
    _randn,
)
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

BATCH = 4


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
