"""compile_stacked on the CPU: the pass's backward rewrites (input and weight
gradients of a projection group as one GEMM each) against a reference of which
members merge, and against running the graph; a compiled HF model trained through
compile_stacked like the plain compile, with the GEMMs it removes counted; a weight
moved since is refused by name, and the next good call works; bad options refused."""

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import fx, nn

import cudagraphs
from cudagraphs.errors import CudaGraphsStateError, CudaGraphsTypeError, CudaGraphsValueError
from cudagraphs.stacking import gemms, stack_graph
from helpers.hf_models import tiny, tiny_arch

aten = torch.ops.aten
M, WIDTH = 6, 4


def _builders(graph, values):
    """``placeholder(name, value)`` and ``node(target, *args)`` adding to ``graph``,
    each node's meta value real (the inputs' recorded in ``values``)."""

    def placeholder(name, value):
        n = graph.placeholder(name)
        n.meta["val"] = values[name] = value
        return n

    def node(target, *args):
        n = graph.call_function(target, args)
        n.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
        return n

    return placeholder, node


def _buffer(intervals):
    """The buffer whose rows ``intervals`` are (as many rows as the last ends at)."""
    torch.manual_seed(0)
    return torch.randn(max(stop for _, stop in intervals), WIDTH, dtype=torch.float64)


# ---- the backward rewrites, against a reference --------------------------------------
def _backward_graph(intervals, summed, doubled, with_base):
    """A post-grad-like backward: per member ``i`` (rows ``intervals[i]`` of one
    buffer, a graph input of its own), its input gradient ``G_i @ W_i`` (through two
    transposes where ``doubled[i]``) and weight gradient ``G_i.T @ x``. The input
    gradients of ``summed`` are added into one sum (each reshaped first, as a linear's
    are); the others are outputs of their own. Meta values are real tensors, the
    members real views of the buffer."""
    buffer, graph, values = _buffer(intervals), fx.Graph(), {}
    placeholder, node = _builders(graph, values)

    if with_base:
        placeholder("whole", buffer)
    x = placeholder("x", torch.randn(M, WIDTH, dtype=torch.float64))
    # Graph inputs first, as in every graph inductor passes on.
    weights = [placeholder(f"w{i}", buffer[a:b]) for i, (a, b) in enumerate(intervals)]
    grads = [
        placeholder(f"g{i}", torch.randn(M, b - a, dtype=torch.float64))
        for i, (a, b) in enumerate(intervals)
    ]
    total, alone, weight_grads = None, [], []
    for i, (w, g) in enumerate(zip(weights, grads)):
        operand = w
        if doubled[i]:
            operand = node(aten.permute.default, node(aten.permute.default, w, [1, 0]), [1, 0])
        dx = node(aten.mm.default, g, operand)
        weight_grads.append(node(aten.mm.default, node(aten.permute.default, g, [1, 0]), x))
        if i in summed:
            dx = node(aten.reshape.default, dx, [1, M, WIDTH])
            total = dx if total is None else node(aten.add.Tensor, total, dx)
        else:
            alone.append(dx)
    graph.output((total, *alone, *weight_grads))
    return graph, values


def _reference_removed(intervals, summed, with_base):
    """Input gradients: members sorted by rows, split where one does not start at the
    last one's end and where one is not summed; each part of n >= 2 summed members is
    one GEMM (n - 1 fewer), none without a graph input at the buffer's start. Weight
    gradients: all share ``x``, so all become one GEMM (len - 1 fewer), whatever
    merged."""
    dx = 0
    if with_base or any(start == 0 for start, _ in intervals):
        order = sorted(range(len(intervals)), key=lambda i: intervals[i][0])
        part, end = 0, None
        for i in order:
            start, stop = intervals[i]
            if i in summed and part and start == end:
                part += 1
            else:
                dx += max(part - 1, 0)
                part = 1 if i in summed else 0
            end = stop
        dx += max(part - 1, 0)
    return dx + len(intervals) - 1


def _gemms(graph):
    return sum(n.target is aten.mm.default for n in graph.nodes)


def _assert_pass_removes(graph, values, removed, tol=1e-12):
    """The pass removes exactly ``removed`` GEMMs, leaves a valid graph, and every
    output is what it was (``None`` outputs too)."""
    want = fx.GraphModule(nn.Module(), graph)(**values)
    before = _gemms(graph)
    assert stack_graph(graph) == removed
    graph.lint()
    assert _gemms(graph) == before - removed
    got = fx.GraphModule(nn.Module(), graph)(**values)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@st.composite
