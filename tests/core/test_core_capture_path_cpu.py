"""The capture path on the CPU: ``run_warmup`` and ``capture_plan`` over plans from
``canonicalize``, with ``capture_into_graph`` replaced by an eager stand-in
(``_stand_in_capture``). What runs is the real schedule walk, the real hooks, the real
static buffers and the real error handling.

The hook order is checked against a reference written from ``_order`` alone, over
random pipeline schedules with several microbatches per chunk and uneven chunks: that
is where an entry index and a callable index differ. Each log line names the callable
and the entry (read back from the input's first element), so a hook run for the wrong
callable, a forward given another entry's input, or a backward out of place all show.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudagraphs.core.canonicalize import canonicalize
from cudagraphs.core.capture_phase import capture_plan
from cudagraphs.core.sharing import BufferSharing
from cudagraphs.core.warmup import run_warmup
from cudagraphs.errors import CaptureTimeHookError, CudaGraphsValueError
from helpers.pipeline import reference_log
from helpers.stand_in_capture import PlantedCaptureError, StandInCapture, cpu_options

GROUPS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


class Logged(nn.Module):
    """A layer that logs each forward (with the entry its input stands for) and, through
    a hook on its output, each backward through it."""

    def __init__(self, index: int, log: list) -> None:
        super().__init__()
        self.index = index
        self.log = log
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entry = int(round(x[0, 0].item()))
        self.log.append(("call", self.index, entry))
        y = self.lin(x)
        y.register_hook(lambda g: self.log.append(("bwd", self.index, entry)))
        return y


def _hooks(modules, log, problems):
    def make(index, group):
        def hook(module):
            log.append(("hook", index, group))
            if module is not modules[index]:
                problems.append(f"{group} of callable {index} got {module!r}")

        return hook

    return [{g: {"log": make(i, g)} for g in GROUPS} for i in range(len(modules))]


def _sample(entry: int) -> torch.Tensor:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(entry))
    x[0, 0] = entry  # which entry this input stands for, read back by Logged
    return x.requires_grad_(True)


@st.composite
def pipelines(draw):
    """A random valid ``_order`` (any interleaving where a chunk's backward of a
    microbatch follows its forward), with uneven layers per chunk."""
    num_chunks = draw(st.integers(1, 3))
    num_microbatches = draw(st.integers(1, 3))
    layers = tuple(draw(st.lists(st.integers(1, 2), min_size=num_chunks, max_size=num_chunks)))
    fwd, bwd, order = [0] * num_chunks, [0] * num_chunks, []
    while len(order) < 2 * num_chunks * num_microbatches:
        moves = [c + 1 for c in range(num_chunks) if fwd[c] < num_microbatches]
        moves += [-(c + 1) for c in range(num_chunks) if bwd[c] < fwd[c]]
        x = draw(st.sampled_from(moves))
        (fwd if x > 0 else bwd)[abs(x) - 1] += 1
        order.append(x)
    return order, layers, num_microbatches


def _plan(order, layers, num_microbatches, log, problems, **kwargs):
    modules = tuple(Logged(i, log) for i in range(sum(layers)))
    n = num_microbatches * sum(layers)
    plan = canonicalize(
        modules,
        tuple((_sample(e),) for e in range(n)),
        order=order,
        num_layers_per_chunk=list(layers),
        capture_time_hooks=_hooks(modules, log, problems),
        **kwargs,
    )
    return plan, modules


@settings(max_examples=60, deadline=None)
@given(pipelines(), st.integers(0, 2))
def test_warmup_and_capture_run_hooks_forwards_and_backwards_in_order_order(pipeline, num_iters):
    order, layers, num_microbatches = pipeline
    log, problems = [], []
    plan, _ = _plan(order, layers, num_microbatches, log, problems)
    expected = reference_log(order, layers, num_microbatches)

    run_warmup(plan, num_iters, allow_unused_input=False)
    assert log == expected * num_iters
    del log[:]
    mp = pytest.MonkeyPatch()
    try:
        stand_in = StandInCapture().install(mp)
        graphs = capture_plan(plan, cpu_options())
    finally:
        mp.undo()
    assert log == expected
    assert not problems, problems
    assert len(graphs) == len(plan.entries)
    # One forward and one backward graph per entry, captured in the schedule's order.
    kinds = [(s.kind, s.entry) for s in plan.schedule]
    assert len(stand_in.graphs) == len(kinds) == 2 * len(plan.entries)
    for g in graphs:
        assert g.fwd_graph.what == f"forward of {g.name}"
        assert g.bwd_graph.what == f"backward of {g.name}"
    names = [graphs[e].name for _, e in kinds]
    assert [w.split(" of ", 1)[1] for w in stand_in.whats] == names


def test_the_unordered_schedule_runs_forwards_then_backwards_in_reverse():
    log, problems = [], []
    modules = tuple(Logged(i, log) for i in range(3))
    plan = canonicalize(
        modules,
        tuple((_sample(e),) for e in range(3)),
        capture_time_hooks=_hooks(modules, log, problems),
    )
    run_warmup(plan, 1, allow_unused_input=False)
    fwd = [
        t
        for i in range(3)
        for t in (("hook", i, "forward_pre_hooks"), ("call", i, i), ("hook", i, "forward_hooks"))
    ]
    bwd = [
        t
        for i in (2, 1, 0)
        for t in (("hook", i, "backward_pre_hooks"), ("bwd", i, i), ("hook", i, "backward_hooks"))
    ]
    assert log == fwd + bwd
    assert not problems


def test_what_a_hook_observes_in_warmup_and_capture(monkeypatch):
    """A forward hook runs once its entry's forward returned (the module holds that
    output) and before the next forward; a backward pre-hook right before that entry's
    backward, a backward hook right after it. No hook sees a ``.grad`` written: both
    phases take gradients with ``torch.autograd.grad``."""
    log, problems = [], []
    order, layers, mbs = [1, 1, 2, -2, 2, -1, -2, -1], (1, 2), 2
    plan, modules = _plan(order, layers, mbs, log, problems)
    last_output = {}

    def keep(module, args, output):
        last_output[module.index] = output

    for m in modules:
        m.register_forward_hook(keep)

    def observe(index, group):
        def hook(module):
            out = last_output.get(index)
            grads = [p.grad for p in module.parameters()]
            log.append(("seen", index, group, out is not None, grads == [None, None]))

        return hook

    for i, h in enumerate(plan.hooks):
        for g in GROUPS:
            object.__setattr__(h, g, (*getattr(h, g), ("observe", observe(i, g))))
    run_warmup(plan, 1, allow_unused_input=False)
    StandInCapture().install(monkeypatch)
    capture_plan(plan, cpu_options())
    events = [e for e in log if e[0] != "hook"]
    seen = [k for k, e in enumerate(events) if e[0] == "seen"]
    assert len(seen) == 2 * len(GROUPS) * len(plan.entries)
    for k in seen:
        _, index, group, has_output, no_grad = events[k]
        assert no_grad, f"{group} of callable {index} saw a .grad written"
        if group == "forward_pre_hooks":
            assert events[k + 1][:2] == ("call", index), events[k : k + 2]
        elif group == "forward_hooks":
            assert has_output and events[k - 1][:2] == ("call", index), events[k - 1 : k + 1]
        elif group == "backward_pre_hooks":
            assert has_output and events[k + 1][:2] == ("bwd", index), events[k : k + 2]
        else:
            assert events[k - 1][:2] == ("bwd", index), events[k - 1 : k + 1]


@pytest.mark.parametrize("fail_at", [0, 1, 2, 5, 7])
def test_a_capture_failing_part_way_releases_every_graph_captured_before(monkeypatch, fail_at):
    log, problems = [], []
    order, layers, mbs = [1, 2, -2, 1, -1, 2, -2, -1], (1, 1), 2
    plan, modules = _plan(order, layers, mbs, log, problems)
    before = [p.detach().clone() for m in modules for p in m.parameters()]
    stand_in = StandInCapture(fail_at=fail_at).install(monkeypatch)
    with pytest.raises(PlantedCaptureError):
        capture_plan(plan, cpu_options())
    assert len(stand_in.graphs) == fail_at
    assert [g.resets for g in stand_in.graphs] == [1] * fail_at, "each earlier graph released"
    for p, b in zip((p for m in modules for p in m.parameters()), before):
        assert torch.equal(p, b) and p.grad is None, "a failed capture touches no parameter"
    # The same plan captures in full afterwards.
    good = StandInCapture().install(monkeypatch)
    graphs = capture_plan(plan, cpu_options())
    assert len(good.graphs) == 2 * len(plan.entries)
    assert all(g.resets == 0 for g in good.graphs)
    assert {id(g.fwd_graph) for g in graphs} | {id(g.bwd_graph) for g in graphs} == {
        id(g) for g in good.graphs
    }


def test_a_hook_error_in_capture_releases_the_graphs_before_it(monkeypatch):
    calls = []
    modules = (Logged(0, []), Logged(1, []))

    def bad(module):
        calls.append(module)
        return False if module is modules[1] else None

    plan = canonicalize(
        modules,
        ((_sample(0),), (_sample(1),)),
        capture_time_hooks=[{"forward_hooks": {"bad": bad}}] * 2,
    )
    stand_in = StandInCapture().install(monkeypatch)
    with pytest.raises(CaptureTimeHookError, match=r"capture_time_hooks\[1\]\['forward_hooks'\]"):
        capture_plan(plan, cpu_options())
    # Callable 0's forward and callable 1's forward were captured, then the hook failed.
    assert [g.resets for g in stand_in.graphs] == [1, 1]


@pytest.mark.parametrize(
    "order, num_slots",
    [([1, -1, 1, -1, 1, -1], 2), ([1, 1, -1, -1, 1, -1], 4), ([1, 1, -1, 1, -1, -1], 4)],
)
def test_reused_buffers_are_shared_within_a_slot_and_only_there(monkeypatch, order, num_slots):
    """Under ``_reuse_graph_input_output_buffers`` entries of one slot share static
    inputs and incoming-gradient buffers; entries of different slots share nothing.
    With two microbatches alive at once a callable has two slots."""
    log, problems = [], []
    plan, _ = _plan(order, (2,), 3, log, problems, reuse_buffers=True)
    assert len(set(plan.buffer_slots)) == num_slots
    StandInCapture().install(monkeypatch)
    graphs = capture_plan(plan, cpu_options())
    slots = plan.buffer_slots
    for a in range(len(graphs)):
        for b in range(a + 1, len(graphs)):
            same_in = graphs[a].static_inputs[0] is graphs[b].static_inputs[0]
            same_grad = graphs[a].static_grad_outputs[0] is graphs[b].static_grad_outputs[0]
            assert same_in == same_grad == (slots[a] == slots[b]), (a, b, slots)
    # Only the first entry of a slot counts its input buffers.
    counted = [g.buffer_bytes > 0 for g in graphs]
    firsts = [slots.index(s) == i for i, s in enumerate(slots)]
    assert counted == firsts


def test_separate_entries_own_their_static_inputs_holding_the_sample_values(monkeypatch):
    log, problems = [], []
    plan, _ = _plan([1, 2, -2, -1], (1, 1), 1, log, problems)
    StandInCapture().install(monkeypatch)
    graphs = capture_plan(plan, cpu_options())
    ptrs = {g.static_inputs[0].data_ptr() for g in graphs}
    assert len(ptrs) == len(graphs)
    for g, spec in zip(graphs, plan.entries):
        (static,), (sample,) = g.static_inputs, spec.tensors
        assert static is not sample and static.data_ptr() != sample.data_ptr()
        assert torch.equal(static, sample) and static.requires_grad
        (grad_out,) = g.static_grad_outputs
        nbytes = static.numel() * static.element_size()
        # Its input buffer and its own incoming-gradient buffer (nothing shared here).
        assert g.buffer_bytes == nbytes + grad_out.numel() * grad_out.element_size()


def test_chained_inputs_are_the_source_outputs_and_shared_grad_buffers_one(monkeypatch):
    """Under sharing, a chained input is the source entry's static output (no buffer of
    its own, no bytes counted), and entries with equal output shapes share one
    incoming-gradient buffer, counted once."""
    modules = tuple(Logged(i, []) for i in range(3))
    plan = canonicalize(modules, tuple((_sample(e),) for e in range(3)))
    sharing = BufferSharing(grad_outputs=True, chained_inputs={(1, 0): (0, 0), (2, 0): (1, 0)})
    StandInCapture().install(monkeypatch)
    graphs = capture_plan(plan, cpu_options(sharing=sharing))
    for e in (1, 2):  # the same memory (out_leaves are detached aliases after backward)
        assert graphs[e].static_inputs[0].data_ptr() == graphs[e - 1].out_leaves[0].data_ptr()
    assert graphs[1].static_inputs[0].data_ptr() != graphs[2].static_inputs[0].data_ptr()
    assert [g.chained for g in graphs] == [(), ((0, graphs[0].name),), ((0, graphs[1].name),)]
    grad_buffers = {id(g.static_grad_outputs[0]) for g in graphs}
    assert len(grad_buffers) == 1
    nbytes = 2 * 4 * 4
    # Entry 0: its input and the shared gradient buffer (made by the first backward
    # captured: entry 2's); entries 1 and 2 own no input buffer.
    assert [g.buffer_bytes for g in graphs] == [nbytes, 0, nbytes]


def test_shared_grad_buffers_are_shared_only_by_equal_shapes_and_dtypes(monkeypatch):
    modules = [Logged(i, []) for i in range(4)]
    modules[1].double()
    modules[2].lin = nn.Linear(4, 3)  # another output shape
    samples = [_sample(e) for e in range(4)]
    samples[1] = samples[1].double().detach().requires_grad_(True)
    plan = canonicalize(tuple(modules), tuple((s,) for s in samples))
    StandInCapture().install(monkeypatch)
    graphs = capture_plan(plan, cpu_options(sharing=BufferSharing(grad_outputs=True)))
    buffers = [g.static_grad_outputs[0] for g in graphs]
    for g, b in zip(graphs, buffers):
        out = g.out_leaves[0]
        assert (b.shape, b.dtype) == (out.shape, out.dtype)
    assert buffers[0] is buffers[3]
    assert len({id(b) for b in buffers}) == 3


@pytest.mark.parametrize("num_iters", [0, 1, 3])
def test_pre_and_post_warmup_hooks_run_once_around_the_warmup_also_without_iterations(num_iters):
    log = []
    modules = (Logged(0, log),)
    plan = canonicalize(modules, ((_sample(0),),))
    run_warmup(
        plan,
        num_iters,
        allow_unused_input=False,
        pre_warmup_hook=lambda: log.append("pre"),
        post_warmup_hook=lambda: log.append("post"),
    )
    assert log == ["pre"] + [("call", 0, 0), ("bwd", 0, 0)] * num_iters + ["post"]


class Scaled(nn.Module):
    """A layer with a keyword input; logs (grad enabled, scale) at each forward."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, scale):
        self.seen.append((torch.is_grad_enabled(), float(scale[0])))
        return self.lin(x) * scale


