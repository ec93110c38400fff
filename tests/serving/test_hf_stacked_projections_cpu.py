"""Stacked projections on the CPU: sibling linears laid back to back in one buffer (the
same parameters, the same values), the inductor pass that makes their GEMMs one
(checked against a reference of adjacent runs, and against running the graph), and a
generator compiled through inductor whose decode step makes them one and keeps HF's
tokens."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

from cudagraphs.errors import CudaGraphsStateError, CudaGraphsTypeError, CudaGraphsValueError
from helpers.hf_models import CONFIGS, tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from cudagraphs.stacking import (  # noqa: E402
    check_stack_projections,
    stack_graph,
    stack_projections,
    with_stacked_projections,
)
from helpers.hf_generate import (  # noqa: E402
    EOS,
    PAD,
    assert_serves_hf_tokens,
    captured,
    hf_generate,
    prompts,
)

NEW = 6
aten = torch.ops.aten


# ---- stacking the weights ------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, tied: nn.Linear | None = None):
        super().__init__()
        self.q = nn.Linear(8, 8, bias=False)
        self.k = nn.Linear(8, 4, bias=False)
        self.v = nn.Linear(8, 4, bias=False)
        self.norm = nn.LayerNorm(8)  # ends the run: o is alone
        self.o = nn.Linear(8, 8, bias=False)
        self.gate = nn.Linear(8, 16)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)  # another input width: alone
        self.tied = tied if tied is not None else nn.Linear(8, 3, bias=False)


def test_sibling_linears_share_one_buffer_as_the_same_parameters_and_values():
    torch.manual_seed(0)
    block = Block()
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    objects = {n: p for n, p in block.named_parameters()}
    stacked = stack_projections(block)
    # q, k, v one group (the norm ends it); the biased gate and up another; o, down
    # (another width) and the last head (after down) alone.
    assert stacked.names == [("q", "k", "v"), ("gate", "up")]
    assert dict(block.named_parameters()) == objects, "the same Parameter objects"
    for name, p in block.named_parameters():
        assert torch.equal(p, before[name]), name
    qkv, mlp = stacked.groups
    assert block.q.weight.data_ptr() == qkv.weights.data_ptr()
    assert block.k.weight.storage_offset() == 8 * 8
    assert block.v.weight.storage_offset() == 12 * 8
    assert mlp.biases is not None and block.up.bias.storage_offset() == 16
    # An in-place update of a parameter is the buffer's.
    with torch.no_grad():
        block.k.weight.add_(1)
    assert torch.equal(qkv.weights[8:12], block.k.weight)
    # Stacked again (a second generator): the same memory, so that the first one's
    # graphs still read the weights.
    pointers = [p.data_ptr() for p in block.parameters()]
    again = stack_projections(block)
    assert again.names == stacked.names
    assert [p.data_ptr() for p in block.parameters()] == pointers
    assert again.groups[0].weights.data_ptr() == qkv.weights.data_ptr()
    assert again.groups[0].weights.shape == (16, 8)
    stacked.unstack()
    assert block.k.weight.storage_offset() == 0 and stacked.groups == ()
    assert torch.equal(block.k.weight, before["k.weight"] + 1)


def test_tied_and_non_contiguous_weights_stay_where_they_are():
    outer = nn.Module()
    outer.block = Block()
    outer.embed = nn.Embedding(4, 8)
    outer.block.v.weight = nn.Parameter(torch.randn(8, 4).t())  # not contiguous
    outer.block.up.weight = outer.embed.weight  # tied: 4 x 8, one Parameter, two names
    outer.block.up.bias = nn.Parameter(torch.zeros(4))
    tied = outer.embed.weight.data_ptr()
    stacked = stack_projections(outer)
    assert stacked.names == [("block.q", "block.k")]
    assert outer.embed.weight.data_ptr() == tied
    assert outer.block.v.weight.stride() == (1, 4)


def test_reading_swaps_the_forwards_in_and_back_out_an_error_included():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 8)
    want = block.k(x)
    stacked = stack_projections(block)
    with pytest.raises(RuntimeError, match="inside"), stacked.reading():
        assert "forward" in block.k.__dict__
        torch.testing.assert_close(block.k(x), want)
        raise RuntimeError("inside")
    assert "forward" not in block.k.__dict__
    torch.testing.assert_close(block.k(x), want)


_children = st.lists(
    st.one_of(
        st.tuples(st.just("linear"), st.sampled_from([4, 8]), st.booleans()),
        st.tuples(st.just("norm"), st.just(0), st.just(False)),
    ),
    max_size=9,
)


def _reference_groups(children):
    """Consecutive linears of one input width and bias-or-none, runs of two or more."""
    groups, run = [], []
    for i, (kind, width, bias) in enumerate([*children, ("end", 0, False)]):
        if kind == "linear" and run and (width, bias) == run[0][1:]:
            run.append((i, width, bias))
            continue
        if len(run) > 1:
            groups.append(tuple(f"c{j}" for j, _, _ in run))
        run = [(i, width, bias)] if kind == "linear" else []
    return groups


@settings(max_examples=200, deadline=None)
@given(children=_children)
def test_the_groups_are_the_runs_of_alike_siblings(children):
    torch.manual_seed(0)
    parent = nn.Module()
    for i, (kind, width, bias) in enumerate(children):
        child = nn.Linear(width, 3 + i, bias=bias) if kind == "linear" else nn.LayerNorm(4)
        parent.add_module(f"c{i}", child)
    before = {n: p.detach().clone() for n, p in parent.named_parameters()}
    stacked = stack_projections(parent)
    assert stacked.names == _reference_groups(children)
    for name, p in parent.named_parameters():
        assert torch.equal(p, before[name]), name
    for group in stacked.groups:
        rows = 0
        for module in group.modules:
            assert module.weight.untyped_storage().data_ptr() == group.weights.data_ptr()
            assert module.weight.storage_offset() == rows * module.weight.shape[1]
            rows += module.weight.shape[0]
        assert group.weights.shape[0] == rows


# ---- the pass, against a reference ---------------------------------------------------
def _graph(intervals, rows=32, width=4, biased=False, other_input=()):
    """A post-grad-like graph: one GEMM per interval of a buffer's rows, over one
    input (the ones in ``other_input`` over a second), every result an output; meta
    values real tensors."""
    torch.manual_seed(0)
    graph = fx.Graph()
    values = {}

    def node(target, *args):
        n = graph.call_function(target, args)
        n.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
        return n

    def placeholder(name, value):
        n = graph.placeholder(name)
        n.meta["val"] = values[name] = value
        return n

    x = placeholder("x", torch.randn(3, 2, width, dtype=torch.float64))
    y = placeholder("y", torch.randn(3, 2, width, dtype=torch.float64))
    w = placeholder("w", torch.randn(rows, width, dtype=torch.float64))
    b = placeholder("b", torch.randn(rows, dtype=torch.float64)) if biased else None
    outs = []
    for i, (start, stop) in enumerate(intervals):
        # Each linear reshapes its input itself, as HF's do.
        flat = node(aten.reshape.default, y if i in other_input else x, [6, width])
        t = node(aten.permute.default, node(aten.slice.Tensor, w, 0, start, stop), [1, 0])
        if biased:
            outs.append(
                node(aten.addmm.default, node(aten.slice.Tensor, b, 0, start, stop), flat, t)
            )
        else:
            outs.append(node(aten.mm.default, flat, t))
    graph.output(tuple(outs))
    return graph, values


def _gemms(graph):
    return sum(n.target in (aten.mm.default, aten.addmm.default) for n in graph.nodes)


def _reference_removed(intervals, other_input=()):
    """Per input: sort the intervals, split where one does not start at the last one's
    end; each run of n >= 2 becomes one GEMM (n - 1 fewer)."""
    removed = 0
    for chosen in (
        [iv for i, iv in enumerate(intervals) if i not in other_input],
        [iv for i, iv in enumerate(intervals) if i in other_input],
    ):
        chosen = sorted(chosen)
        length = 1
        for before, after in zip(chosen, chosen[1:]):
            if after[0] == before[1]:
                length += 1
                continue
            removed += length - 1
            length = 1
        removed += length - 1 if chosen else 0
    return removed


def _disjoint_intervals(draw_cuts, order):
    cuts = sorted(set(draw_cuts))
    pieces = list(zip(cuts, cuts[1:]))
    return [pieces[i] for i in order if i < len(pieces)]


@settings(max_examples=150, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 32), min_size=2, max_size=9),
    keep=st.lists(st.booleans(), min_size=8, max_size=8),
    order=st.permutations(range(8)),
    biased=st.booleans(),
    other=st.sets(st.integers(0, 7), max_size=3),
)
def test_the_pass_merges_exactly_the_adjacent_runs_and_keeps_every_output(
    cuts, keep, order, biased, other
):
    pieces = _disjoint_intervals(cuts, range(8))
    intervals = [pieces[i] for i in order if i < len(pieces) and keep[i]]
    if not intervals:
        return
    other_input = {i for i in other if i < len(intervals)}
    graph, values = _graph(intervals, biased=biased, other_input=other_input)
    want = fx.GraphModule(nn.Module(), graph)(**values)
    gemms = _gemms(graph)
    removed = _reference_removed(intervals, other_input)
    assert stack_graph(graph) == removed
    graph.lint()
    got = fx.GraphModule(nn.Module(), graph)(**values)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # Every run of n GEMMs became one.
    assert _gemms(graph) == gemms - removed


def test_open_ended_slices_merge_as_their_rows():
    # torch writes buffer[12:] as slice(buffer, 0, 12, 2**63 - 1), and buffer[:8] may
    # come without a start.
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.randn(2, 4, dtype=torch.float64)
    w = graph.placeholder("w")
    w.meta["val"] = torch.randn(16, 4, dtype=torch.float64)
    outs = []
    for args in ((w, 0, None, 8), (w, 0, 8, 12), (w, 0, 12, 2**63 - 1)):
        s = graph.call_function(aten.slice.Tensor, args)
        s.meta["val"] = aten.slice.Tensor(*(w.meta["val"], *args[1:]))
        p = graph.call_function(aten.permute.default, (s, [1, 0]))
        p.meta["val"] = s.meta["val"].t()
        outs.append(graph.call_function(aten.mm.default, (x, p)))
        outs[-1].meta["val"] = x.meta["val"] @ p.meta["val"]
    graph.output(tuple(outs))
    values = {"x": x.meta["val"], "w": w.meta["val"]}
    want = fx.GraphModule(nn.Module(), graph)(**values)
    assert stack_graph(graph) == 2 and _gemms(graph) == 1
    got = fx.GraphModule(nn.Module(), graph)(**values)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_pass_leaves_gemms_it_cannot_merge():
    # Not adjacent (a gap), a stepped slice, a column slice: untouched.
    graph, _ = _graph([(0, 4), (6, 8)])
    assert stack_graph(graph) == 0 and _gemms(graph) == 2
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.randn(2, 4)
    w = graph.placeholder("w")
    w.meta["val"] = torch.randn(8, 4)
    outs = []
    for args in ((w, 0, 0, 4, 2), (w, 1, 0, 2)):
        s = graph.call_function(aten.slice.Tensor, args)
        p = graph.call_function(aten.permute.default, (s, [1, 0]))
        outs.append(graph.call_function(aten.mm.default, (x, p)))
    graph.output(tuple(outs))
    assert stack_graph(graph) == 0 and _gemms(graph) == 2


# ---- the options ---------------------------------------------------------------------
def test_a_mode_becomes_its_options_beside_the_pass():
    out = with_stacked_projections({"mode": "max-autotune-no-cudagraphs", "fullgraph": True})
    assert "mode" not in out and out["fullgraph"] is True
    assert out["options"]["max_autotune"] is True
    assert type(out["options"]["post_grad_custom_pre_pass"]).__name__ == "StackedProjections"
    assert out["options"]["post_grad_custom_pre_pass"].uuid()
    mine = {"options": {"epilogue_fusion": False}}
    assert with_stacked_projections(mine)["options"]["epilogue_fusion"] is False
    assert mine == {"options": {"epilogue_fusion": False}}, "the caller's dict unchanged"


@pytest.mark.parametrize(
    "options, want",
    [
        (None, False),
        ({}, True),
        ({"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}, True),
        ({"backend": "eager"}, False),
        ({"options": {"post_grad_custom_pre_pass": lambda g: None}}, False),
    ],
)
def test_stacking_is_on_by_default_where_an_inductor_pass_can_be_added(options, want):
    assert check_stack_projections(None, options) is want
    assert check_stack_projections(False, options) is False
    if want:
        assert check_stack_projections(True, options) is True
    else:
        with pytest.raises(CudaGraphsValueError, match="stack_projections=True needs"):
            check_stack_projections(True, options)


def test_stack_projections_must_be_a_bool_or_none():
    with pytest.raises(CudaGraphsTypeError, match="stack_projections must be True, False"):
        GraphedGenerator(tiny("llama"), (1, 2), max_cache_len=16, stack_projections="yes")


# ---- the generator -------------------------------------------------------------------
def _llama(**extra):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", **{**CONFIGS["llama"], "num_hidden_layers": 3, **extra}
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


class Spy:
    """Counts the GEMMs the pass removed, the pass run as the generator sets it."""

    def __init__(self, monkeypatch):
        from cudagraphs.stacking import gemms

        self.made = []
        real = gemms.stack_graph

        def spy(graph):
            self.made.append(real(graph))
            return self.made[-1]

        monkeypatch.setattr(gemms, "stack_graph", spy)


@pytest.fixture
def no_fx_cache():
    # The pass runs only when inductor compiles: a cached graph skips it.
    import torch._inductor.config as inductor

    with inductor.patch(force_disable_caches=True):
        yield


@pytest.mark.parametrize(
    "extra, regions",
    [({}, 3), ({"attention_bias": True, "mlp_bias": True}, 0)],
    ids=["layer_regions", "biased_whole_model"],
)
def test_a_compiled_decode_merges_the_groups_and_keeps_hfs_tokens(
    extra, regions, fresh_dynamo, no_fx_cache, monkeypatch
):
    model = _llama(**extra)
    spy = Spy(monkeypatch)
    gen = captured(model, (1, 2, 4), compile_options={"fullgraph": True}, require_all_buckets=True)
    # One compile for every bucket, the one-row bucket too: the merged result's parts
    # are viewed without the batch's size mattering.
    frames = {b.rows: t.compiled_frames for b, t in gen.runner.capture_times.items()}
    assert frames == {4: 1, 2: 0, 1: 0}, frames
    stats = gen.stats()
    assert stats["compile_regions"] == regions
    assert stats["stacked_projections"] == 6  # q/k/v/o and gate/up, in each of 3 layers
    # One region body holds one layer's two groups (q/k/v and gate/up: 3 GEMMs fewer);
    # the whole model all six (9 fewer).
    assert max(spy.made) == (3 if regions else 9), spy.made
    attn = model.model.layers[1].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.data_ptr()
    assert_serves_hf_tokens(gen, model, new=NEW)
    assert gen.stats()["replays"]["bucket(bs=4)"] > 0
    if not regions:
        return  # the rest is the same for both
    # An in-place update reaches the graphs (they read the buffers the weights are)...
    with torch.no_grad():
        attn.v_proj.weight.mul_(-1)
    ids, mask = prompts(3, seed=7)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    # ... and a weight given memory of its own is refused, naming it.
    gen.stacked.unstack()
    with pytest.raises(CudaGraphsStateError, match="q_proj.weight"):
        gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    # After close(), a capture again stacks anew and serves HF's tokens.
    gen.close()
    gen.capture(progress=False)
    assert gen.stats()["stacked_projections"] == 6
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))


def test_false_leaves_the_model_as_it_is(fresh_dynamo):
    model = _llama()
    gen = captured(model, (2,), compile_options={"backend": "eager"}, stack_projections=False)
    assert gen.stats()["stacked_projections"] == 0
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.storage_offset() == 0
    assert attn.k_proj.weight.untyped_storage().data_ptr() != attn.q_proj.weight.data_ptr()


def test_a_second_capture_without_close_is_refused_before_anything_moves():
    model = _llama()
    gen = captured(model, (2,))
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(CudaGraphsStateError, match="captured already; close"):
        gen.capture(progress=False)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    ids, mask = prompts(2, seed=2)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
