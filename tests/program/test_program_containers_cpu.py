"""describe_container on the CPU: a namedtuple is described by its class (its
mismatches name the "type"), anything else registered with pytree by its registry
entry, even when it carries a ``_fields`` attribute; LeafTypes records what it was
given."""

from collections import namedtuple

import torch
from torch.utils import _pytree as pytree

from cudagraphs.program.containers import describe_container
from cudagraphs.program.leaves import LeafType, LeafTypes

Pair = namedtuple("Pair", "a b")


class Fielded:
    """Not a tuple, yet has ``_fields`` (as some record classes do)."""

    _fields = ("a",)

    def __init__(self, a):
        self.a = a


pytree.register_pytree_node(
    Fielded, lambda v: ([v.a], "ctx"), lambda children, ctx: Fielded(children[0])
)


def test_a_namedtuple_is_described_by_its_class():
    sig, children = describe_container(Pair(1, 2))
    assert sig.is_namedtuple is True and sig.context is Pair
    assert sig.context_field == "type" and sig.child_paths == (".a", ".b")
    assert children == [1, 2] and sig.build([3, 4]) == Pair(3, 4)


def test_a_registered_class_with_fields_is_described_by_the_registry():
    sig, children = describe_container(Fielded(torch.ones(1)))
    assert sig.is_namedtuple is False and sig.context == "ctx"
    assert sig.context_field == "context" and sig.child_paths == ("[0]",)
    assert len(children) == 1 and isinstance(sig.build([5]), Fielded)


class Box:
    def __init__(self, data):
        self.data = data


def test_register_records_the_class_the_functions_and_version_one():
    def flatten(v):
        return {"data": v.data}, {}

    def unflatten(t, m):
        return Box(t["data"])

    leaf = LeafTypes().register(Box, flatten=flatten, unflatten=unflatten, name="box")
    assert leaf == LeafType(cls=Box, name="box", version=1, flatten=flatten, unflatten=unflatten)


def test_split_sorts_metadata_and_refuses_what_is_not_hashable_under_str_keys():
    import pytest

    from cudagraphs.errors import CudaGraphsTypeError

    def leaf(metadata):
        return LeafType(Box, "box", 1, lambda v: ({"data": v.data}, metadata), None)

    tensors, frozen = leaf({"b": 2, "a": (1,)}).split(Box(torch.ones(1)), "x[0]")
    assert frozen == (("a", (1,)), ("b", 2)) and list(tensors) == ["data"]
    for bad in ({1: 2}, {"a": [1]}):
        with pytest.raises(
            CudaGraphsTypeError,
            match=r"^x\[0\]: metadata of leaf type 'box' must be hashable values under string keys",
        ):
            leaf(bad).split(Box(torch.ones(1)), "x[0]")
    with pytest.raises(CudaGraphsTypeError, match=r"returned non-tensors for \['data'\]"):
        LeafType(Box, "box", 1, lambda v: ({"data": 1}, {}), None).split(Box(None), "x")