class _Unused(nn.Module):
    """Uses ``lin`` and ignores ``spare``: a parameter that gets no gradient."""

    def __init__(self):
        super().__init__()
        self.lin, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_an_unused_parameter_fails_the_warmup_naming_the_callable_unless_allowed():
    from cudagraphs.errors import CudaGraphsValueError

    plan = canonicalize(_Unused(), (_sample(0),))
    with pytest.raises(CudaGraphsValueError, match=r"^callable.*_Unused.*allow_unused_input=True"):
        run_warmup(plan, 1, allow_unused_input=False)
    run_warmup(plan, 2, allow_unused_input=True)  # its gradient is None: no error


def test_the_warmup_passes_keywords_and_runs_without_grad_for_inference():
    seen = []

    module = Scaled(seen)
    scale = torch.full((1,), 3.0)
    train = canonicalize(module, (_sample(0),), sample_kwargs={"scale": scale})
    run_warmup(train, 1, allow_unused_input=False)
    module.eval()
    with torch.no_grad():
        infer = canonicalize(module, (_sample(0).detach(),), sample_kwargs={"scale": scale})
    assert not infer.training
    with torch.enable_grad():  # the plan decides, not the caller's mode
        run_warmup(infer, 1, allow_unused_input=False)
    assert seen == [(True, 3.0), (False, 3.0)]


