"""make_graphed_callables on a GPU under ``_order`` with several microbatches per
chunk, where an entry index and a callable index differ: the capture-time hooks run
around the right callable's forward and backward in the schedule's order (checked
against ``_pipeline.reference_log``), what a hook observes there, and a capture that
fails part way through the schedule, after which the same layers graph and train as
eager does."""

import copy

import pytest
import torch
from torch import nn

from cudagraphs import CudaGraphCaptureError, make_graphed_callables, new_pool
from helpers.asserts import contain_failed_capture
from helpers.core_cuda import (
    HIDDEN,
    _assert_equal,
    _assert_param_grads_equal,
    _detached_copies,
    _mlp,
    _randn,
    count_replays,
)
from helpers.pipeline import (
    INTERLEAVED_ORDER,
    LAYERS_PER_CHUNK,
    NUM_CHUNKS,
    NUM_MICROBATCHES,
    entry_index,
    reference_log,
    run_pipeline,
)

pytestmark = pytest.mark.cuda

BATCH = 4
GROUPS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


class PlantedError(RuntimeError):
    pass


class Logged(nn.Module):
    """An MLP layer that logs its forwards and (through a hook on its output) the
    backwards through it, and can fail its backward while a capture runs."""

    def __init__(self, index, log, seed):
        super().__init__()
        self.index, self.log = index, log
        self.net = _mlp(seed=seed)
        self.fail_backward_in_capture = False
        self.last_output = None

    def forward(self, x):
        self.log.append(("call", self.index))
        y = self.net(x)
        self.last_output = y
        if y.requires_grad:
            y.register_hook(self._backward)
        return y

    def _backward(self, grad):
        self.log.append(("bwd", self.index))
        if self.fail_backward_in_capture and torch.cuda.is_current_stream_capturing():
            raise PlantedError(f"planted failure in the backward capture of layer {self.index}")


def _layers(log, seed=0):
    return [Logged(i, log, seed + i) for i in range(NUM_CHUNKS * LAYERS_PER_CHUNK)]


def _samples():
    n = NUM_CHUNKS * NUM_MICROBATCHES * LAYERS_PER_CHUNK
    return tuple((_randn(BATCH, HIDDEN, seed=500 + i, requires_grad=True),) for i in range(n))


def _hooks(layers, log, problems):
    def make(index, group):
        def hook(module):
            if torch.cuda.is_current_stream_capturing():
                problems.append(f"{group} of layer {index} ran inside a capture")
            if module is not layers[index]:
                problems.append(f"{group} of layer {index} got {module!r}")
            grads = [p.grad for p in module.parameters()]
            log.append(("hook", index, group, module.last_output is not None, grads))

        return hook

    return [{g: {"log": make(i, g)} for g in GROUPS} for i in range(len(layers))]


def _pipeline_data(iteration):
    inputs = [
        _randn(BATCH, HIDDEN, seed=1000 * iteration + m, requires_grad=True)
        for m in range(NUM_MICROBATCHES)
    ]
    grads = [
        _randn(BATCH, HIDDEN, seed=1000 * iteration + 100 + m) for m in range(NUM_MICROBATCHES)
    ]
    return inputs, grads


def _train_like_eager(layers, eager_layers, graphed, iterations=2):
    """Interleaved pipeline iterations, graphed and eager: equal outputs, input and
    boundary gradients and accumulated parameter gradients; each entry's forward and
    backward graph replayed once per iteration."""
    entries = [g.graphs for g in graphed]
    counts = [(count_replays(e, "fwd_graph"), count_replays(e, "bwd_graph")) for e in entries]

    def graphed_layer(c, m, i):
        return graphed[entry_index(c, m, i, LAYERS_PER_CHUNK, NUM_MICROBATCHES)]

    def eager_layer(c, m, i):
        return eager_layers[c * LAYERS_PER_CHUNK + i]

    kwargs = dict(num_chunks=NUM_CHUNKS, layers_per_chunk=LAYERS_PER_CHUNK)
    for iteration in range(iterations):
        inputs, grads = _pipeline_data(iteration)
        ref_inputs = _detached_copies(*inputs)
        run = run_pipeline(graphed_layer, INTERLEAVED_ORDER, inputs, grads, **kwargs)
        ref = run_pipeline(eager_layer, INTERLEAVED_ORDER, ref_inputs, grads, **kwargs)
        for m in range(NUM_MICROBATCHES):
            _assert_equal(run.outputs[m], ref.outputs[m], f"iter {iteration} mb {m}: output")
            _assert_equal(inputs[m].grad, ref_inputs[m].grad, f"iter {iteration} mb {m}: grad")
        for k, (g, r) in enumerate(zip(run.boundary_grads, ref.boundary_grads)):
            _assert_equal(g, r, f"iter {iteration}: boundary grad {k}")
    assert [(f(), b()) for f, b in counts] == [(iterations, iterations)] * len(entries)
    for i, (layer, ref_layer) in enumerate(zip(layers, eager_layers)):
        _assert_param_grads_equal(layer, ref_layer, f"layer {i}")


