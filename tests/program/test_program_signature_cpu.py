"""Signatures of graph-program input trees (CPU): what a signature describes, tensor
signatures, and leaves it refuses."""

from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cudagraphs
from cudagraphs.program import (
    LeafTypes,
    Mismatch,
    ReusableValueBuffer,
    SignatureMismatchError,
    TensorSignature,
    ValueTreeSignature,
)
from helpers.program_trees import (
    LEAF_TYPES,
    QuantizedTensor,
    leaf_tensors,
    map_tensors,
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
from helpers.signatures import (
    Unregistered,
    mismatches_of,
    one_mutation,
    signature,
    span_bytes,
)

SETTINGS = settings(max_examples=50, deadline=None)


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


def test_rebuilt_dicts_keep_the_described_values_key_order():
    # The function gets its input dicts, and the caller its output dicts, in their own
    # order (a, b = d.values() must not swap); flattening stays canonical.
    w, b = torch.zeros(2), torch.ones(3)
    sig = signature({"w": w, "b": b, "nested": {"z": w, "a": b}})
    assert sig.keys == ("b", "nested", "w")
    rebuilt = sig.rebuild(sig.flatten({"w": w, "b": b, "nested": {"z": w, "a": b}}))
    assert list(rebuilt) == ["w", "b", "nested"] and list(rebuilt["nested"]) == ["z", "a"]
    assert rebuilt["w"] is w and rebuilt["b"] is b
    # The same keys in another order still match the signature.
    assert signature({"b": b, "nested": {"a": b, "z": w}, "w": w}) == sig