def test_non_tensor_outputs_and_outputs_without_differentiable_inputs_are_skipped():
    """A backward takes only the outputs that require grad, and none at all where the
    entry has nothing differentiable (an input that does not require grad). An output
    that requires grad through a tensor the callable closes over is refused: its
    gradient would be missing (test_a_function_that_uses_a_weight_it_does_not_take_...)."""
    layer = nn.Linear(4, 4)

    def constant_beside(x):
        return x * 2, 3  # a non-tensor leaf beside the tensor

    modules = (layer, constant_beside)
    plan = canonicalize(modules, ((_sample(0),), (_sample(1).detach(),)))
    assert plan.training
    run_warmup(plan, 2, allow_unused_input=False)
    assert layer.weight.grad is None  # warmup backwards never touch .grad


def test_every_capture_goes_to_the_options_pool_and_stream_and_counts_its_growth(monkeypatch):
    log, problems = [], []
    plan, _ = _plan([1, 2, -2, 1, -1, 2, -2, -1], (1, 1), 2, log, problems)
    opts = cpu_options()
    stand_in = StandInCapture().install(monkeypatch)
    graphs = capture_plan(plan, opts)
    assert all(pool is opts.pool and stream is opts.stream for pool, stream in stand_in.places)
    assert set(map(id, stand_in.devices)) == {id(opts.stream.device)}
    # Forward and backward each grew the pool by GROWTH (read before and after).
    assert [g.pool_bytes for g in graphs] == [2 * StandInCapture.GROWTH] * len(graphs)


