"""Where two call structures part (core/tree_diff.py): one Mismatch per differing node."""

import warnings
from collections import OrderedDict, namedtuple

import pytest
from torch.utils import _pytree as pytree

from cudagraphs.core.tree_diff import _spec_children, structure_mismatches
from cudagraphs.errors import Mismatch

Pair = namedtuple("Pair", "x y")
Other = namedtuple("Other", "x y")


def _spec(*args, **kwargs):
    return pytree.tree_flatten((args, kwargs))[1]


def _diff(want, got):
    return structure_mismatches(want, got)


def test_same_structures_give_no_mismatch():
    spec = _spec((1, [2, 3]), {"a": 4}, k=Pair(5, 6))
    assert _diff(spec, _spec((1, [2, 3]), {"a": 4}, k=Pair(5, 6))) == []


def test_a_tuple_for_a_list_of_the_same_length_is_a_type_mismatch():
    assert _diff(_spec((1, 2)), _spec([1, 2])) == [Mismatch("args[0]", "type", "tuple", "list")]


def test_a_list_for_a_dict_is_a_type_mismatch_and_stops_there():
    got = _diff(_spec({"a": 1}, [1]), _spec([1], {"a": 1}))
    assert got == [
        Mismatch("args[0]", "type", "dict", "list"),
        Mismatch("args[1]", "type", "list", "dict"),
    ]


def test_a_leaf_for_a_container_and_back_are_type_mismatches():
    got = _diff(_spec(1, (2,)), _spec((1,), 2))
    assert got == [
        Mismatch("args[0]", "type", "a leaf (tensor or constant)", "tuple"),
        Mismatch("args[1]", "type", "tuple", "a leaf (tensor or constant)"),
    ]


def test_two_leaves_never_mismatch_here():
    # Leaf values (constants, tensors) are compared elsewhere, not by the structure walk.
    assert _diff(_spec(1, "s", k=None), _spec(2.0, None, k=3)) == []


def test_reordered_ordered_dict_keys_are_a_context_mismatch():
    want = _spec(OrderedDict(a=1, b=2))
    got = _spec(OrderedDict(b=1, a=2))
    assert _diff(want, got) == [Mismatch("args[0]", "context", ["a", "b"], ["b", "a"])]


def test_another_namedtuple_of_the_same_length_is_a_context_mismatch():
    got = _diff(_spec(x=[Pair(1, 2)]), _spec(x=[Other(1, 2)]))
    assert got == [Mismatch("kwargs['x'][0]", "context", Pair, Other)]
    assert str(got[0]) == (f"kwargs['x'][0]: context expected {Pair!r}, received {Other!r}")


def test_every_difference_is_reported_with_its_path():
    want = _spec((1, 2), OrderedDict(a=1), {"k": 1}, m=[1, 2])
    got = _spec([1, 2], OrderedDict(z=1), {"j": 1}, m=[1])
    assert _diff(want, got) == [
        Mismatch("args[0]", "type", "tuple", "list"),
        Mismatch("args[1]", "context", ["a"], ["z"]),
        Mismatch("args[2]", "keys", ["k"], ["j"]),
        Mismatch("kwargs['m']", "length", 2, 1),
    ]


def test_real_specs_are_walked_without_the_deprecated_children_specs():
    # torch 2.13 warns on TreeSpec.children_specs; the walk uses children() instead.
    # Below a plain dict the path names keys; below other containers, positions.
    want = _spec((1, OrderedDict(a=[2])), k={"a": Pair(1, 2)})
    got = _spec((1, OrderedDict(a=[2, 3])), k={"a": Pair(1, 2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _diff(want, got) == [Mismatch("args[0][1][0]", "length", 1, 2)]
        assert _spec_children(want) == list(want.children())


class _NewSpec:
    """A spec of a torch with children() (children_specs refused, as if removed)."""

    def __init__(self, kids):
        self._kids = kids

    def children(self):
        return iter(self._kids)

    @property
    def children_specs(self):
        raise AssertionError("children_specs read although children() exists")


class _OldSpec:
    """A spec of a torch older than children(): only the children_specs list."""

    def __init__(self, kids):
        self.children_specs = kids


def test_spec_children_uses_the_children_method_where_the_spec_type_has_one():
    got = _spec_children(_NewSpec(("a", "b")))
    assert got == ["a", "b"] and type(got) is list


def test_spec_children_falls_back_to_children_specs_on_older_torch():
    kids = ("a", "b")
    got = _spec_children(_OldSpec(kids))
    assert got == ["a", "b"] and type(got) is list


@pytest.mark.parametrize("spec_type", [_OldSpec, _NewSpec])
def test_spec_children_of_no_children_is_an_empty_list(spec_type):
    assert _spec_children(spec_type(())) == []
