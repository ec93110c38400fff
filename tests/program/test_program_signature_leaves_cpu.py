"""Registered leaf types in graph-program signatures (CPU): LeafTypes, and the
SignatureMismatchError every mismatch is reported through."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import cudagraphs
from cudagraphs.program import (
    LeafTypes,
    Mismatch,
    SignatureMismatchError,
    TensorSignature,
    ValueSignature,
    ValueTreeSignature,
)
from helpers.program_trees import (
    LEAF_TYPES,
    PackedTensor,
    QuantizedTensor,
)
from helpers.signatures import (
    Unregistered,
    mismatches_of,
    signature,
)


# ---- LeafTypes ----------------------------------------------------------------------------
def _flatten(v):
    return {"data": v.data}, {}


def _unflatten(t, m):
    return Unregistered(t["data"])


class MyTensor(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "cls, flatten, unflatten",
    [
        (Unregistered(torch.zeros(1)), _flatten, _unflatten),  # an instance, not a class
        (_flatten, _flatten, _unflatten),
        (torch.Tensor, _flatten, _unflatten),
        (MyTensor, _flatten, _unflatten),
        (torch.nn.Parameter, _flatten, _unflatten),
        (Unregistered, None, _unflatten),
        (Unregistered, _flatten, "unflatten"),
    ],
    ids=["instance", "function", "Tensor", "tensor-subclass", "Parameter", "flatten", "unflatten"],
)
def test_register_rejects_bad_arguments(cls, flatten, unflatten):
    leaf_types = LeafTypes()
    with pytest.raises(TypeError, match="must be a class|is a tensor type|must be callable"):
        leaf_types.register(cls, flatten=flatten, unflatten=unflatten)
    assert leaf_types.names() == []


def test_register_twice_is_a_value_error():
    leaf_types = LeafTypes()
    leaf_types.register(Unregistered, flatten=_flatten, unflatten=_unflatten)
    with pytest.raises(ValueError, match="registered already"):
        leaf_types.register(Unregistered, flatten=_flatten, unflatten=_unflatten, name="other")


def test_register_records_name_and_version():
    leaf_types = LeafTypes()
    leaf = leaf_types.register(Unregistered, flatten=_flatten, unflatten=_unflatten, version=3)
    assert leaf.name == f"{Unregistered.__module__}.Unregistered" and leaf.version == 3
    assert Unregistered in leaf_types and QuantizedTensor not in leaf_types
    assert leaf_types.by_name(leaf.name) is leaf
    assert leaf_types.get(Unregistered(torch.zeros(1))) is leaf
    assert leaf_types.get(torch.zeros(1)) is None
    sig = ValueTreeSignature.from_value(Unregistered(torch.zeros(2)), leaf_types=leaf_types)
    assert sig.kind == "value"
    assert sig.leaf == ValueSignature(
        type_name=leaf.name,
        schema_version=3,
        metadata=(),
        tensors=(("data", TensorSignature.from_tensor(torch.zeros(2))),),
    )


def test_by_name_of_an_unknown_name_is_a_key_error():
    with pytest.raises(KeyError, match="nope"):
        LEAF_TYPES.by_name("nope")


def test_value_signature_sorts_metadata_and_tensor_names():
    leaf_types = LeafTypes()
    leaf_types.register(
        Unregistered,
        flatten=lambda v: ({"z": v.data, "a": v.data[:1]}, {"y": 2, "b": "x"}),
        unflatten=lambda t, m: Unregistered(t["z"]),
        name="U",
    )
    sig = ValueTreeSignature.from_value(Unregistered(torch.zeros(3)), leaf_types=leaf_types)
    assert sig.leaf.metadata == (("b", "x"), ("y", 2))
    assert [name for name, _ in sig.leaf.tensors] == ["a", "z"]


def test_schema_version_change_is_a_mismatch():
    def versioned(version):
        leaf_types = LeafTypes()
        leaf_types.register(
            Unregistered, flatten=_flatten, unflatten=_unflatten, name="U", version=version
        )
        return leaf_types

    value = [Unregistered(torch.zeros(2))]
    old = ValueTreeSignature.from_value(value, leaf_types=versioned(1))
    assert old != ValueTreeSignature.from_value(value, leaf_types=versioned(2))
    # A signature recorded under format version 1, checked where version 2 is registered.
    stale = dataclasses.replace(old.children[0], _leaf_types=versioned(2))
    found = mismatches_of(ValueTreeSignature("list", children=(stale,)), value)
    assert [(m.path, m.field, m.expected, m.received) for m in found] == [
        ("value[0]", "schema_version", 1, 2)
    ]


def test_unhashable_metadata_is_a_type_error():
    leaf_types = LeafTypes()
    leaf_types.register(
        Unregistered,
        flatten=lambda v: ({"data": v.data}, {"sizes": [1, 2]}),
        unflatten=_unflatten,
    )
    with pytest.raises(TypeError, match=r"value\[0\].*hashable"):
        ValueTreeSignature.from_value([Unregistered(torch.zeros(1))], leaf_types=leaf_types)


def test_flatten_returning_a_non_tensor_is_a_type_error():
    leaf_types = LeafTypes()
    leaf_types.register(
        Unregistered,
        flatten=lambda v: ({"data": v.data, "count": 3}, {}),
        unflatten=_unflatten,
    )
    with pytest.raises(TypeError, match=r"value\['k'\].*non-tensors.*count"):
        ValueTreeSignature.from_value({"k": Unregistered(torch.zeros(1))}, leaf_types=leaf_types)


# ---- SignatureMismatchError --------------------------------------------------------------
def test_mismatch_error_lists_every_line_and_says_nothing_was_copied():
    sig = signature({"a": torch.zeros(2), "b": [torch.zeros(3, dtype=torch.int64)], "c": ()})
    bad = {"a": torch.zeros(3), "b": [torch.zeros(3)], "c": [torch.zeros(1)]}
    with pytest.raises(SignatureMismatchError) as info:
        sig.validate(bad, path="inputs")
    err = info.value
    assert isinstance(err, cudagraphs.CudaGraphInputError)
    assert isinstance(err, ValueError)
    assert {(m.path, m.field) for m in err.mismatches} == {
        ("inputs['a']", "shape"),
        ("inputs['b'][0]", "dtype"),
        ("inputs['c']", "type"),
    }
    message = str(err)
    assert "3 place(s)" in message and "Nothing was copied" in message
    for m in err.mismatches:
        assert str(m) in message
    dtype = next(m for m in err.mismatches if m.field == "dtype")
    assert (dtype.expected, dtype.received) == (torch.int64, torch.float32)
    assert str(dtype) == "inputs['b'][0]: dtype expected torch.int64, received torch.float32"


@pytest.mark.parametrize(
    "recorded, value, want",
    [
        ([torch.zeros(1)], ["text"], Mismatch("value[0]", "type", "Tensor", "str")),
        ([torch.zeros(1)], (torch.zeros(1),), Mismatch("value", "type", "list", "tuple")),
        ((torch.zeros(1),), [torch.zeros(1)], Mismatch("value", "type", "tuple", "list")),
        ([torch.zeros(1)] * 2, [torch.zeros(1)] * 3, Mismatch("value", "length", 2, 3)),
        ({"k": {}}, {"k": []}, Mismatch("value['k']", "type", "dict", "list")),
        (
            {"a": torch.zeros(1), "b": torch.zeros(1)},
            {"a": torch.zeros(1), "c": torch.zeros(1)},
            Mismatch("value", "keys", ["'a'", "'b'"], ["'a'", "'c'"]),
        ),
        ((None,), (torch.zeros(1),), Mismatch("value[0]", "type", "None", "Tensor")),
    ],
    ids=["tensor", "list", "tuple", "length", "dict", "keys", "none"],
)
def test_structure_mismatches_say_what_was_expected_and_received(recorded, value, want):
    assert mismatches_of(signature(recorded), value) == [want]
    with pytest.raises(SignatureMismatchError) as info:
        signature(recorded).flatten(value)
    assert info.value.mismatches == [want]


def _named_leaf_types():
    # Registered names that differ from the class names, so a report shows which.
    leaf_types = LeafTypes()
    leaf_types.register(
        QuantizedTensor,
        flatten=lambda q: ({"data": q.data}, {"block": q.block}),
        unflatten=lambda t, m: QuantizedTensor(t["data"], torch.ones(1), m["block"]),
        name="pkg.Quant",
    )
    leaf_types.register(
        PackedTensor,
        flatten=lambda p: ({"data": p.data}, {"block": p.block}),
        unflatten=lambda t, m: PackedTensor(t["data"], torch.ones(1), m["block"]),
        name="pkg.Packed",
    )
    return leaf_types


def test_registered_leaf_mismatches_say_what_was_expected_and_received():
    leaf_types = _named_leaf_types()
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 2)
    sig = ValueTreeSignature.from_value([q], leaf_types=leaf_types)
    other = PackedTensor(q.data, q.scale, 2)
    assert mismatches_of(sig, [other]) == [Mismatch("value[0]", "type", "pkg.Quant", "pkg.Packed")]
    assert mismatches_of(sig, [torch.zeros(1)]) == [
        Mismatch("value[0]", "type", "pkg.Quant", "Tensor")
    ]
    reblocked = QuantizedTensor(q.data, q.scale, 3)
    assert mismatches_of(sig, [reblocked]) == [
        Mismatch("value[0]", "metadata", {"block": 2}, {"block": 3})
    ]


def test_tensor_names_mismatch_says_what_was_expected_and_received():
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 2)
    with_zero = QuantizedTensor(q.data, q.scale, 2, torch.zeros(1, dtype=torch.int8))
    assert mismatches_of(signature([q]), [with_zero]) == [
        Mismatch("value[0]", "tensor names", ["data", "scale"], ["data", "scale", "zero_point"])
    ]


def test_a_registered_leaf_checked_without_its_leaf_types_is_a_type_mismatch():
    # A signature that lost its leaf types (replaced, say) cannot split the value:
    # it reports the type, it does not crash.
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 2)
    leaf = dataclasses.replace(signature([q]).children[0], _leaf_types=None)
    found = mismatches_of(ValueTreeSignature("list", children=(leaf,)), [q])
    assert found == [Mismatch("value[0]", "type", "QuantizedTensor", "QuantizedTensor")]


@dataclass
class Tagged:
    data: torch.Tensor
    tag: object


def test_a_leaf_whose_flatten_goes_bad_later_names_the_path():
    # The signature was recorded from a good value; a later value's flatten returns
    # unhashable metadata: the error names where that value sits.
    leaf_types = LeafTypes()
    leaf_types.register(
        Tagged,
        flatten=lambda v: ({"data": v.data}, {"tag": v.tag}),
        unflatten=lambda t, m: Tagged(t["data"], m["tag"]),
    )
    sig = ValueTreeSignature.from_value({"k": Tagged(torch.zeros(2), "a")}, leaf_types=leaf_types)
    with pytest.raises(cudagraphs.CudaGraphsTypeError, match=r"^value\['k'\]: metadata"):
        sig.validate({"k": Tagged(torch.zeros(2), ["a"])})


@pytest.mark.parametrize("method", ["validate", "flatten", "extract"])
def test_mismatch_error_names_the_path_it_was_given(method):
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 2)
    # extract() of a signature with registered leaves falls back to flatten().
    sig = signature([q] if method == "extract" else [torch.zeros(2)])
    bad = [torch.zeros(3)]
    with pytest.raises(SignatureMismatchError) as info:
        getattr(sig, method)(bad, path="inputs")
    assert info.value.what == "inputs"
    assert str(info.value).startswith("inputs differs from the captured signature")
    assert info.value.mismatches[0].path == "inputs[0]"
    with pytest.raises(SignatureMismatchError) as info:
        getattr(sig, method)(bad)
    assert info.value.what == "value" and info.value.mismatches[0].path == "value[0]"


def test_flatten_raises_the_same_error_as_validate():
    sig = signature([torch.zeros(2)])
    with pytest.raises(SignatureMismatchError) as info:
        sig.flatten([torch.zeros(2, dtype=torch.float16)])
    assert [(m.path, m.field) for m in info.value.mismatches] == [("value[0]", "dtype")]


def test_rebuild_with_too_many_tensors_is_a_value_error():
    sig = signature([torch.zeros(2)])
    with pytest.raises(ValueError, match="rebuild needs 1 tensors, got 2"):
        sig.rebuild([torch.zeros(2), torch.zeros(2)])


def test_rebuild_with_too_few_tensors_is_a_value_error():
    sig = signature([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="rebuild needs 2 tensors, got 1"):
        sig.rebuild([torch.zeros(2)])