def test_entry_names_say_chunk_microbatch_and_layer_under_order_only(monkeypatch):
    log, problems = [], []
    plan, _ = _plan([1, 2, -2, 1, -1, 2, -2, -1], (1, 1), 2, log, problems)
    StandInCapture().install(monkeypatch)
    names = [g.name for g in capture_plan(plan, cpu_options())]
    assert names[1] == "callables[0] (Logged), entry 1 (chunk 1, microbatch 1, layer 0)"
    assert names[2] == "callables[1] (Logged), entry 2 (chunk 2, microbatch 0, layer 0)"
    single = canonicalize(Logged(0, []), (_sample(0),))
    (graph,) = capture_plan(single, cpu_options())
    assert "entry" not in graph.name and "Logged" in graph.name


def test_an_inference_capture_has_no_backward_and_names_its_untracked_parameters(monkeypatch):
    seen = []

    module = Scaled(seen).eval()
    with torch.no_grad():
        plan = canonicalize(
            module, (_sample(0).detach(),), sample_kwargs={"scale": torch.full((1,), 2.0)}
        )
    stand_in = StandInCapture().install(monkeypatch)
    with torch.enable_grad():
        (graph,) = capture_plan(plan, cpu_options())
    assert seen == [(False, 2.0)] and len(stand_in.graphs) == 1
    assert graph.bwd_graph is None and graph.params == ()
    assert [n for n, _ in graph.untracked_params] == ["lin.weight", "lin.bias"]
    assert [p for _, p in graph.untracked_params] == list(module.parameters())
    assert not graph.positional_only and graph.replay_keywords is not None
    assert not graph.out_leaves[0].requires_grad


