"""Program trees built from the containers users already have: namedtuples,
OrderedDicts, dataclasses registered with torch's pytree, None leaves and Hugging Face
ModelOutputs (CPU)."""

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils import _pytree as pytree

from cudagraphs.program import (
    Mismatch,
    ReusableValueBuffer,
    SignatureMismatchError,
    ValueTreeSignature,
)
from cudagraphs.program.matcher import InputValidator, compile_matcher

Pair = namedtuple("Pair", "first second")
Other = namedtuple("Other", "first second")


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor | None = None


pytree.register_dataclass(Batch)


class Stack:
    """A registered container whose context does not record how many items it holds."""

    def __init__(self, items):
        self.items = list(items)


pytree.register_pytree_node(Stack, lambda s: (s.items, None), lambda items, context: Stack(items))


def _model_output():
    transformers = pytest.importorskip("transformers")
    return transformers.modeling_outputs.CausalLMOutputWithPast


def trees():
    """One tree per container kind, each with tensors at two depths."""
    out = {
        "namedtuple": Pair(torch.arange(3.0), [torch.ones(2, 2)]),
        "ordereddict": OrderedDict(b=torch.zeros(2), a=(torch.ones(1), torch.arange(4))),
        "dataclass": Batch(torch.arange(5), torch.ones(5, dtype=torch.bool)),
        "dataclass_none_field": Batch(torch.arange(5)),
        "none_leaf": (torch.ones(2), None, {"x": None, "y": torch.zeros(1)}),
        "nested": {"p": Pair(OrderedDict(k=torch.ones(3)), Batch(torch.zeros(2)))},
    }
    try:
        output_cls = _model_output()
    except pytest.skip.Exception:
        return out
    out["model_output"] = output_cls(logits=torch.randn(2, 4), loss=torch.tensor(0.5))
    return out


TREES = trees()


