"""Signatures of graph-program input trees: description, validation, flattening (CPU)."""

import dataclasses
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cudagraphs
from _program_trees import (
    LEAF_TYPES,
    PackedTensor,
    QuantizedTensor,
    leaf_tensors,
    map_tensors,
    node_mutations,
    path_of,
    reorder_dicts,
    replace,
    same_structure,
    shifted,
    tensor_mutations,
    tensors,
    trees,
    walk,
)
from cudagraphs.program import (
    LeafTypes,
    Mismatch,
    ReusableValueBuffer,
    SignatureMismatchError,
    TensorSignature,
    ValueSignature,
    ValueTreeSignature,
)

SETTINGS = settings(max_examples=50, deadline=None)


def signature(value) -> ValueTreeSignature:
    return ValueTreeSignature.from_value(value, leaf_types=LEAF_TYPES)


def mismatches_of(sig: ValueTreeSignature, value) -> list[Mismatch]:
    with pytest.raises(SignatureMismatchError) as info:
        sig.validate(value)
    return info.value.mismatches


def span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


# ---- properties -----------------------------------------------------------------------
@SETTINGS
@given(trees())
def test_round_trip(value):
    sig = signature(value)
    sig.validate(value)
    flat = sig.flatten(value)
    expected = leaf_tensors(value)
    assert len(flat) == len(expected) and all(a is b for a, b in zip(flat, expected))
    assert sig.tensor_signatures() == [TensorSignature.from_tensor(t) for t in flat]
    assert sig.nbytes == sum(span_bytes(t) for t in flat)
    assert sig == signature(map_tensors(value, shifted))
    rebuilt = sig.rebuild(flat)
    assert same_structure(rebuilt, value)
    assert all(a is b for a, b in zip(sig.flatten(rebuilt), flat))

    buf = ReusableValueBuffer(sig, "cpu")
    buf.copy_from(value)
    assert len(buf.tensors) == len(flat)
    for dst, src in zip(buf.tensors, flat):
        assert dst.device.type == "cpu"
        assert TensorSignature.from_tensor(dst) == TensorSignature.from_tensor(src)
        assert torch.equal(dst, src)
    assert same_structure(buf.value, value)
    assert signature(buf.value) == sig
    assert all(a is b for a, b in zip(sig.flatten(buf.value), buf.tensors))


@SETTINGS
@given(trees())
def test_dict_insertion_order_is_not_part_of_the_signature(value):
    sig = signature(value)
    reordered = reorder_dicts(map_tensors(value, shifted))
    sig.validate(reordered)
    assert signature(reordered) == sig
    buf = ReusableValueBuffer(sig, "cpu")
    buf.copy_from(reordered)
    for dst, src in zip(buf.tensors, leaf_tensors(reordered)):
        assert torch.equal(dst, src)


def test_dict_keys_of_mixed_types_have_one_canonical_order():
    # Keys of different types do not compare with <; they are ordered by type name,
    # then repr, and tensors are flattened in that order.
    a, one = torch.zeros(2), torch.zeros(3)
    sig = signature({"a": a, 1: one})
    assert sig.keys == (1, "a")
    flat = sig.flatten({1: one, "a": a})
    assert flat[0] is one and flat[1] is a
    assert [t.shape for t in sig.tensor_signatures()] == [(3,), (2,)]


@st.composite
def one_mutation(draw):
    """(original, mutated, expected path, expected field) with one node changed."""
    value = draw(trees())
    nodes = list(walk(value))
    loc, node = draw(st.sampled_from(nodes))
    options = node_mutations(node)
    name = draw(st.sampled_from(sorted(options)))
    new_node, suffix, field = options[name]
    return value, replace(value, loc, new_node), path_of(loc) + suffix, field


@SETTINGS
@given(one_mutation())
def test_every_kind_of_mismatch_is_found_with_its_path(case):
    value, mutated, path, field = case
    found = mismatches_of(signature(value), mutated)
    assert any(m.path == path and m.field == field for m in found), (path, field, found)


@SETTINGS
@given(one_mutation())
def test_failed_copy_leaves_the_buffer_unchanged(case):
    value, mutated, _, _ = case
    buf = ReusableValueBuffer(signature(value), "cpu")
    buf.copy_from(value)
    before = [t.detach().clone() for t in buf.tensors]
    # Fresh values everywhere, so a partial copy of any leaf would show.
    with pytest.raises(SignatureMismatchError, match="differs from the captured signature"):
        buf.copy_from(map_tensors(mutated, shifted))
    assert all(torch.equal(a, b) for a, b in zip(buf.tensors, before))