def test_a_positional_training_entry_tracks_its_parameters_and_lends_through_the_pool(
    monkeypatch,
):
    module = Logged(0, [])
    plan = canonicalize(module, (_sample(0),))
    StandInCapture().install(monkeypatch)
    opts = cpu_options(clone_param_grads_on_return=False)
    (graph,) = capture_plan(plan, opts)
    assert graph.positional_only and graph.untracked_params == ()
    assert graph.params == tuple(module.parameters())
    assert graph.clone_param_grads is False
    assert graph.lent is opts.pool.lent_grads and graph.lent is not None
    (owned,) = capture_plan(plan, cpu_options())
    assert owned.clone_param_grads is True


@pytest.mark.parametrize("retain", [False, True])
def test_static_outputs_drop_the_captured_autograd_graph_unless_retained(monkeypatch, retain):
    plan = canonicalize(Logged(0, []), (_sample(0),))
    StandInCapture().install(monkeypatch)
    (graph,) = capture_plan(plan, cpu_options(retain_graph_in_backward=retain))
    out = graph.out_leaves[0]
    assert (out.grad_fn is not None) == retain
    assert graph.out_differentiable == (True,)


def test_owned_gradients_of_many_callables_are_staged_in_one_buffer(monkeypatch):
    """Owned mode, three equal callables: every backward leaves its parameter
    gradients in views of one buffer sized for one callable; lent mode does not."""
    modules = tuple(Logged(i, []) for i in range(3))
    plan = canonicalize(modules, tuple((_sample(e),) for e in range(3)))
    StandInCapture().install(monkeypatch)

    def storages(graphs):
        return {
            g.untyped_storage().data_ptr()
            for e in graphs
            for g in e.static_grad_inputs[len(e.diff_input_positions) :]
        }

    owned = capture_plan(plan, cpu_options())
    assert len(storages(owned)) == 1
    for e, m in zip(owned, modules):
        grads = e.static_grad_inputs[len(e.diff_input_positions) :]
        assert [g.shape for g in grads] == [p.shape for p in m.parameters()]
    lent = capture_plan(plan, cpu_options(clone_param_grads_on_return=False))
    assert len(storages(lent)) == 3 * 2


