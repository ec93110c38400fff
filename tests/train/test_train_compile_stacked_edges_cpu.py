"""compile_stacked where a layout or a shape changes under it, on the CPU: sequence
lengths that make dynamo compile dynamic shapes, layers of one class compiled one by
one (laid out alike, and not), a grouped module replaced, unstacked twice, arguments
that share memory, a deep copy, and options torch.compile refuses; and which linears
stack_projections leaves alone (biases of two dtypes, a forward of a subclass's own,
a weight inside another's memory)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cudagraphs
from cudagraphs.errors import CudaGraphsStateError, CudaGraphsValueError
from cudagraphs.stacking import gemms, plan_projections, stack_projections


class _Attention(nn.Module):
    """q/k/v of one input (a group of three), and an output projection of their join."""

    def __init__(self, width=8):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, 4)
        self.v = nn.Linear(width, 4)
        self.out = nn.Linear(16, width)

    def forward(self, x):
        return self.out(torch.cat([self.q(x), self.k(x), self.v(x)], -1)).tanh()


@pytest.fixture
def removed(monkeypatch):
    """The GEMMs each run of the pass removed, in order (inductor's caches off: a
    cached graph skips the pass)."""
    import torch._inductor.config as inductor

    made = []
    real = gemms.stack_graph
    monkeypatch.setattr(gemms, "stack_graph", lambda g: made.append(real(g)) or made[-1])
    monkeypatch.setattr(inductor, "force_disable_caches", True)
    return made


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.usefixtures("fresh_dynamo")
def test_new_sequence_lengths_compile_dynamic_shapes_that_still_merge_and_train_alike(removed):
    # A second length makes dynamo compile the token count as a symbol; the pass keys
    # and builds its zeros from it rather than failing on a SymInt.
    torch.manual_seed(0)
    model = _Attention()
    plain = copy.deepcopy(model)
    compiled, plain_compiled = cudagraphs.compile_stacked(model), torch.compile(plain)
    for tokens in (5, 7, 9):
        # x's own gradient too: the input gradients' merge, zeros of the symbol's rows.
        x = torch.randn(2, tokens, 8, requires_grad=True)
        y = x.detach().clone().requires_grad_()
        compiled(x).square().sum().backward()
        plain_compiled(y).square().sum().backward()
        for a, b in zip([x.grad, *_grads(model)], [y.grad, *_grads(plain)]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        model.zero_grad()
        plain.zero_grad()
    # Static, then one dynamic compile for every later length; each merges q/k/v
    # forward (2 GEMMs), and input and weight gradients (2 + 2).
    assert removed == [2, 4, 2, 4], removed


@pytest.mark.usefixtures("fresh_dynamo")
def test_layers_of_one_class_share_a_compile_and_another_layout_gets_its_own(removed):
    torch.manual_seed(0)
    layers = [_Attention() for _ in range(10)]
    odd = _Attention()
    odd.tied_q = odd.q  # q under two names: tied, so only k and v form a group
    x = torch.randn(2, 3, 8)
    wrapped = [cudagraphs.compile_stacked(layer) for layer in layers]
    odd_wrapped = cudagraphs.compile_stacked(odd)
    assert odd_wrapped.groups.names == [("k", "v")]
    with torch.no_grad():
        for layer, w in [*zip(layers, wrapped), (odd, odd_wrapped)]:
            torch.testing.assert_close(w(x), layer(x), rtol=1e-5, atol=1e-6)
    # Ten layers laid out alike: one compile (the recompile limit is 8), q/k/v merged;
    # the odd layer's own compile merges k and v only.
    assert removed == [2, 1], removed


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_grouped_module_replaced_or_unstacked_twice_is_refused_and_a_new_compile_works():
    torch.manual_seed(0)
    model = _Attention()
    x = torch.randn(2, 3, 8)
    wrapped = cudagraphs.compile_stacked(model)
    with torch.no_grad():
        wrapped(x)
        model.k = nn.Linear(8, 4)  # memory of its own, which the compiled code never read
        assert wrapped.groups.moved() == ["k.weight", "k.bias"]
        with pytest.raises(CudaGraphsStateError, match=r"k\.weight, k\.bias"):
            wrapped(x)
        again = cudagraphs.compile_stacked(model)
        torch.testing.assert_close(again(x), model(x), rtol=1e-5, atol=1e-6)
        for _ in range(2):  # the second unstack finds no groups: still refused
            again.unstack()
            with pytest.raises(CudaGraphsStateError, match=r"q\.weight"):
                again(x)


@pytest.mark.usefixtures("fresh_dynamo")
def test_arguments_sharing_memory_are_refused_by_place_and_the_next_good_call_works():
    class Functional(nn.Module):
        def forward(self, x, w1, w2):
            return F.linear(x, w1), F.linear(x, w2)

    wrapped = cudagraphs.compile_stacked(Functional())
    x, weights = torch.randn(3, 8), torch.randn(8, 8)
    with pytest.raises(CudaGraphsValueError, match=r"args\[1\] and args\[2\] share one storage"):
        wrapped(x, weights[:4], weights[4:])
    with pytest.raises(CudaGraphsValueError, match=r"args\[1\] and kwargs\['w2'\]"):
        wrapped(x, weights[:4], w2=weights[4:])
    w1, w2 = torch.randn(4, 8), torch.randn(4, 8)
    got = wrapped(x, w1, w2)
    torch.testing.assert_close(got[0], F.linear(x, w1))
    torch.testing.assert_close(got[1], F.linear(x, w2))
    # One tensor passed twice, and integer ids sharing a storage, are no group's rows.
    torch.testing.assert_close(wrapped(x, w1, w1)[1], F.linear(x, w1))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_deep_copy_is_stacked_and_compiled_anew_and_both_run():
    torch.manual_seed(0)
    model = _Attention()
    wrapped = cudagraphs.compile_stacked(model, fullgraph=True)
    twin = copy.deepcopy(wrapped)
    assert twin.module is not model and twin.requested == {"fullgraph": True}
    assert twin.groups.names == wrapped.groups.names and not twin.groups.moved()
    assert twin.module.q.weight.data_ptr() != model.q.weight.data_ptr()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), wrapped(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wrapped(x), model(x), rtol=1e-5, atol=1e-6)


def test_options_torch_compile_refuses_are_typed_and_leave_the_module_as_it_was():
    model = _Attention()
    before = [p.data_ptr() for p in model.parameters()]
    for options in ({"options": {"no_such_option": 1}}, {"mode": "no-such-mode"}):
        with pytest.raises(CudaGraphsValueError, match="torch.compile refused"):
            cudagraphs.compile_stacked(model, **options)
        assert [p.data_ptr() for p in model.parameters()] == before
    assert len(cudagraphs.compile_stacked(model).groups.names) == 1


def test_linears_that_cannot_be_read_as_rows_of_one_gemm_are_left_alone():
    class Pair(nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a, self.b = a, b

    # Biases of two dtypes: one buffer would promote one of them.
    mixed = Pair(nn.Linear(4, 4), nn.Linear(4, 2))
    mixed.b.bias.data = mixed.b.bias.data.to(torch.bfloat16)
    assert plan_projections(mixed) == []

    # A subclass's own forward computes something else than its rows of the GEMM.
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert plan_projections(Pair(nn.Linear(4, 4), Doubled(4, 2))) == []

    # A weight inside another parameter's memory (tied, not at its start).
    inner = Pair(nn.Linear(4, 8), nn.Linear(4, 2))
    inner.view = nn.Parameter(inner.a.weight.data[4:6])
    assert plan_projections(inner) == []
    stack_projections(inner)
    assert inner.view.data_ptr() == inner.a.weight[4:6].data_ptr()  # still tied

    # Side by side, not overlapping: grouped.
    assert plan_projections(Pair(nn.Linear(4, 4), nn.Linear(4, 2))) == [("a", "b")]


# ---- which weights are tied, against pairwise overlap --------------------------------
SPAN = st.tuples(st.integers(0, 40), st.integers(1, 12))  # (start, rows) in one storage


def _overlap(a, b):
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


@settings(max_examples=150, deadline=None)
@given(a=SPAN, b=SPAN, extra=st.one_of(st.none(), SPAN))
def test_siblings_group_exactly_when_no_other_tensor_overlaps_either(a, b, extra):
    # a's and b's weights (and an extra parameter) are rows of one storage, 4 wide;
    # the reference: a weight is tied when its rows overlap another tensor's.
    storage = torch.zeros(60, 4)
    pair = nn.Module()
    pair.a, pair.b = nn.Linear(4, a[1], bias=False), nn.Linear(4, b[1], bias=False)
    pair.a.weight = nn.Parameter(storage[a[0] : a[0] + a[1]])
    pair.b.weight = nn.Parameter(storage[b[0] : b[0] + b[1]])
    spans = {"a": a, "b": b}
    if extra is not None:
        pair.extra = nn.Parameter(storage[extra[0] : extra[0] + extra[1]])
        spans["extra"] = extra
    tied = {
        name
        for name, span in spans.items()
        if any(_overlap(span, other) for o, other in spans.items() if o != name)
    }
    grouped = plan_projections(pair) == [("a", "b")]
    assert grouped == ("a" not in tied and "b" not in tied)