@SETTINGS
@given(trees(depth=2), st.lists(tensors(), min_size=3, max_size=3), st.data())
def test_all_mismatches_are_reported_at_once(tree, extra, data):
    value = [tree, extra]
    leaves = [(loc, n) for loc, n in walk(value) if isinstance(n, torch.Tensor)]
    picks = data.draw(
        st.lists(st.sampled_from(range(len(leaves))), min_size=3, max_size=3, unique=True)
    )
    mutated, expected = value, set()
    for i in picks:
        loc, node = leaves[i]
        options = tensor_mutations(node)
        new_node, _, field = options[data.draw(st.sampled_from(sorted(options)))]
        mutated = replace(mutated, loc, new_node)
        expected.add((path_of(loc), field))

    with pytest.raises(SignatureMismatchError) as info:
        signature(value).validate(mutated)
    found = info.value.mismatches
    assert len(found) >= 3
    assert len({m.path for m in found}) >= 3
    assert expected <= {(m.path, m.field) for m in found}
    for m in found:
        assert str(m) in str(info.value)


# ---- TensorSignature ------------------------------------------------------------------
def test_tensor_signature_fields():
    t = torch.zeros(3, 2, dtype=torch.float16).t().requires_grad_()
    sig = TensorSignature.from_tensor(t)
    assert sig == TensorSignature(
        shape=(2, 3),
        stride=(1, 2),
        dtype=torch.float16,
        layout=torch.strided,
        requires_grad=True,
    )
    assert type(sig.shape) is tuple and type(sig.stride) is tuple


def test_empty_allocates_the_topology_on_the_given_device():
    sig = TensorSignature.from_tensor(torch.zeros(3, 2, dtype=torch.float16).t().requires_grad_())
    out = sig.empty("meta")
    assert out.device.type == "meta"
    assert TensorSignature.from_tensor(out) == sig


def test_from_tensor_of_a_sparse_tensor_names_the_default_path():
    with pytest.raises(cudagraphs.CudaGraphsTypeError, match=r"^value: a torch.sparse_coo tensor"):
        TensorSignature.from_tensor(torch.zeros(2).to_sparse())


def test_mismatches_against_a_hand_built_sparse_signature_name_the_path():
    # Layouts equal, so the comparison goes on: the tensor's own signature is refused,
    # and the error names the path being checked.
    sparse = torch.zeros(2).to_sparse()
    sig = TensorSignature((2,), (1,), torch.float32, torch.sparse_coo, False)
    with pytest.raises(cudagraphs.CudaGraphsTypeError, match=r"^inputs\[3\]: a torch.sparse_coo"):
        sig.mismatches(sparse, "inputs[3]")


def test_device_is_not_part_of_a_signature():
    sig = signature({"x": torch.zeros(2, 3)})
    assert signature({"x": torch.empty(2, 3, device="meta")}) == sig
    assert "meta" not in repr(sig) and "cpu" not in repr(sig)


def test_a_meta_tensor_is_refused_although_its_signature_matches():
    # Every field matches, but a meta tensor holds no data for the copy to read.
    sig = signature({"x": torch.zeros(2, 3), "y": torch.zeros(2)})
    meta = {"x": torch.empty(2, 3, device="meta"), "y": torch.zeros(2)}
    assert mismatches_of(sig, meta) == [
        Mismatch("value['x']", "device", "a CPU or CUDA tensor", "meta")
    ]
    with pytest.raises(SignatureMismatchError, match=r"value\['x'\]: device"):
        sig.flatten(meta)  # the generated fast path refuses it too


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_tensor_is_refused_by_layout_before_its_strides_are_read():
    sig = signature([torch.zeros(2, 3), torch.zeros(3)])
    csr = torch.zeros(2, 3).to_sparse_csr()
    assert mismatches_of(sig, [csr, torch.zeros(4)]) == [
        Mismatch("value[0]", "layout", torch.strided, torch.sparse_csr),
        Mismatch("value[1]", "shape", (3,), (4,)),
    ]
    with pytest.raises(SignatureMismatchError, match=r"value\[0\]: layout"):
        sig.flatten([csr, torch.zeros(3)])
    with pytest.raises(
        cudagraphs.CudaGraphsTypeError, match=r"value\[0\]: a torch.sparse_csr tensor"
    ):
        signature([csr])  # not as an example either


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_or_meta_source_leaves_the_buffer_untouched():
    sig = signature([torch.zeros(3), torch.zeros(2, 2)])
    buf = ReusableValueBuffer(sig, "cpu")
    buf.copy_from([torch.zeros(3), torch.zeros(2, 2)])
    for bad in (
        [torch.ones(3), torch.ones(2, 2).to_sparse_csr()],
        [torch.ones(3), torch.empty(2, 2, device="meta")],
    ):
        with pytest.raises(SignatureMismatchError, match=r"inputs\[1\]: (layout|device)"):
            buf.copy_from(bad)
        assert not buf.tensors[0].any()  # nothing was written, not even the good leaf