def test_in_graph_accumulation_adds_into_the_targets_and_hands_out_no_parameter_grads(
    monkeypatch,
):
    from cudagraphs.core.grad_targets import GradTargets

    module = Logged(0, [])
    params = tuple(module.parameters())
    targets = tuple(torch.zeros_like(p) for p in params)
    grad_targets = GradTargets(
        owner="m",
        attr="main_grad",
        params=params,
        names=("lin.weight", "lin.bias"),
        targets=targets,
        data_ptrs=tuple(t.data_ptr() for t in targets),
    )
    plan = canonicalize(module, (_sample(0),))
    StandInCapture().install(monkeypatch)
    adds = []
    real_add = torch._foreach_add_

    def spy(tensors, others):
        adds.append(([id(t) for t in tensors], [tuple(o.shape) for o in others]))
        return real_add(tensors, others)

    monkeypatch.setattr(torch, "_foreach_add_", spy)
    (graph,) = capture_plan(plan, cpu_options(grad_targets=(grad_targets,)))
    assert graph.grad_targets is grad_targets
    n = len(graph.diff_input_positions)
    assert graph.static_grad_inputs[n:] == (None, None)
    # One multi-tensor add of the parameters' gradients into the targets.
    assert adds == [([id(t) for t in targets], [tuple(p.shape) for p in params])]


def _explicit_parameter_function(module: nn.Module):
    """A function of ``(params, x)`` that runs ``module`` with ``params`` bound in place
    of its own (as partial graphs' graphed functions do)."""
    names = [n for n, _ in module.named_parameters()]

    def run(params, x):
        return torch.func.functional_call(module, dict(zip(names, params)), (x,))

    return run


def test_warmup_passes_each_parameter_input_as_one_alias_like_the_capture_does():
    module = nn.Linear(4, 4)
    params = tuple(module.parameters())
    inner = _explicit_parameter_function(module)
    seen = []

    def fn(params, x):
        seen.append(params)
        inputs.append(x)
        return inner(params, x)

    inputs = []
    x = torch.randn(2, 4, requires_grad=True)
    plan = canonicalize((fn,), ((params, x),))
    run_warmup(plan, 2, allow_unused_input=False)
    assert len(seen) == 2
    # The sample tensor that is not a parameter is passed as it is.
    assert all(got is x for got in inputs)
    for got in seen:
        for alias, p in zip(got, params):
            assert type(alias) is nn.Parameter and alias is not p
            assert alias.data_ptr() == p.data_ptr() and alias.requires_grad
    # One alias per parameter for the whole warmup, and the parameters' .grad untouched.
    assert all(a is b for a, b in zip(seen[0], seen[1]))
    assert all(p.grad is None for p in params)