def _member_rows(draw):
    """Up to seven members' row intervals of one buffer, disjoint, in any order, some
    adjacent and some with gaps between them (at least one)."""
    cuts = draw(st.lists(st.integers(0, 24), min_size=2, max_size=8))
    keep = draw(st.lists(st.booleans(), min_size=7, max_size=7))
    order = draw(st.permutations(range(7)))
    bounds = sorted(set(cuts))
    pieces = list(zip(bounds, bounds[1:]))
    intervals = [pieces[i] for i in order if i < len(pieces) and keep[i]]
    assume(intervals)
    return intervals


@settings(max_examples=200, deadline=None)
@given(
    intervals=_member_rows(),
    summed=st.sets(st.integers(0, 6)),
    doubled=st.lists(st.booleans(), min_size=7, max_size=7),
    with_base=st.booleans(),
)
def test_the_backward_rewrites_merge_exactly_what_the_reference_says(
    intervals, summed, doubled, with_base
):
    summed = {i for i in summed if i < len(intervals)}
    graph, values = _backward_graph(intervals, summed, doubled, with_base)
    _assert_pass_removes(graph, values, _reference_removed(intervals, summed, with_base))


def test_a_member_whose_gradient_feeds_another_is_not_merged():
    # G_1 computed from W_0's input gradient: one GEMM for both would need G_1 first.
    graph, values = fx.Graph(), {}
    placeholder, node = _builders(graph, values)
    buffer = torch.randn(8, WIDTH, dtype=torch.float64)

    w0, w1 = placeholder("w0", buffer[:4]), placeholder("w1", buffer[4:])
    g0 = placeholder("g0", torch.randn(4, 4, dtype=torch.float64))
    dx0 = node(aten.mm.default, g0, w0)
    g1 = node(aten.mul.Tensor, dx0, 2.0)
    dx1 = node(aten.mm.default, g1, w1)
    graph.output((node(aten.add.Tensor, dx0, dx1),))
    # dx0 has two users (the add and g1): not summed alone.
    assert stack_graph(graph) == 0 and _gemms(graph) == 2