@pytest.mark.parametrize(
    "tensor, nbytes",
    [
        (torch.zeros(2, 3), 24),
        (torch.zeros(3, 2, dtype=torch.float16).t(), 12),
        (torch.zeros(4, 6)[:, ::2], (1 + 3 * 6 + 2 * 2) * 4),  # storage span, gaps included
        (torch.zeros(0, 3), 0),
        (torch.zeros(3, 0, dtype=torch.int64), 0),
        (torch.zeros((), dtype=torch.int64), 8),
        (torch.zeros(5, dtype=torch.bool), 5),
    ],
)
def test_tensor_nbytes(tensor, nbytes):
    assert TensorSignature.from_tensor(tensor).nbytes == nbytes
    assert signature(tensor).nbytes == nbytes


def test_tree_nbytes():
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), block=2)
    value = {
        "a": [torch.zeros(2, 3), q],
        "b": (torch.zeros(0, 2), torch.zeros(3, dtype=torch.int64)),
    }
    sig = signature(value)
    assert sig.nbytes == 24 + 4 + 4 + 0 + 24
    assert ReusableValueBuffer(sig, "cpu").nbytes == sig.nbytes


# ---- unsupported leaves ----------------------------------------------------------------
@dataclass
class Unregistered:
    data: torch.Tensor


class SubQuantized(QuantizedTensor):
    pass


class MyList(list):
    pass


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "leaf",
    [
        3,
        "text",
        Unregistered(torch.zeros(1)),
        {torch.zeros(1)},
        MyList([torch.zeros(1)]),
        SubQuantized(torch.zeros(1, dtype=torch.int8), torch.ones(1), 1),
    ],
    ids=["int", "str", "unregistered-dataclass", "set", "list-subclass", "leaf-subclass"],
)
def test_unsupported_leaf_is_a_type_error_naming_its_path(leaf):
    value = {"x": [torch.zeros(1), leaf]}
    with pytest.raises(TypeError, match=r"value\['x'\]\[1\]") as info:
        signature(value)
    assert type(leaf).__qualname__ in str(info.value)


def test_registered_type_is_unsupported_without_its_leaf_types():
    q = QuantizedTensor(torch.zeros(1, dtype=torch.int8), torch.ones(1), 1)
    with pytest.raises(TypeError, match=r"value\[0\]"):
        ValueTreeSignature.from_value([q])
    with pytest.raises(TypeError, match="QuantizedTensor"):
        ValueTreeSignature.from_value([q], leaf_types=LeafTypes())


@pytest.mark.parametrize(
    "leaf_types, registered",
    [
        (LEAF_TYPES, "registered here: ['PackedTensor', 'QuantizedTensor']"),
        (LeafTypes(), "registered here: none"),
        (None, "registered here: none"),
    ],
    ids=["two", "empty", "none"],
)
def test_unsupported_leaf_error_lists_the_registered_types(leaf_types, registered):
    with pytest.raises(TypeError, match=r"value\[0\]: unsupported leaf of type str") as info:
        ValueTreeSignature.from_value(["text"], leaf_types=leaf_types)
    assert registered in str(info.value)


@pytest.mark.parametrize(
    "value, path",
    [
        ({"k": None}, r"value\['k'\]"),
        (Point(torch.zeros(1), None), r"value\.y"),
        ([None], r"value\[0\]"),
    ],
    ids=["dict", "namedtuple", "list"],
)
def test_allow_none_false_refuses_none_at_any_depth(value, path):
    with pytest.raises(TypeError, match=path + ": unsupported leaf of type NoneType"):
        ValueTreeSignature.from_value(value, allow_none=False)
    ValueTreeSignature.from_value(value)  # allowed by default