def test_a_lazy_parameter_input_is_passed_as_itself():
    # Its first forward materializes it: an alias would be of nothing.
    lazy = nn.parameter.UninitializedParameter(requires_grad=False)
    seen = []

    def fn(params, x):
        seen.append(params[0])
        return x * 2

    plan = canonicalize((fn,), (((lazy,), torch.randn(2, 4, requires_grad=True)),))
    run_warmup(plan, 1, allow_unused_input=False)
    assert len(seen) == 1 and seen[0] is lazy


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_explicit_parameter_function_warms_up_and_captures_on_one_compile():
    """Dynamo guards on whether an input *is* the module's parameter that
    ``functional_call`` swaps out: the warmup passes the capture's kind of alias, so
    the capture finds the warmup's compile (``fail_on_recompile`` would refuse another)."""
    import torch._dynamo.testing

    module = nn.Linear(4, 4)
    params = tuple(module.parameters())
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(_explicit_parameter_function(module), backend=counter)
    x = torch.randn(2, 4, requires_grad=True)
    plan = canonicalize((fn,), ((params, x),))
    total, last = run_warmup(plan, 2, allow_unused_input=False)
    assert counter.frame_count == 1
    # The first iteration compiled, the last did not: the total keeps the first's.
    assert len(total.frames) >= 1 and last.frames == ()
    mp = pytest.MonkeyPatch()
    try:
        StandInCapture().install(mp)
        with torch.compiler.set_stance("fail_on_recompile"):
            graphs = capture_plan(plan, cpu_options())
    finally:
        mp.undo()
    assert len(graphs) == 1 and counter.frame_count == 1
    # The reference: compiled on the parameter itself, an alias is one compile more.
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    fresh = torch.compile(_explicit_parameter_function(module), backend=counter)
    fresh(params, x)
    fresh(tuple(nn.Parameter(p.detach()) for p in params), x)
    assert counter.frame_count == 2


class _Reached(torch.autograd.Function):
    """The identity, logging ``name`` when a gradient comes back through it."""

    @staticmethod
    def forward(ctx, x, name, log):
        ctx.name, ctx.log = name, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.name)
        return grad, None, None