def _same(a, b):
    """Same containers (exact types), same tensor values."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("name", list(TREES))
def test_round_trip_through_a_buffer_keeps_every_container_type(name):
    tree = TREES[name]
    sig = ValueTreeSignature.from_value(tree)
    buf = ReusableValueBuffer(sig, "cpu")
    buf.copy_from(tree)
    _same(buf.value, tree)
    assert type(buf.value) is type(tree)
    _same(sig.rebuild(sig.flatten(tree)), tree)


@pytest.mark.parametrize("name", list(TREES))
def test_the_generated_matcher_serves_registered_containers(name):
    tree = TREES[name]
    sig = ValueTreeSignature.from_value(tree)
    matcher = compile_matcher(sig)
    assert matcher is not None
    got = matcher(tree)
    assert got is not None and all(a is b for a, b in zip(got, sig.flatten(tree)))
    extractor = compile_matcher(sig, checks=False)
    assert all(a is b for a, b in zip(extractor(tree), got))
    validator = InputValidator(sig)
    for _ in range(3):  # the second call goes through torch's tensor guard
        assert all(a is b for a, b in zip(validator(tree, "inputs"), got))


def _mismatches(sig, value):
    with pytest.raises(SignatureMismatchError) as info:
        sig.validate(value, path="inputs")
    assert compile_matcher(sig)(value) is None  # the fast path says "no" too
    return info.value.mismatches


def test_a_namedtuple_of_another_class_or_a_plain_tuple_is_a_type_mismatch():
    sig = ValueTreeSignature.from_value(Pair(torch.zeros(1), torch.zeros(2)))
    assert _mismatches(sig, Other(torch.zeros(1), torch.zeros(2))) == [
        Mismatch("inputs", "type", "Pair", "Other")
    ]
    assert _mismatches(sig, (torch.zeros(1), torch.zeros(2))) == [
        Mismatch("inputs", "type", "Pair", "tuple")
    ]


def test_namedtuple_fields_name_the_path():
    sig = ValueTreeSignature.from_value(Pair(torch.zeros(1), torch.zeros(2)))
    assert _mismatches(sig, Pair(torch.zeros(1), torch.zeros(3))) == [
        Mismatch("inputs.second", "shape", (2,), (3,))
    ]


def test_ordereddict_key_order_is_part_of_its_identity():
    # Unlike a dict, an OrderedDict's order is part of what it is (== says so too).
    sig = ValueTreeSignature.from_value(OrderedDict(a=torch.zeros(1), b=torch.zeros(1)))
    swapped = OrderedDict(b=torch.zeros(1), a=torch.zeros(1))
    assert _mismatches(sig, swapped) == [Mismatch("inputs", "keys", ["a", "b"], ["b", "a"])]
    assert _mismatches(sig, {"a": torch.zeros(1), "b": torch.zeros(1)}) == [
        Mismatch("inputs", "type", "OrderedDict", "dict")
    ]


def test_ordereddict_keys_name_the_path():
    sig = ValueTreeSignature.from_value(OrderedDict(a=torch.zeros(1), b=torch.zeros(2)))
    bad = OrderedDict(a=torch.zeros(1), b=torch.zeros(2, dtype=torch.int64))
    assert _mismatches(sig, bad) == [Mismatch("inputs['b']", "dtype", torch.float32, torch.int64)]


def test_a_dataclass_field_that_becomes_none_is_a_mismatch():
    sig = ValueTreeSignature.from_value(Batch(torch.arange(3), torch.ones(3)))
    (m,) = _mismatches(sig, Batch(torch.arange(3)))
    assert m.path == "inputs" and m.field == "context"
    (m,) = _mismatches(sig, Batch(torch.arange(4), torch.ones(3)))
    assert m == Mismatch("inputs.ids", "shape", (3,), (4,))


def test_none_leaves_must_stay_none():
    sig = ValueTreeSignature.from_value((torch.ones(2), None))
    assert sig.tensor_signatures()[0].shape == (2,) and len(sig.tensor_signatures()) == 1
    assert _mismatches(sig, (torch.ones(2), torch.ones(2))) == [
        Mismatch("inputs[1]", "type", "None", "Tensor")
    ]
    with pytest.raises(TypeError, match=r"value\[1\]: unsupported leaf of type NoneType"):
        ValueTreeSignature.from_value((torch.ones(2), None), allow_none=False)


def test_model_output_fields_and_missing_fields():
    output_cls = _model_output()
    sig = ValueTreeSignature.from_value(output_cls(logits=torch.zeros(2, 3)))
    assert _mismatches(sig, output_cls(logits=torch.zeros(2, 3), loss=torch.zeros(()))) == [
        Mismatch("inputs", "keys", ["logits"], ["loss", "logits"])
    ]
    assert _mismatches(sig, output_cls(logits=torch.zeros(2, 4))) == [
        Mismatch("inputs['logits']", "shape", (2, 3), (2, 4)),
        Mismatch("inputs['logits']", "stride", (3, 1), (4, 1)),
    ]
    rebuilt = sig.rebuild([torch.ones(2, 3)])
    assert type(rebuilt) is output_cls and rebuilt.loss is None
    assert torch.equal(rebuilt.logits, torch.ones(2, 3))


def test_equal_signatures_for_equal_containers():
    a = ValueTreeSignature.from_value(OrderedDict(k=Pair(torch.zeros(1), None)))
    b = ValueTreeSignature.from_value(OrderedDict(k=Pair(torch.ones(1), None)))
    assert a == b
    c = ValueTreeSignature.from_value(OrderedDict(j=Pair(torch.ones(1), None)))
    assert a != c


def test_a_registered_container_with_another_number_of_items_is_a_length_mismatch():
    sig = ValueTreeSignature.from_value(Stack([torch.zeros(1), torch.zeros(2)]))
    assert _mismatches(sig, Stack([torch.zeros(1)])) == [Mismatch("inputs", "length", 2, 1)]
    assert _mismatches(sig, Stack([torch.zeros(1), torch.zeros(3)])) == [
        Mismatch("inputs[1]", "shape", (2,), (3,))
    ]
