"""The replay path's copy helper (CPU tensors behave the same here)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from cudagraphs.core.runtime import copy_into, stage_grad_outputs
from helpers.asserts import CopyOps


def test_copies_sources_that_are_not_the_buffers():
    dsts = [torch.zeros(3), torch.zeros(2, 2)]
    copy_into(dsts, [torch.ones(3), torch.full((2, 2), 2.0)])
    assert dsts[0].tolist() == [1, 1, 1] and dsts[1].tolist() == [[2, 2], [2, 2]]


def test_staging_is_one_fused_copy_for_all_sources():
    # Inputs (forward) and incoming gradients (backward) are staged this way: one
    # launch per replay, however many tensors; sources already in place cost nothing.
    dsts = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(5), torch.zeros(1)]
    srcs = [torch.ones(3), torch.full((2, 2), 2.0), dsts[2], torch.full((1,), 4.0)]
    with CopyOps() as mode:
        copy_into(dsts, srcs)
    assert mode.ops == ["_foreach_copy_"]
    assert dsts[1].tolist() == [[2, 2], [2, 2]] and dsts[3].tolist() == [4]


def test_skips_the_buffer_itself_and_none():
    buf = torch.arange(4.0)
    other = torch.zeros(2)
    copy_into([buf, other], [buf, None])
    assert buf.tolist() == [0, 1, 2, 3] and other.tolist() == [0, 0]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_incoming_gradients_are_copied_and_unreached_buffers_zeroed_in_place():
    # The buffers hold the last replay's gradients: one that gets none this time must
    # read zeros, without a zero tensor of its size being made for it.
    dsts = [torch.full((3,), 7.0), torch.full((2, 2), 7.0), torch.full((4,), 7.0)]
    ptrs = [d.data_ptr() for d in dsts]
    grads = [torch.ones(3), None, None]
    with _Ops() as mode:
        stage_grad_outputs(dsts, grads)
    assert dsts[0].tolist() == [1, 1, 1]
    assert dsts[1].tolist() == [[0, 0], [0, 0]] and dsts[2].tolist() == [0, 0, 0, 0]
    assert [d.data_ptr() for d in dsts] == ptrs
    assert mode.ops == ["copy_", "_foreach_zero_"], mode.ops


def test_staging_with_every_gradient_given_zeroes_nothing():
    dsts = [torch.full((3,), 7.0), torch.full((2,), 7.0)]
    grads = [torch.ones(3), torch.full((2,), 2.0)]
    with _Ops() as mode:
        stage_grad_outputs(dsts, grads)
    assert mode.ops == ["_foreach_copy_"]
    assert dsts[1].tolist() == [2, 2]


def test_a_transposed_view_of_the_buffer_is_copied_not_skipped():
    buf = torch.arange(4.0).reshape(2, 2)
    view = buf.t()  # same address and shape, other strides
    expected = view.clone()
    copy_into([buf], [view])
    assert torch.equal(buf, expected)


def _entry(static_inputs, pinned):
    from torch.utils import _pytree as pytree

    from cudagraphs.core.runtime import EntryGraphs

    leaves, spec = pytree.tree_flatten((tuple(static_inputs), {}))
    return EntryGraphs(
        name="callables[0] (f)",
        in_spec=spec,
        leaves=leaves,
        tensor_positions=tuple(range(len(leaves))),
        paths=tuple(f"args[{i}]" for i in range(len(leaves))),
        input_meta=tuple((t.shape, t.dtype, t.requires_grad) for t in static_inputs),
        static_inputs=list(static_inputs),
        params=(),
        pinned=pinned,
        positional_only=True,
    )


def test_parameters_are_read_in_place_not_cloned():
    from cudagraphs.core.canonicalize import canonicalize
    from cudagraphs.core.capture_phase import _new_static_inputs

    weight = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(3)
    plan = canonicalize(lambda w, x: w * x, (weight, x))
    static = _new_static_inputs(plan.entries[0])
    # An alias over the parameter's storage: read in place, but a fresh autograd leaf,
    # so a capture never goes through the parameter's own AccumulateGrad node.
    assert static[0] is not weight and static[0].data_ptr() == weight.data_ptr()
    assert static[0].requires_grad and static[0].is_leaf
    # A Parameter itself, as the sample was: dynamo guards on an input's type, and a
    # compiled target warmed up on the parameter would recompile at capture otherwise.
    assert type(static[0]) is torch.nn.Parameter
    assert static[1] is not x and torch.equal(static[1], x)
    assert type(static[1]) is torch.Tensor


def test_a_parameter_subclass_is_aliased_as_a_plain_tensor():
    from cudagraphs.core.canonicalize import canonicalize
    from cudagraphs.core.capture_phase import _new_static_inputs

    class Sub(torch.nn.Parameter):
        pass

    weight = Sub(torch.randn(3))
    plan = canonicalize(lambda w: w * 2, (weight,))
    (static,) = _new_static_inputs(plan.entries[0])
    assert static is not weight and static.data_ptr() == weight.data_ptr()
    assert not isinstance(static, torch.nn.Parameter) and static.requires_grad


def test_a_frozen_parameters_alias_stays_frozen():
    from cudagraphs.core.canonicalize import canonicalize
    from cudagraphs.core.capture_phase import _new_static_inputs

    weight = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    plan = canonicalize(lambda w, x: w * x, (weight, torch.randn(3)))
    static = _new_static_inputs(plan.entries[0])
    assert type(static[0]) is torch.nn.Parameter and not static[0].requires_grad
    assert static[0].data_ptr() == weight.data_ptr()


def test_a_pinned_parameter_must_be_the_same_object_with_the_same_storage():
    import pytest

    from cudagraphs import CudaGraphInputError

    weight = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(3)
    alias = weight.detach().requires_grad_()
    entry = _entry([alias, x.clone()], pinned=((0, weight.data_ptr(), weight),))
    assert entry.user_tensors((weight, x), {})[0] is weight
    with pytest.raises(CudaGraphInputError, match=r"args\[0\] must be the parameter captured"):
        entry.user_tensors((torch.nn.Parameter(torch.randn(3)), x), {})
    weight.data = torch.randn(3)  # re-allocated storage, same object
    with pytest.raises(CudaGraphInputError, match="re-allocated"):
        entry.user_tensors((weight, x), {})


def test_static_tensors_are_inputs_outputs_and_gradients_but_no_parameter():
    from cudagraphs.memory import tensor_bytes

    x = torch.zeros(4, requires_grad=True)  # 16 bytes
    w = torch.nn.Parameter(torch.zeros(8))  # read in place: not static
    entry = _entry([x, w], pinned=((1, w.data_ptr(), w),))
    out = torch.zeros(3)  # 12 bytes
    grad_out, grad_x, grad_w = torch.zeros(3), torch.zeros(4), torch.zeros(8)
    entry.out_leaves, entry.out_tensor_positions = [out, "constant"], (0,)
    entry.static_grad_outputs = [grad_out, None]
    entry.diff_input_positions = (0, 1)
    # The differentiable inputs' gradients, then the module's own parameters'.
    entry.static_grad_inputs = (grad_x, grad_w, torch.zeros(100))
    got = entry.static_tensors()
    assert [id(t) for t in got] == [id(x), id(out), id(grad_out), id(grad_x)]
    assert tensor_bytes(got) == 16 + 12 + 12 + 16
    # A buffer shared as output and input counts once.
    entry.out_leaves = [x, "constant"]
    assert tensor_bytes(entry.static_tensors()) == 16 + 12 + 16


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_static_tensors_against_a_plain_reading_of_the_entry(data):
    n = data.draw(st.integers(1, 5))
    inputs = [torch.zeros(1 + i) for i in range(n)]
    pinned_at = data.draw(st.sets(st.integers(0, n - 1)))
    diff = tuple(sorted(data.draw(st.sets(st.integers(0, n - 1)))))
    entry = _entry(inputs, pinned=tuple((i, inputs[i].data_ptr(), inputs[i]) for i in pinned_at))
    outs = [torch.zeros(1) for _ in range(data.draw(st.integers(0, 3)))]
    tensor_at = tuple(sorted(data.draw(st.sets(st.integers(0, max(0, len(outs) - 1))))))
    entry.out_leaves, entry.out_tensor_positions = outs, tensor_at if outs else ()
    grad_outs = [data.draw(st.sampled_from([None, torch.zeros(2)])) for _ in range(3)]
    entry.static_grad_outputs = grad_outs
    input_grads = [torch.zeros(3) for _ in diff]
    param_grads = [torch.zeros(4) for _ in range(data.draw(st.integers(0, 2)))]
    entry.diff_input_positions = diff
    entry.static_grad_inputs = (*input_grads, *param_grads)
    expected = (
        [inputs[i] for i in range(n) if i not in pinned_at]
        + [outs[i] for i in entry.out_tensor_positions]
        + [g for g in grad_outs if g is not None]
        + [g for i, g in zip(diff, input_grads) if i not in pinned_at]
    )
    assert [id(t) for t in entry.static_tensors()] == [id(t) for t in expected]