def test_unsupported_leaf_in_a_namedtuple_names_its_field():
    with pytest.raises(TypeError, match=r"^value\.y: unsupported leaf of type str"):
        ValueTreeSignature.from_value(Point(torch.zeros(1), "text"))


def test_registered_leaves_inside_a_namedtuple():
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 2)
    x = torch.zeros(3)
    sig = signature(Point(q, x))
    assert [c.kind for c in sig.children] == ["value", "tensor"]
    # Registered leaves have no generated fast path: the full walk collects the tensors.
    flat = sig.flatten(Point(q, x))
    assert [id(t) for t in flat] == [id(q.data), id(q.scale), id(x)]
    rebuilt = sig.rebuild(flat)
    assert type(rebuilt) is Point and type(rebuilt.x) is QuantizedTensor
    assert rebuilt.x.data is q.data and rebuilt.x.block == 2 and rebuilt.y is x
    bad = Point(QuantizedTensor(torch.zeros(5, dtype=torch.int8), torch.ones(1), 2), x)
    assert mismatches_of(sig, bad) == [Mismatch("value.x.data", "shape", (4,), (5,))]


def test_a_sparse_tensor_inside_a_registered_leaf_names_its_path():
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8).to_sparse(), torch.ones(1), 2)
    with pytest.raises(
        cudagraphs.CudaGraphsTypeError, match=r"^value\[0\]\.data: a torch.sparse_coo tensor"
    ):
        signature([q])


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


# ---- the generated fast path (matcher.py) ---------------------------------------------


@settings(max_examples=50, deadline=None)
@given(tree=trees())
def test_fast_path_and_extract_agree_with_the_full_walk(tree):
    sig = ValueTreeSignature.from_value(tree, leaf_types=LEAF_TYPES)
    slow: list = []
    problems: list = []
    sig._collect(tree, "value", problems, slow)
    assert problems == []
    fast = sig.flatten(tree)
    assert len(fast) == len(slow) and all(a is b for a, b in zip(fast, slow))
    extracted = sig.extract(tree)
    assert len(extracted) == len(slow) and all(a is b for a, b in zip(extracted, slow))


def test_fast_path_exists_only_without_registered_leaves():
    plain = ValueTreeSignature.from_value({"a": [torch.zeros(2), (torch.ones(3),)]})
    assert plain._matcher() is not None and plain._matcher(checks=False) is not None
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 32)
    with_leaf = ValueTreeSignature.from_value({"q": q}, leaf_types=LEAF_TYPES)
    assert with_leaf._matcher() is None
    assert len(with_leaf.extract({"q": q})) == 2  # falls back to the full walk


def test_flatten_of_a_match_takes_the_generated_path_compiled_once(monkeypatch):
    # The replay path: no tree walk for a matching value, one generated function per
    # signature and mode, kept on the signature.
    from cudagraphs.program import signature as signature_module

    compiled, compile_matcher = [], signature_module.compile_matcher

    def counting(*args, **kwargs):
        compiled.append(1)
        return compile_matcher(*args, **kwargs)

    monkeypatch.setattr(signature_module, "compile_matcher", counting)
    value = _plain_tree()
    sig = signature(value)

    def refuse(*args, **kwargs):
        raise AssertionError("the full walk ran for a matching value")

    monkeypatch.setattr(ValueTreeSignature, "_collect", refuse)
    for _ in range(3):
        assert len(sig.flatten(value)) == 5
        assert len(sig.extract(value)) == 5
    assert len(compiled) == 2  # one checking matcher, one extractor


def test_extract_trusts_the_value_and_flatten_still_checks():
    # extract() skips the metadata checks (replay(validate=False)); flatten() on the
    # same signature must not pick up that trusting function, in either order.
    good, other_shape = [torch.zeros(2, 3)], [torch.zeros(4)]
    for first in ("flatten", "extract"):
        sig = signature(good)
        getattr(sig, first)(good)
        for _ in range(2):
            assert sig.extract(other_shape)[0] is other_shape[0]
            with pytest.raises(SignatureMismatchError, match=r"value\[0\]: shape"):
                sig.flatten(other_shape)


