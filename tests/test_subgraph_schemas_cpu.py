"""The schema memo of ``invoke_subgraph`` (``torch_private.memoized_subgraph_schemas``)
on the CPU: one schema per subgraph, identifier and operand types, the same object for
every later call; the hop put back on close, an error included; inert where torch
caches the schemas itself or an outer memo is open; a compile of a mutating nested
region through AOTAutograd and the compiled generator's capture compute what eager
does with the memo installed."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs import torch_private
from cudagraphs.torch_private import memoized_subgraph_schemas, upstream_caches_subgraph_schemas

invoke_subgraph_module = pytest.importorskip("torch._higher_order_ops.invoke_subgraph")
HOP = invoke_subgraph_module.invoke_subgraph
HOP_CLASS = type(HOP)


def body(x, y):
    x.add_(y)
    return (x * 2,)


@pytest.fixture
def subgraph():
    return torch.fx.symbolic_trace(body)


def test_one_schema_per_subgraph_identifier_and_operand_types(subgraph):
    other = torch.fx.symbolic_trace(body)
    x, y = torch.ones(3), torch.ones(3)
    with memoized_subgraph_schemas(force=True) as memo:
        first = HOP.gen_schema(subgraph, "subgraph_0", x, y)
        again = HOP.gen_schema(subgraph, "subgraph_0", x, y)
        assert again is first
        assert HOP.gen_schema(subgraph, "subgraph_1", x, y) is not first
        assert HOP.gen_schema(other, "subgraph_0", x, y) is not first
        assert HOP.gen_schema(subgraph, "subgraph_0", x, 2) is not first  # an int operand
        assert memo.active and (memo.built, memo.reused) == (4, 1)
    # The schema says what the subgraph mutates: the first operand, as torch says.
    writes = [a.alias_info is not None and a.alias_info.is_write for a in first.arguments]
    assert writes == [False, False, True, False]


def test_a_call_without_an_identifier_is_not_memoized(subgraph):
    x, y = torch.ones(3), torch.ones(3)
    with memoized_subgraph_schemas(force=True) as memo:
        HOP.gen_schema(subgraph, None, x, y)
        HOP.gen_schema(subgraph, None, x, y)
    assert (memo.built, memo.reused) == (0, 0)


def test_the_hop_is_put_back_on_close_and_after_an_error(subgraph):
    original = HOP_CLASS.__dict__["gen_schema"]
    with memoized_subgraph_schemas(force=True):
        assert HOP_CLASS.__dict__["gen_schema"] is not original
    assert HOP_CLASS.__dict__["gen_schema"] is original
    with pytest.raises(RuntimeError, match="inside"), memoized_subgraph_schemas(force=True):
        raise RuntimeError("inside")
    assert HOP_CLASS.__dict__["gen_schema"] is original
    x, y = torch.ones(3), torch.ones(3)
    assert HOP.gen_schema(subgraph, "subgraph_0", x, y) is not HOP.gen_schema(
        subgraph, "subgraph_0", x, y
    ), "closed: every call makes its own schema again"


def test_an_inner_memo_is_inert_and_the_outer_one_keeps_counting(subgraph):
    x, y = torch.ones(3), torch.ones(3)
    with memoized_subgraph_schemas(force=True) as outer:
        with memoized_subgraph_schemas(force=True) as inner:
            HOP.gen_schema(subgraph, "subgraph_0", x, y)
            HOP.gen_schema(subgraph, "subgraph_0", x, y)
        assert not inner.active
        assert HOP_CLASS.__dict__["gen_schema"] is not None
        HOP.gen_schema(subgraph, "subgraph_0", x, y)
    assert (outer.built, outer.reused) == (1, 2)


def test_inert_where_torch_caches_the_schemas_itself(monkeypatch):
    monkeypatch.setattr(torch_private, "upstream_caches_subgraph_schemas", lambda: True)
    original = HOP_CLASS.__dict__["gen_schema"]
    with memoized_subgraph_schemas() as memo:
        assert HOP_CLASS.__dict__["gen_schema"] is original
    assert not memo.active


def test_upstream_cache_is_asked_of_torchs_own_cache_class():
    import torch._guards

    cache = getattr(torch._guards, "InvokeSubgraphCache", None)
    assert upstream_caches_subgraph_schemas() == hasattr(cache, "get_functionalize_schema_entry")


def test_a_mutating_region_called_per_layer_compiles_through_aot_as_eager_computes():
    import torch._dynamo

    region = torch.compiler.nested_compile_region(lambda h, w, state: _layer(h, w, state))

    def stack(h, weights, states):
        for w, state in zip(weights, states):
            h = region(h, w, state)
        return h

    def make():
        torch.manual_seed(0)
        return (
            torch.randn(2, 8),
            [torch.randn(8, 8) for _ in range(4)],
            [torch.zeros(2, 8) for _ in range(4)],
        )

    want_h, want_w, want_states = make()
    want = stack(want_h, want_w, want_states)
    torch._dynamo.reset()
    h, weights, states = make()
    with memoized_subgraph_schemas(force=True) as memo:
        got = torch.compile(stack, backend="aot_eager", fullgraph=True)(h, weights, states)
    torch._dynamo.reset()
    assert memo.active and memo.built >= 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for state, expected in zip(states, want_states):
        torch.testing.assert_close(state, expected, rtol=0, atol=0)


def _layer(h, w, state):
    out = torch.tanh(h @ w)
    state.copy_(out)  # an input the region mutates, as a layer writes its cache
    return out


def _other_body(x, y):
    return (x + y,)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1]), st.sampled_from(["a", "b", None]), st.booleans()),
        min_size=1,
        max_size=8,
    )
)
def test_the_memo_answers_as_torch_does_and_builds_once_per_key(calls):
    # Reference: torch's own gen_schema for every call, and a plain set of the keys
    # (subgraph, identifier, operand types) that carry an identifier.
    graphs = [torch.fx.symbolic_trace(body), torch.fx.symbolic_trace(_other_body)]
    x = torch.ones(3)

    def args(which, identifier, int_operand):
        return graphs[which], identifier, x, (2 if int_operand else torch.ones(3))

    want = [str(HOP.gen_schema(*args(*call))) for call in calls]
    with memoized_subgraph_schemas(force=True) as memo:
        got = [str(HOP.gen_schema(*args(*call))) for call in calls]
    assert got == want
    keys = [c for c in calls if c[1] is not None]
    assert memo.built == len(set(keys))
    assert memo.reused == len(keys) - len(set(keys))
