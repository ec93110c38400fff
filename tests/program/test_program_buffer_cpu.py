"""ReusableValueBuffer: fixed storage per input signature, refilled by copies (CPU)."""

import pytest
import torch

from cudagraphs.program import (
    ReusableValueBuffer,
    SignatureMismatchError,
    TensorSignature,
    ValueTreeSignature,
)
from helpers.asserts import CopyOps
from helpers.program_trees import LEAF_TYPES, QuantizedTensor, leaf_tensors, map_tensors, shifted


def buffer_for(value) -> ReusableValueBuffer:
    return ReusableValueBuffer(ValueTreeSignature.from_value(value, leaf_types=LEAF_TYPES), "cpu")


def shifted_tree(value):
    return map_tensors(value, shifted)


def mixed_tree():
    return {
        "f32": [torch.arange(6.0).reshape(2, 3), torch.full((4,), -1.5)],
        "f16": (torch.arange(4, dtype=torch.float16).reshape(2, 2).t(),),
        "i64": torch.arange(5, dtype=torch.int64) * 7,
        "bool": torch.tensor([True, False, True]),
        "q": QuantizedTensor(
            torch.arange(-3, 3, dtype=torch.int8).reshape(3, 2).t(), torch.tensor([0.25]), 4
        ),
    }


def test_storage_has_the_signature_topology():
    value = {
        "t": torch.zeros(3, 2).t(),
        "s": torch.zeros(4, 6, dtype=torch.float16)[:, ::2],
        "e": torch.zeros(0, 2, dtype=torch.int64),
        "g": torch.zeros(2, requires_grad=True),
    }
    buf = buffer_for(value)
    sigs = buf.signature.tensor_signatures()
    assert [TensorSignature.from_tensor(t) for t in buf.tensors] == sigs
    assert buf.value["t"].stride() == (1, 2) and not buf.value["t"].is_contiguous()
    assert buf.value["s"].stride() == (6, 2)
    assert buf.value["g"].requires_grad and buf.value["g"].is_leaf
    assert all(t.device == torch.device("cpu") for t in buf.tensors)
    assert buf.device == torch.device("cpu")
    assert buf.nbytes == buf.signature.nbytes == 24 + (1 + 3 * 6 + 2 * 2) * 2 + 0 + 8
    assert repr(buf) == f"ReusableValueBuffer(4 tensors, {buf.nbytes} bytes on cpu)"
    # The tree is built around the storage itself, not copies of it.
    assert all(a is b for a, b in zip(buf.signature.flatten(buf.value), buf.tensors))


def test_copies_keep_the_addresses_and_change_the_contents():
    value = mixed_tree()
    buf = buffer_for(value)
    addresses = [t.data_ptr() for t in buf.tensors]
    for payload in (value, shifted_tree(value), value):
        buf.copy_from(payload)
        assert [t.data_ptr() for t in buf.tensors] == addresses
        assert all(torch.equal(a, b) for a, b in zip(buf.tensors, leaf_tensors(payload)))


def test_mixed_dtypes_are_all_copied():
    value = mixed_tree()
    buf = buffer_for(value)
    buf.copy_from(value)
    assert buf.value["f32"][1].tolist() == [-1.5] * 4
    assert buf.value["f16"][0].tolist() == [[0.0, 2.0], [1.0, 3.0]]
    assert buf.value["i64"].tolist() == [0, 7, 14, 21, 28]
    assert buf.value["bool"].tolist() == [True, False, True]
    q = buf.value["q"]
    assert isinstance(q, QuantizedTensor) and q.block == 4
    assert q.data.dtype == torch.int8 and q.data.tolist() == [[-3, -1, 1], [-2, 0, 2]]
    assert q.scale.tolist() == [0.25]
    assert [t.dtype for t in buf.tensors] == [t.dtype for t in leaf_tensors(value)]


def test_copies_are_grouped_by_device_and_dtype():
    value = mixed_tree()  # float32 x2, one each of float16, int64, bool, int8, float32(scale)
    buf = buffer_for(value)
    with CopyOps() as mode:
        buf.copy_from(value)
    # float32 (3 tensors) in one fused launch; float16, int64, bool and int8 alone.
    assert sorted(mode.ops) == sorted(["_foreach_copy_"] + ["copy_"] * 4)


def test_a_source_that_is_the_buffer_itself_is_skipped():
    value = mixed_tree()
    buf = buffer_for(value)
    buf.copy_from(value)
    before = [t.clone() for t in buf.tensors]
    with CopyOps() as mode:
        buf.copy_from(buf.value)
    assert mode.ops == []
    assert all(torch.equal(a, b) for a, b in zip(buf.tensors, before))


def test_only_the_sources_that_are_not_the_buffer_are_copied():
    buf = buffer_for([torch.zeros(3), torch.zeros(3)])
    buf.copy_from([torch.ones(3), torch.ones(3)])
    with CopyOps() as mode:
        buf.copy_from([buf.value[0], torch.full((3,), 2.0)])
    assert mode.ops == ["copy_"]
    assert buf.value[0].tolist() == [1.0] * 3 and buf.value[1].tolist() == [2.0] * 3