def test_hooks_follow_the_schedule_with_several_microbatches_per_chunk():
    log, problems = [], []
    layers = _layers(log)
    eager_layers = copy.deepcopy(layers)
    for layer in eager_layers:
        layer.log = []
    graphed = make_graphed_callables(
        tuple(layers),
        _samples(),
        num_warmup_iters=2,
        _order=list(INTERLEAVED_ORDER),
        pre_warmup_hook=lambda: log.append(("pre_warmup",)),
        post_warmup_hook=lambda: log.append(("post_warmup",)),
        capture_time_hooks=_hooks(layers, log, problems),
    )
    assert not problems, problems
    reference = [
        e[:2] if e[0] != "hook" else ("hook", e[1], e[2])
        for e in reference_log(
            INTERLEAVED_ORDER, (LAYERS_PER_CHUNK,) * NUM_CHUNKS, NUM_MICROBATCHES
        )
    ]
    got = [e[:3] if e[0] == "hook" else e for e in log]
    expected = [("pre_warmup",)] + reference * 2 + [("post_warmup",)] + reference
    assert got == expected, "hook log differs from the schedule"

    # What each hook saw: its module's forward output from that phase (a backward
    # pre-hook too), and no .grad written (warmup and capture use autograd.grad).
    for e in log:
        if e[0] == "hook":
            _, index, group, had_output, grads = e
            assert all(g is None for g in grads), f"{group} of layer {index} saw a .grad"
            if group != "forward_pre_hooks":
                assert had_output, f"{group} of layer {index} ran before any forward"

    before = len(log)
    _train_like_eager(layers, eager_layers, graphed)
    assert len(log) == before, f"hooks or eager forwards ran on replay: {log[before:][:4]}"


def test_a_backward_capture_failing_part_way_leaves_the_layers_and_the_device_usable():
    log = []
    layers = _layers(log, seed=10)
    eager_layers = copy.deepcopy(layers)
    for layer in eager_layers:
        layer.log = []
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    samples = _samples()
    layers[1].fail_backward_in_capture = True  # chunk 1's last layer, after 10 captures
    pool = new_pool()
    stream = torch.cuda.current_stream()
    rng = torch.cuda.get_rng_state()
    try:
        with pytest.raises(CudaGraphCaptureError) as info:
            make_graphed_callables(
                tuple(layers), samples, _order=list(INTERLEAVED_ORDER), pool=pool
            )
        assert isinstance(info.value.__cause__, PlantedError)
        assert "backward" in str(info.value)
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.cuda.current_stream() == stream
        assert torch.equal(torch.cuda.get_rng_state(), rng), "the CUDA generator moved"
        for layer in layers:
            assert "forward" not in layer.__dict__ and not hasattr(layer, "cuda_graph")
        for p, b in zip((p for layer in layers for p in layer.parameters()), before):
            assert torch.equal(p, b) and p.grad is None
        torch.rand(8, device="cuda")  # the generator draws again

        layers[1].fail_backward_in_capture = False
        graphed = make_graphed_callables(
            tuple(layers), samples, _order=list(INTERLEAVED_ORDER), pool=pool
        )
        _train_like_eager(layers, eager_layers, graphed)
    finally:
        contain_failed_capture(pool)
