"""The call flattener of the replay path (CPU): for calls of tensors, plain values and
plain tuples of them it gives pytree's leaves and spec without walking the call each
time; every other call goes to pytree."""

from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.partial.contract import SpecCache, flatten_call, quick_flatten

T = torch.zeros(1)
plain = st.one_of(
    st.just(T),
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
)
value = st.one_of(plain, st.tuples(plain), st.tuples(plain, plain), st.just(()))
calls = st.tuples(
    st.lists(value, max_size=4).map(tuple),
    st.dictionaries(st.sampled_from(["mask", "pos", "a", "use_cache", "z"]), value),
)


def same(a, b):
    return len(a) == len(b) and all(x is y or (x == y and type(x) is type(y)) for x, y in zip(a, b))


@settings(max_examples=300, deadline=None)
@given(calls)
def test_leaves_and_spec_equal_pytrees_first_and_again(call):
    args, kwargs = call
    want_leaves, want_spec = flatten_call(args, kwargs)
    cache = SpecCache()
    for _ in range(2):  # the second call takes the cached spec
        leaves, spec = cache.flatten(args, kwargs)
        assert same(leaves, want_leaves) and spec == want_spec


def test_keyword_order_does_not_matter_and_structures_get_their_own_spec():
    cache = SpecCache()
    a = cache.flatten((T,), {"b": 1, "a": (T, T)})
    b = cache.flatten((T,), {"a": (T, T), "b": 2})
    assert a[1] == b[1] and b[0][3] == 2
    c = cache.flatten((T,), {"a": (T,), "b": 2})
    assert c[1] != a[1] and c[1] == flatten_call((T,), {"a": (T,), "b": 2})[1]


Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (([T, T],), {}),
        ((T,), {"d": {"k": T}}),
        ((Pair(T, T),), {}),
        ((((T,),),), {}),
        ((OrderedDict(a=T),), {}),
        ((), {"cache": object()}),
    ],
    ids=["list", "dict", "namedtuple", "nested tuple", "ordereddict", "object"],
)
def test_other_calls_go_to_pytree(args, kwargs):
    assert quick_flatten(args, kwargs) is None
    leaves, spec = SpecCache().flatten(args, kwargs)
    want = flatten_call(args, kwargs)
    assert same(leaves, want[0]) and spec == want[1]


def test_at_most_limit_structures_are_kept():
    cache = SpecCache(limit=2)
    for n in range(4):
        leaves, spec = cache.flatten((T,) * n, {})
        assert spec == flatten_call((T,) * n, {})[1]
    assert len(cache._specs) == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(calls, min_size=2, max_size=6))
def test_one_cache_over_calls_of_many_structures_gives_each_its_own_spec(sequence):
    # A leaf and a 1-tuple, or tuples of two lengths, at one position must not share a
    # cached spec: the key tells every structure apart.
    cache = SpecCache()
    for args, kwargs in sequence:
        leaves, spec = cache.flatten(args, kwargs)
        want_leaves, want_spec = flatten_call(args, kwargs)
        assert same(leaves, want_leaves) and spec == want_spec


def test_a_leaf_and_a_one_tuple_in_one_cache():
    cache = SpecCache()
    calls_ = [((T,), {}), (((T,),), {}), ((T, (T, T)), {}), ((T, (T, T, T)), {})]
    calls_ += [((), {"a": T}), ((), {"a": (T,)}), ((), {"a": (T, T)})]
    for call in calls_ * 2:
        assert cache.flatten(*call)[1] == flatten_call(*call)[1]


def test_a_known_structure_is_not_walked_by_pytree_again(monkeypatch):
    from cudagraphs.partial import contract

    walked = []
    real = contract.flatten_call
    monkeypatch.setattr(contract, "flatten_call", lambda *a: walked.append(1) or real(*a))
    cache = SpecCache()
    for _ in range(3):
        cache.flatten((T, (T, T)), {"mask": None, "pos": (T, 1)})
    assert len(walked) == 1
    assert SpecCache().limit == 16


def test_a_tensor_subclass_registered_with_pytree_goes_to_pytree():
    from torch.utils import _pytree as pytree

    class Packed(torch.Tensor):
        pass

    pytree.register_pytree_node(
        Packed, lambda p: ([p.as_subclass(torch.Tensor)], None), lambda xs, _: xs[0]
    )
    try:
        packed = torch.zeros(2).as_subclass(Packed)
        assert quick_flatten((packed,), {}) is None
        assert quick_flatten((torch.zeros(2).as_subclass(torch.Tensor),), {}) is not None
    finally:
        pytree.SUPPORTED_NODES.pop(Packed)