# ---- compile_stacked ----------------------------------------------------------------
@pytest.fixture
def removed(monkeypatch):
    import torch._inductor.config as inductor

    made = []
    real = gemms.stack_graph
    monkeypatch.setattr(gemms, "stack_graph", lambda g: made.append(real(g)) or made[-1])
    # The pass runs only when inductor compiles: a cached graph skips it.
    monkeypatch.setattr(inductor, "force_disable_caches", True)
    return made


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_stacked_compile_trains_like_the_plain_compile_with_fewer_gemms(removed):
    pytest.importorskip("transformers")
    model = tiny("llama").train()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before: the same objects
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    compiled = cudagraphs.compile_stacked(model)
    plain_compiled = torch.compile(plain)
    layers = model.config.num_hidden_layers
    assert len(compiled.groups.names) == 2 * layers  # q/k/v/o and gate/up, each layer
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        loss = _loss(compiled, ids)
        loss.backward()
        plain_loss = _loss(plain_compiled, ids)
        plain_loss.backward()
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
        if step == 0:
            # Forward: q/k/v 2 fewer, gate/up 1 fewer a layer; the backward twice that.
            assert sorted(removed) == [3 * layers, 6 * layers], removed
            for p, q in zip(model.parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        opt.step()
        plain_opt.step()
        opt.zero_grad()
        plain_opt.zero_grad()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert not compiled.groups.moved()


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_family_with_biased_projections_trains_like_the_plain_compile(removed):
    # Qwen2: q/k/v with biases, o_proj without (a group of three), two layers. The
    # 14-family probe (benchmarks/probes/stacked_train_families_cpu.py, its JSON in
    # benchmarks/results) covers the others; each costs about a minute here.
    model = tiny_arch("qwen2", num_hidden_layers=2, vocab_size=128).train()
    plain = copy.deepcopy(model)
    compiled, plain_compiled = cudagraphs.compile_stacked(model), torch.compile(plain)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, plain_loss = _loss(compiled, ids), _loss(plain_compiled, ids)
    loss.backward()
    plain_loss.backward()
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
    assert sorted(removed) == [6, 12], removed  # q/k/v and gate/up: 3 and 6 a layer
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters())]
    largest = max(b.abs().max().item() for _, b in grads)
    for a, b in grads:
        # A key projection's bias gradient is zero in exact arithmetic: rounding alone.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * largest)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_moved_weight_is_refused_by_name_and_a_new_compile_works():
    pytest.importorskip("transformers")
    model = tiny("llama").eval()
    compiled = cudagraphs.compile_stacked(model)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids).logits
    torch.testing.assert_close(compiled(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
    up = model.model.layers[1].mlp.up_proj
    up.weight.data = up.weight.data.clone()  # its own memory now: not its group's rows
    with pytest.raises(CudaGraphsStateError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        compiled(input_ids=ids)
    again = cudagraphs.compile_stacked(model)  # lays that group back to back anew
    torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
    again.unstack()
    with pytest.raises(CudaGraphsStateError, match="compile_stacked"):
        again(input_ids=ids)


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(CudaGraphsTypeError, match="nn.Module"):
        cudagraphs.compile_stacked(lambda x: x)
    with pytest.raises(CudaGraphsValueError, match="inductor"):
        cudagraphs.compile_stacked(nn.Linear(2, 2), backend="eager")
    with pytest.raises(CudaGraphsValueError, match="post_grad_custom_pre_pass"):
        cudagraphs.compile_stacked(nn.Linear(2, 2), options={"post_grad_custom_pre_pass": object()})
    # The wrapper passes the module's attributes through, as torch.compile's does.
    linear = nn.Linear(2, 3)
    wrapped = cudagraphs.compile_stacked(linear)
    assert wrapped.out_features == 3 and list(wrapped.parameters()) == list(linear.parameters())
    assert wrapped.eval() is linear and not linear.training
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute  # noqa: B018
    # Nothing was stacked or compiled by a refused call.
    linear = nn.Linear(2, 2)
    assert (
        repr(cudagraphs.compile_stacked(linear)) == "StackedCompiled(Linear, 0 projection groups)"
    )


def test_graph_stack_refuses_the_wrapper_with_the_fix():
    # The wrapper is no nn.Module (its state_dict and hooks are the module's): graph_stack
    # names it and says where it goes instead.
    wrapped = cudagraphs.compile_stacked(nn.Linear(2, 2))
    with pytest.raises(
        CudaGraphsTypeError, match=r"layers\[0\] \(StackedCompiled\).*graph_train_step"
    ):
        cudagraphs.graph_stack([wrapped], (torch.randn(1, 2),))
    with pytest.raises(CudaGraphsTypeError, match="Wrap functions in a module"):
        cudagraphs.graph_stack([nn.Linear(2, 2), torch.tanh], (torch.randn(1, 2),))


# ---- the forward rewrite over graph inputs, against a reference ----------------------
def _forward_graph(intervals, other_input, with_base, base_dtype=torch.float64, cast=False):
    """A training forward: per member a weight that is a graph input of its own (a
    real view of one buffer) and ``x @ W_i.T``, over ``x`` (or ``y`` for
    ``other_input``); ``with_base`` adds an input viewing the whole buffer (as
    ``base_dtype``); ``cast``: each weight cast to float32 first, as autocast does."""
    buffer, graph, values = _buffer(intervals), fx.Graph(), {}
    placeholder, node = _builders(graph, values)

    if with_base:
        placeholder("whole", buffer.view(base_dtype) if base_dtype != buffer.dtype else buffer)
    dtype = torch.float32 if cast else torch.float64
    x = placeholder("x", torch.randn(M, WIDTH, dtype=dtype))
    y = placeholder("y", torch.randn(M, WIDTH, dtype=dtype))
    # Graph inputs first, as in every graph inductor passes on.
    weights = [placeholder(f"w{i}", buffer[a:b]) for i, (a, b) in enumerate(intervals)]
    outs = []
    for i, w in enumerate(weights):
        if cast:
            w = node(torch.ops.prims.convert_element_type.default, w, torch.float32)
        t = node(aten.permute.default, w, [1, 0])
        outs.append(node(aten.mm.default, y if i in other_input else x, t))
    graph.output(tuple(outs))
    return graph, values


def _reference_forward_runs(intervals, other_input, with_base):
    """Per input: members sorted by rows, split where one does not start at the last
    one's end; the runs of two or more (none without a graph input at the buffer's
    start). Each run is one GEMM (n - 1 fewer)."""
    if not (with_base or any(start == 0 for start, _ in intervals)):
        return []
    runs = []
    for chosen in (
        sorted(iv for i, iv in enumerate(intervals) if i not in other_input),
        sorted(iv for i, iv in enumerate(intervals) if i in other_input),
    ):
        run = chosen[:1]
        for before, after in zip(chosen, chosen[1:]):
            if after[0] == before[1]:
                run.append(after)
                continue
            runs.append(run)
            run = [after]
        runs.append(run)
    return [r for r in runs if len(r) > 1]


def _casts_of_inputs(graph):
    return sum(
        n.target is torch.ops.prims.convert_element_type.default and n.args[0].op == "placeholder"
        for n in graph.nodes
    )


@settings(max_examples=150, deadline=None)
@given(
    intervals=_member_rows(),
    other=st.sets(st.integers(0, 6), max_size=3),
    with_base=st.booleans(),
    cast=st.booleans(),
)
def test_the_forward_rewrite_over_graph_inputs_merges_exactly_the_adjacent_runs(
    intervals, other, with_base, cast
):
    other = {i for i in other if i < len(intervals)}
    graph, values = _forward_graph(intervals, other, with_base, cast=cast)
    runs = _reference_forward_runs(intervals, other, with_base)
    removed = sum(len(r) - 1 for r in runs)
    _assert_pass_removes(graph, values, removed, tol=1e-5 if cast else 1e-12)
    # Cast: a run's members read rows of one cast of the run; the others keep theirs.
    assert _casts_of_inputs(graph) == (len(intervals) - sum(map(len, runs)) if cast else 0)


def test_a_base_of_another_dtype_is_no_base():
    # The buffer's start viewed as another dtype: as_strided's offsets would count
    # its elements, so the group is left alone.
    intervals = [(2, 4), (4, 8)]
    graph, _ = _forward_graph(intervals, set(), with_base=True, base_dtype=torch.int64)
    assert stack_graph(graph) == 0 and _gemms(graph) == 2


@pytest.mark.usefixtures("fresh_dynamo")
def test_under_autocast_a_group_is_one_cast_one_gemm_and_one_weight_gradient_gemm(removed):
    # float32 parameters under autocast: each weight is cast to bfloat16 before its
    # GEMM, and the backward reads those saved casts, not the group's rows. The
    # forward still merges (and casts each group once); the backward merges the
    # weight gradients, which share their x.
    pytest.importorskip("transformers")
    model = tiny("llama").train()
    plain = copy.deepcopy(model)
    compiled, plain_compiled = cudagraphs.compile_stacked(model), torch.compile(plain)
    casts = []

    def counting(graph):
        before = _casts_of_inputs(graph)
        out = real(graph)
        casts.append((before, _casts_of_inputs(graph)))
        return out

    real = gemms.stack_graph
    gemms.stack_graph = counting
    try:
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        losses = []
        for m in (compiled, plain_compiled):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(_loss(m, ids))
            losses[-1].backward()
    finally:
        gemms.stack_graph = real
    layers = model.config.num_hidden_layers
    assert removed == [3 * layers, 3 * layers], removed
    # Per layer q/k/v (and o, alone), gate/up, down: 7 casts of parameters, now o and
    # down alone (the groups' casts are of their unions); the lm_head's too.
    assert casts[0] == (7 * layers + 1, 2 * layers + 1), casts
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=1e-2)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3)


@settings(max_examples=100, deadline=None)
@given(
    edges=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=20),
    moves=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=6),
)
def test_sorting_puts_every_node_after_its_inputs_and_keeps_a_valid_order(edges, moves):
    # A DAG of ten nodes (edges from lower to higher), then some nodes moved before
    # others: the sort must make it valid, and leave an order already valid as it is.
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = []
    for i in range(10):
        deps = sorted({a for a, b in edges if b == i and a < i})
        nodes.append(graph.call_function(torch.add, (x, *[nodes[d] for d in deps])))
    graph.output(tuple(nodes))
    valid = list(graph.nodes)
    gemms._sort(graph)
    assert list(graph.nodes) == valid
    for a, b in moves:
        nodes[b].prepend(nodes[a])
    gemms._sort(graph)
    graph.lint()
    assert list(graph.nodes)[0] is x and list(graph.nodes)[-1].op == "output"


def test_moved_names_exactly_the_weights_no_longer_where_they_were_laid():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 3)

    pair = Pair()
    groups = cudagraphs.stacking.stack_projections(pair)
    assert groups.names == [("a", "b", "c")] and groups.moved() == []
    with torch.no_grad():
        pair.b.weight.copy_(torch.ones(2, 4))  # in place: still its rows
    assert groups.moved() == []
    pair.a.bias.data = pair.a.bias.data.clone()  # re-pointed
    pair.c.weight = nn.Parameter(pair.c.weight.detach().clone())  # a new Parameter
    assert groups.moved() == ["a.bias", "c.weight"]