def test_sources_that_require_grad_are_copied():
    value = [torch.arange(3.0, requires_grad=True), torch.ones(2, 2, requires_grad=True).t()]
    buf = buffer_for(value)
    assert all(t.requires_grad and t.is_leaf for t in buf.tensors)
    payload = [
        (torch.arange(3.0) * 2).requires_grad_(),
        torch.arange(4.0).reshape(2, 2).t().requires_grad_(),
    ]
    buf.copy_from(payload)
    assert buf.value[0].tolist() == [0.0, 2.0, 4.0] and buf.value[1].tolist() == [
        [0.0, 2.0],
        [1.0, 3.0],
    ]
    # The copy is data movement: the buffer stays an autograd leaf without history.
    assert all(t.requires_grad and t.is_leaf and t.grad_fn is None for t in buf.tensors)
    assert all(t.grad is None for t in payload)


def test_a_missing_requires_grad_is_a_mismatch_and_copies_nothing():
    buf = buffer_for([torch.zeros(2, requires_grad=True), torch.zeros(2)])
    buf.copy_from([torch.zeros(2, requires_grad=True), torch.zeros(2)])
    with pytest.raises(SignatureMismatchError) as info:
        buf.copy_from([torch.ones(2), torch.ones(2)])
    assert [(m.path, m.field) for m in info.value.mismatches] == [("inputs[0]", "requires_grad")]
    assert buf.value[0].tolist() == [0.0, 0.0] and buf.value[1].tolist() == [0.0, 0.0]


def test_non_blocking_copy_on_the_cpu():
    value = mixed_tree()
    buf = buffer_for(value)
    buf.copy_from(shifted_tree(value), non_blocking=True)
    assert all(torch.equal(a, b) for a, b in zip(buf.tensors, leaf_tensors(shifted_tree(value))))


def test_copy_tensors_takes_validated_sources_in_signature_order():
    buf = buffer_for({"b": torch.zeros(2), "a": torch.zeros(3, dtype=torch.int64)})
    buf.copy_tensors([torch.tensor([1, 2, 3]), torch.tensor([4.0, 5.0])])
    assert buf.value["a"].tolist() == [1, 2, 3] and buf.value["b"].tolist() == [4.0, 5.0]


def test_meta_sources_are_refused_with_every_other_difference():
    # The device is not part of a signature (CPU and CUDA sources both copy), but a
    # meta tensor holds no data: refused before the copy, beside its other differences.
    buf = buffer_for([torch.zeros(2, 3)])
    with pytest.raises(SignatureMismatchError) as info:
        buf.copy_from([torch.empty(3, 2, device="meta")])
    assert [(m.path, m.field) for m in info.value.mismatches] == [
        ("inputs[0]", "device"),
        ("inputs[0]", "shape"),
        ("inputs[0]", "stride"),
    ]


def test_expanded_views_cannot_be_buffered():
    expanded = torch.zeros(3).expand(2, 3)
    sig = ValueTreeSignature.from_value((torch.zeros(1), expanded))
    assert sig.tensor_signatures()[1].self_overlapping
    with pytest.raises(ValueError, match=r"input tensors \[1\] .* expanded views"):
        ReusableValueBuffer(sig, "cpu")


def test_copies_record_no_autograd_history_and_bump_no_versions():
    # A buffer that requires grad is copied into without autograd's in-place error; a
    # source that requires grad does not attach history to a buffer that does not.
    value = {"w": torch.zeros(3, requires_grad=True), "x": torch.zeros(3)}
    buf = ReusableValueBuffer(ValueTreeSignature.from_value(value), "cpu")
    buf.copy_from({"w": torch.ones(3, requires_grad=True), "x": torch.ones(3)})
    assert all(t.grad_fn is None for t in buf.tensors)
    plain = ReusableValueBuffer(ValueTreeSignature.from_value({"x": torch.zeros(3)}), "cpu")
    versions = [t._version for t in plain.tensors]
    plain.copy_tensors([torch.ones(3, requires_grad=True)])
    assert plain.tensors[0].grad_fn is None and not plain.tensors[0].requires_grad
    assert plain.tensors[0].tolist() == [1.0, 1.0, 1.0]
    # Like a graph replay writing captured memory, a refill is invisible to autograd.
    assert [t._version for t in plain.tensors] == versions
    with torch.enable_grad():
        buf.copy_tensors([torch.full((3,), 2.0), torch.full((3,), 3.0)])
    assert buf.value["w"].tolist() == [2.0] * 3 and buf.value["w"].grad_fn is None


def test_a_failed_copy_leaves_autograd_dispatch_as_it_was():
    # The copy runs below autograd; an error inside it must not leave that state behind.
    buf = ReusableValueBuffer(ValueTreeSignature.from_value([torch.zeros(3)] * 2), "cpu")
    with pytest.raises(RuntimeError):
        buf.copy_tensors([torch.ones(4), torch.ones(4)], may_alias=False)
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView)
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]
    plain = torch.zeros(2)
    plain.add_(1)
    assert plain._version == 1
    buf.copy_tensors([torch.ones(3), torch.full((3,), 2.0)], may_alias=False)
    assert [t.tolist() for t in buf.tensors] == [[1.0] * 3, [2.0] * 3]