class _Outputs(nn.Module):
    """Tensor outputs at positions 0 and 2 (a plain value between), both differentiable."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log = log

    def forward(self, x):
        y = self.lin(x)
        return {
            "a": _Reached.apply(y, "a", self.log),
            "n": 3,
            "b": _Reached.apply(y, "b", self.log),
        }


@pytest.mark.parametrize(
    ("unreached", "reached"),
    [(None, ["a", "b"]), ({0: frozenset({1})}, ["a"]), ({0: frozenset({0})}, ["b"])],
)
def test_the_warmup_backward_gives_no_gradient_to_unreached_outputs(unreached, reached):
    # The captured backward gets no incoming gradient for an unreached output; the
    # warmup's backward must do that same work, not more (its peak sizes a fresh pool).
    log: list = []
    plan = canonicalize((_Outputs(log),), ((torch.randn(2, 4, requires_grad=True),),))
    run_warmup(plan, 2, allow_unused_input=False, unreached=unreached)
    assert sorted(log) == sorted(reached * 2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["grad", "nograd", "value"]), max_size=8),
    st.frozensets(st.integers(0, 9), max_size=5),
)
def test_differentiable_outputs_are_the_tensors_that_need_grad_less_the_unreached(kinds, unreached):
    from cudagraphs.core.warmup import differentiable_outputs

    leaves = [
        torch.zeros(1, requires_grad=True)
        if k == "grad"
        else torch.zeros(1)
        if k == "nograd"
        else 3
        for k in kinds
    ]
    output = {"out": leaves}
    # Reference: number the tensor leaves, keep those that need grad and are reached.
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    want = [t for i, t in enumerate(tensors) if t.requires_grad and i not in unreached]
    got = differentiable_outputs(output, unreached)
    assert [id(t) for t in got] == [id(t) for t in want]


def test_the_static_buffers_of_captured_entries_are_inputs_outputs_and_their_gradients(
    monkeypatch,
):
    from cudagraphs.memory import tensor_bytes

    # Two layers 4 -> 4 on a (3, 4) float32 input that requires grad: per entry a
    # static input, an output, its incoming gradient and the input's gradient, 48
    # bytes each; the layers' weights and their gradients are not static buffers.
    layers = (nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    plan = canonicalize(layers, ((x,), (x,)))
    run_warmup(plan, 1, allow_unused_input=False)
    StandInCapture().install(monkeypatch)
    graphs = capture_plan(plan, cpu_options())
    for g in graphs:
        got = g.static_tensors()
        assert len(got) == 4 and tensor_bytes(got) == 4 * 48
        params = {p.untyped_storage().data_ptr() for p in g.params}
        assert not params & {t.untyped_storage().data_ptr() for t in got}
    assert tensor_bytes(t for g in graphs for t in g.static_tensors()) == 2 * 4 * 48


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_a_forward_only_capture_from_samples_that_require_grad_captures_no_gradient(
    monkeypatch, how
):
    # Eval mode, or grad disabled, with samples made requires_grad=True (copied from
    # training code): no buffer requires grad (a call's staging copy into one would
    # fail), and a call whose input requires grad is the uncaptured-gradient case,
    # never a replay whose output silently carries no gradient path (pytorch#124582).
    layer = nn.Linear(4, 4)
    if how == "eval":
        layer.eval()
    sample = torch.randn(2, 4, requires_grad=True)
    with torch.set_grad_enabled(how != "no_grad"):
        plan = canonicalize((layer,), ((sample,),))
        assert not plan.training
        run_warmup(plan, 1, allow_unused_input=False)
        StandInCapture().install(monkeypatch)
        (graphs,) = capture_plan(plan, cpu_options())
    assert graphs.bwd_graph is None
    assert not any(t.requires_grad for t in graphs.static_inputs)
    assert [rg for _, _, rg in graphs.input_meta] == [False]
    x = torch.randn(2, 4, requires_grad=True)
    missing = {m.path for m in graphs.gradients_not_captured([x])}
    # The input, beside the parameters that require grad without a backward graph.
    assert missing == {"args[0]", "weight", "bias"}
    assert {m.path for m in graphs.gradients_not_captured([x.detach()])} == {"weight", "bias"}


def test_a_training_capture_records_the_parameters_frozen_at_capture(monkeypatch):
    layer = nn.Linear(4, 4)
    layer.bias.requires_grad_(False)
    plan = canonicalize((layer,), ((torch.randn(2, 4, requires_grad=True),),))
    assert plan.training
    run_warmup(plan, 1, allow_unused_input=False)
    StandInCapture().install(monkeypatch)
    (graphs,) = capture_plan(plan, cpu_options())
    assert [n for n, _ in graphs.frozen_params] == ["bias"]
    assert graphs.gradients_not_captured([torch.randn(2, 4, requires_grad=True)]) == []
    layer.bias.requires_grad_(True)
    (unfrozen,) = graphs.gradients_not_captured([torch.randn(2, 4, requires_grad=True)])
    assert unfrozen.path == "bias" and "frozen at capture" in unfrozen.field


def test_a_forward_that_writes_into_its_argument_is_refused_at_the_warmup():
    # A replay writes into the graph's own copy of the argument: the caller's tensor
    # would silently keep its old value.
    def accumulate(x, acc):
        acc.add_(x)
        return acc * 2

    plan = canonicalize(accumulate, (torch.ones(3), torch.zeros(3)))
    with pytest.raises(CudaGraphsValueError, match=r"writes into args\[1\] in place"):
        run_warmup(plan, 1, allow_unused_input=False)
    # Reading its arguments only: fine.
    plan = canonicalize(lambda x, acc: acc + x, (torch.ones(3), torch.zeros(3)))
    run_warmup(plan, 1, allow_unused_input=False)


def test_a_function_that_uses_a_weight_it_does_not_take_is_refused_at_the_warmup():
    # Its gradient would be missing: the backward graph computes gradients for the
    # call's arguments and the callable's parameters only.
    lin = nn.Linear(4, 4)

    def closure(x):
        return lin(x).relu()

    plan = canonicalize(closure, (torch.randn(2, 4, requires_grad=True),))
    with pytest.raises(CudaGraphsValueError, match=r"depend on 2 tensor\(s\).*\(4, 4\)"):
        run_warmup(plan, 1, allow_unused_input=False)
    # Wrapped as a module (its parameters), or frozen: fine.
    plan = canonicalize(nn.Sequential(lin, nn.ReLU()), (torch.randn(2, 4, requires_grad=True),))
    run_warmup(plan, 1, allow_unused_input=False)
    lin.requires_grad_(False)
    plan = canonicalize(closure, (torch.randn(2, 4, requires_grad=True),))
    run_warmup(plan, 1, allow_unused_input=False)