def test_fast_path_rejections_fall_back_to_the_full_report():
    sig = ValueTreeSignature.from_value((torch.zeros(2, 3), {"k": torch.zeros(4)}))
    sparse = torch.zeros(2, 3).to_sparse()  # stride() raises inside the matcher
    with pytest.raises(SignatureMismatchError) as info:
        sig.flatten((sparse, {"k": torch.zeros(5)}))
    fields = {(m.path, m.field) for m in info.value.mismatches}
    assert ("value[0]", "layout") in fields
    assert ("value[1]['k']", "shape") in fields


# ---- the replay path's validator (generated structure checks + torch's tensor guard) --


def _learned_validator(value):
    from cudagraphs.program.matcher import InputValidator

    validator = InputValidator(signature(value))
    validator(value, "value")  # the full check passes; the guard learns these tensors
    return validator


@SETTINGS
@given(one_mutation())
def test_validator_after_learning_finds_every_mismatch(case):
    value, mutated, path, field = case
    validator = _learned_validator(value)
    assert all(t is u for t, u in zip(validator(value, "value"), leaf_tensors(value)))
    with pytest.raises(SignatureMismatchError) as info:
        validator(mutated, "value")
    assert any(m.path == path and m.field == field for m in info.value.mismatches)


@SETTINGS
@given(trees())
def test_validator_returns_what_flatten_returns(value):
    validator = _learned_validator(value)
    fresh = map_tensors(value, shifted)
    got = validator(fresh, "value")
    want = signature(value).flatten(fresh)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))


def _plain_tree(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": [torch.randn(3, generator=g) for _ in range(4)], "b": (torch.randn(2, 2),)}


@pytest.mark.parametrize(
    "edit, path, field",
    [
        (lambda v: {**v, "b": (torch.randn(2, 3),)}, "value['b'][0]", "shape"),
        (lambda v: {**v, "b": (torch.randn(2, 2).double(),)}, "value['b'][0]", "dtype"),
        (lambda v: {**v, "b": (torch.randn(2, 2).t(),)}, None, None),  # same shape, strides swap
        (
            lambda v: {**v, "b": (torch.randn(2, 2, requires_grad=True),)},
            "value['b'][0]",
            "requires_grad",
        ),
        (lambda v: {**v, "b": ("text",)}, "value['b'][0]", "type"),
        (lambda v: {**v, "b": [v["b"][0]]}, "value['b']", "type"),
        (lambda v: {"a": v["a"]}, "value", "keys"),
    ],
)
def test_validator_guard_misses_fall_back_to_the_full_check(edit, path, field):
    from cudagraphs.program.matcher import InputValidator

    value = _plain_tree()
    validator = InputValidator(signature(value))
    validator(value, "value")
    assert validator._guard is not None  # learned from the tensors that passed
    with pytest.raises(SignatureMismatchError) as info:
        validator(edit(value), "value")
    if path is not None:
        assert any(m.path == path and m.field == field for m in info.value.mismatches), (
            info.value.mismatches
        )


def test_validator_stops_relearning_after_a_few_rebuilds():
    from cudagraphs.program import matcher

    value = _plain_tree()
    validator = matcher.InputValidator(signature(value))
    as_double = map_tensors(value, lambda t: t.double().float())  # same metadata
    for _ in range(3 * matcher._MAX_GUARD_REBUILDS):
        validator(value, "value")
        validator(as_double, "value")
    assert validator._rebuilds == 1  # same metadata: learned once, then guard hits
    with_grad = map_tensors(value, lambda t: t.clone().requires_grad_())
    sig_rg = signature(with_grad)
    alternating = matcher.InputValidator(sig_rg)
    for _ in range(3 * matcher._MAX_GUARD_REBUILDS):
        alternating(with_grad, "value")
        alternating(map_tensors(with_grad, lambda t: t.detach().requires_grad_()), "value")
    assert alternating._rebuilds <= matcher._MAX_GUARD_REBUILDS


def test_validator_without_torchs_guard_is_still_correct(monkeypatch):
    from cudagraphs.program import matcher

    monkeypatch.setattr(matcher, "_tensor_guard", lambda tensors: None)
    value = _plain_tree()
    validator = matcher.InputValidator(signature(value))
    for _ in range(3):
        assert len(validator(value, "value")) == 5
    with pytest.raises(SignatureMismatchError, match=r"value\['b'\]"):
        validator({**value, "b": (torch.randn(2, 3),)}, "value")
