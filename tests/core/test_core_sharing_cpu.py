"""Buffers shared between the entries of one capture, on the CPU: the request and its
check (core/sharing.py), the capture-side helpers (incoming-gradient buffers by shape,
gradients owned apart from them), the argument checks of make_graphed_callables that
run before any CUDA work, and the replay side of chained inputs (EntryGraphs: refused
calls, unchaining when the source is released). The GPU files capture real graphs."""

import pickle

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import cudagraphs
from cudagraphs import ChainedInputError, CudaGraphInputError, make_graphed_callables
from cudagraphs.core.capture_phase import (
    ForwardCapture,
    _grad_output_buffers,
    _owned,
    grad_output_key,
)
from cudagraphs.core.runtime import EntryGraphs
from cudagraphs.core.sharing import BufferSharing, chained_inputs, check_sharing
from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError, Mismatch
from helpers.dropin import past_the_argument_checks

CPU = torch.device("cpu")
ORDER_TEXT = (
    "_buffer_sharing.chained_inputs cannot be used with _order (an interleaved schedule "
    "may replay a source again before the chained entry's backward read its output); "
    "drop one of them"
)


def links(mapping, grad_outputs=False):
    return BufferSharing(grad_outputs=grad_outputs, chained_inputs=mapping)


# ---- check_sharing ---------------------------------------------------------------------
def test_none_shares_nothing_and_a_valid_request_is_returned_as_is():
    assert check_sharing(None, 0, ordered=False) is None
    assert check_sharing(None, 3, ordered=True) is None
    sharing = links({(1, 4): (0, 0), (2, 0): (0, 1)}, grad_outputs=True)
    assert check_sharing(sharing, 3, ordered=False) is sharing
    assert BufferSharing() == BufferSharing(grad_outputs=False, chained_inputs={})


@pytest.mark.parametrize("value", ["all", {(1, 0): (0, 0)}, True])
def test_anything_but_a_buffer_sharing_is_a_type_error(value):
    with pytest.raises(CudaGraphsTypeError) as info:
        check_sharing(value, 2, ordered=False)
    assert str(info.value) == (
        f"_buffer_sharing must be a BufferSharing or None, got {type(value).__name__}"
    )


@pytest.mark.parametrize(
    "link",
    [
        ((2, 0), (0, 0)),  # entry out of range
        ((1, 0), (2, 0)),  # source out of range
        ((-1, 0), (0, 0)),
        ((1, -1), (0, 0)),
        ((1, 0), (-1, 0)),
        ((1, 0), (0, -1)),
    ],
)
def test_entries_out_of_range_and_negative_indices_are_refused_naming_the_link(link):
    (entry, index), (source, out) = link
    with pytest.raises(CudaGraphsValueError) as info:
        check_sharing(links(dict([link])), 2, ordered=False)
    assert str(info.value) == (
        f"_buffer_sharing.chained_inputs[({entry}, {index})] = ({source}, {out}): "
        "entries are 0 to 1 and indices are not negative"
    )


@pytest.mark.parametrize("link", [((1, 0), (1, 0)), ((0, 3), (2, 1))])
def test_a_source_not_captured_before_its_entry_is_refused(link):
    (entry, index), (source, out) = link
    with pytest.raises(CudaGraphsValueError) as info:
        check_sharing(links({(2, 1): (0, 0), **dict([link])}), 3, ordered=False)
    assert str(info.value) == (
        f"_buffer_sharing.chained_inputs[({entry}, {index})] = ({source}, {out}): the "
        "source entry must come before the entry it feeds (it is captured, and "
        "replayed, first)"
    )


@pytest.mark.parametrize(
    "links",
    [[((1, 0), (0, 0))], {1: (0, 0)}, {(1, 0, 0): (0, 0)}, {(1, 0): 0}, {(True, 0): (False, 0)}],
    ids=["a list", "an int key", "a 3-tuple key", "an int value", "bool indices"],
)
def test_links_that_are_not_pairs_of_ints_are_a_type_error(links):
    with pytest.raises(CudaGraphsTypeError) as err:
        check_sharing(BufferSharing(chained_inputs=links), 4, ordered=False)
    assert str(err.value) == (
        "_buffer_sharing.chained_inputs must map (entry, tensor input index) to "
        f"(source entry, tensor output index), pairs of ints; got {links!r}"
    )


def test_chained_inputs_are_refused_under_an_order_but_shared_gradients_are_not():
    with pytest.raises(CudaGraphsValueError) as info:
        check_sharing(links({(1, 0): (0, 0)}), 2, ordered=True)
    assert str(info.value) == ORDER_TEXT
    alone = BufferSharing(grad_outputs=True)
    assert check_sharing(alone, 2, ordered=True) is alone


# ---- chained_inputs --------------------------------------------------------------------
def outputs(table):
    """outputs_of over ``{source: outputs}`` (missing: not captured), recording asks."""
    asked = []

    def outputs_of(source):
        asked.append(source)
        return table.get(source)

    return outputs_of, asked


def test_a_matching_link_gives_a_new_leaf_over_the_source_output():
    w = torch.ones(2, 3, requires_grad=True)
    out = w * 2  # a source output with autograd history
    sample = torch.randn(2, 3, requires_grad=True)
    outputs_of, asked = outputs({0: [torch.zeros(1), out]})
    found = chained_inputs(links({(1, 1): (0, 1)}), 1, [torch.randn(4), sample], outputs_of)
    assert list(found) == [1] and asked == [0]
    static, source = found[1]
    assert source == 0 and static is not out
    assert static.data_ptr() == out.data_ptr() and static.stride() == out.stride()
    assert static.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert static.is_leaf and static.grad_fn is None and static.requires_grad
    assert out.grad_fn is not None, "the source's autograd graph is untouched"


def test_indices_one_past_the_end_are_left_out():
    sample, out = torch.zeros(2), torch.ones(2)
    for link in ({(1, 1): (0, 0)}, {(1, 0): (0, 1)}):  # input 1 of 1; output 1 of 1
        sharing = BufferSharing(chained_inputs=link)
        assert chained_inputs(sharing, 1, [sample], lambda source: [out]) == {}


def test_the_leaf_takes_requires_grad_from_the_sample():
    out = torch.zeros(3, requires_grad=True)
    outputs_of, _ = outputs({0: [out]})
    found = chained_inputs(links({(1, 0): (0, 0)}), 1, [torch.zeros(3)], outputs_of)
    assert not found[0][0].requires_grad and out.requires_grad


def test_every_mismatch_leaves_the_link_out():
    sample = torch.zeros(3, 3)
    table = {
        0: [sample.clone()],  # matches: the one link kept
        1: [torch.zeros(3, 4)],  # shape
        2: [torch.zeros(3, 3, dtype=torch.float64)],  # dtype
        3: [torch.zeros(3, 3).t()],  # same shape, other strides
        4: [torch.empty(3, 3, device="meta")],  # device
    }
    outputs_of, asked = outputs(table)
    request = links({(9, n): (n, 0) for n in range(5)})
    found = chained_inputs(request, 9, [sample] * 5, outputs_of)
    assert list(found) == [0] and asked == [0, 1, 2, 3, 4]


def test_uncaptured_sources_out_of_range_indices_and_parameters_are_left_out():
    param = nn.Parameter(torch.zeros(3))
    outputs_of, asked = outputs({0: [torch.zeros(3)]})
    request = links(
        {
            (2, 0): (1, 0),  # source 1 not captured (None)
            (2, 1): (0, 0),  # the sample is a parameter: read in place anyway
            (2, 5): (0, 0),  # no input 5
            (2, 2): (0, 7),  # no output 7
            (3, 2): (0, 0),  # another entry's link: its source is not even asked
        }
    )
    found = chained_inputs(request, 2, [torch.zeros(3), param, torch.zeros(3)], outputs_of)
    assert found == {} and asked == [1, 0, 0, 0]
    assert chained_inputs(None, 2, [torch.zeros(3)], outputs_of) == {}


# ---- capture-side helpers --------------------------------------------------------------
def forward_capture(leaves, positions, differentiable):
    return ForwardCapture(
        graph=None,
        out_spec=pytree.tree_flatten(leaves)[1],
        out_leaves=leaves,
        out_tensor_positions=positions,
        out_differentiable=differentiable,
    )


def test_grad_output_key_is_shape_dtype_device_of_differentiable_outputs():
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.float16)
    fc = forward_capture([a, 3, b, torch.zeros(5)], (0, 2, 3), (True, False, True))
    assert grad_output_key(fc) == (
        ((2, 3), torch.float32, CPU),
        None,
        ((5,), torch.float32, CPU),
    )
    other = forward_capture([a + 1, 7, b + 1, torch.ones(5)], (0, 2, 3), (True, False, True))
    assert grad_output_key(other) == grad_output_key(fc), "values do not matter"
    flipped = forward_capture([a, 3, b, torch.zeros(5)], (0, 2, 3), (True, True, True))
    assert grad_output_key(flipped)[1] == ((4,), torch.float16, CPU)


def test_owned_copies_gradients_over_a_buffer_and_keeps_the_others():
    b1, b2 = torch.arange(4.0), torch.arange(6.0).reshape(2, 3)
    other = torch.ones(4)
    grads = (b1, b2[1], b1.detach(), other, None, b2.t())
    result = _owned(grads, [b1, b2])
    assert len(result) == 6
    for got, given in zip(result[:3] + result[5:], grads[:3] + grads[5:]):
        assert got is not given and torch.equal(got, given)
        assert got.untyped_storage().data_ptr() not in (
            b1.untyped_storage().data_ptr(),
            b2.untyped_storage().data_ptr(),
        )
    assert result[3] is other and result[4] is None
    assert _owned((other, None), []) == (other, None)


def test_grad_output_buffers_are_made_once_and_reused_when_they_fit():
    outs = [torch.ones(2, 3), torch.ones(4)]
    alone, made = _grad_output_buffers(outs, (True, False), None)
    assert made and alone[1] is None and torch.equal(alone[0], torch.zeros(2, 3))
    shared = []
    first, made = _grad_output_buffers(outs, (True, False), shared)
    assert made and shared == first and shared is not first and shared[0] is first[0]
    assert first[0] is not alone[0]
    again, made = _grad_output_buffers([torch.ones(2, 3), torch.ones(4)], (True, False), shared)
    assert not made and again[0] is first[0] and again[1] is None and again is not shared


@pytest.mark.parametrize(
    "outs, differentiable",
    [
        ([torch.ones(3, 2), torch.ones(4)], (True, False)),  # shape
        ([torch.ones(2, 3, dtype=torch.float64), torch.ones(4)], (True, False)),  # dtype
        ([torch.ones(2, 3)], (True,)),  # count
        ([torch.ones(2, 3), torch.ones(4)], (True, True)),  # another output differentiable
    ],
)
def test_grad_output_buffers_that_do_not_fit_are_made_and_replace_the_shared(outs, differentiable):
    shared = []
    old, _ = _grad_output_buffers([torch.ones(2, 3), torch.ones(4)], (True, False), shared)
    new, made = _grad_output_buffers(outs, differentiable, shared)
    assert made and new[0] is not old[0] and shared == new
    assert [None if b is None else tuple(b.shape) for b in new] == [
        tuple(o.shape) if d else None for o, d in zip(outs, differentiable)
    ]


# ---- make_graphed_callables: checked before CUDA ----------------------------------------
def two_layers():
    return (nn.Linear(4, 4), nn.Linear(4, 4))


def samples():
    return ((torch.randn(2, 4, requires_grad=True),), (torch.randn(2, 4, requires_grad=True),))


def test_a_sharing_of_the_wrong_type_is_refused_before_cuda():
    with pytest.raises(CudaGraphsTypeError) as info:
        make_graphed_callables(two_layers(), samples(), _buffer_sharing={(1, 0): (0, 0)})
    assert str(info.value) == "_buffer_sharing must be a BufferSharing or None, got dict"


def test_sharing_with_reused_buffers_is_refused_before_cuda():
    with pytest.raises(CudaGraphsValueError) as info:
        make_graphed_callables(
            two_layers(),
            samples(),
            _order=[1, -1],
            _reuse_graph_input_output_buffers=True,
            _buffer_sharing=BufferSharing(grad_outputs=True),
        )
    assert str(info.value) == (
        "_buffer_sharing and _reuse_graph_input_output_buffers both decide which entries "
        "share buffers; pass one of them"
    )


def test_links_are_checked_against_the_plan_before_cuda():
    with pytest.raises(CudaGraphsValueError) as info:
        make_graphed_callables(
            two_layers(), samples(), _order=[1, -1], _buffer_sharing=links({(1, 0): (0, 0)})
        )
    assert str(info.value) == ORDER_TEXT
    with pytest.raises(CudaGraphsValueError, match=r"\[\(1, 0\)\] = \(2, 0\): entries are 0"):
        make_graphed_callables(two_layers(), samples(), _buffer_sharing=links({(1, 0): (2, 0)}))
    # A valid request gets as far as the device checks.
    past_the_argument_checks(
        lambda: make_graphed_callables(
            two_layers(), samples(), _buffer_sharing=links({(1, 2): (0, 0)}, True)
        )
    )


# ---- EntryGraphs: chained inputs at replay ----------------------------------------------
class FakeGraph:
    def __init__(self):
        self.replays = self.resets = 0

    def replay(self):
        self.replays += 1

    def reset(self):
        self.resets += 1


def entry_graphs(static_inputs, chained, name="callables[1] (Layer)"):
    """An entry called as ``f(t0, 3, t1, t2, ...)``: a constant at leaf 1, so tensor
    index i >= 1 sits at path ``args[i + 1]``."""
    leaves = [static_inputs[0], 3, *static_inputs[1:]]
    spec = pytree.tree_flatten((tuple(leaves), {}))[1]
    positions = (0, *range(2, len(leaves)))
    return EntryGraphs(
        name=name,
        in_spec=spec,
        leaves=leaves,
        tensor_positions=positions,
        paths=tuple(f"args[{i}]" for i in range(len(leaves))),
        input_meta=tuple((t.shape, t.dtype, t.requires_grad) for t in static_inputs),
        static_inputs=list(static_inputs),
        params=(),
        fwd_graph=FakeGraph(),
        chained=chained,
    )


SOURCE = "callables[0] (Layer)"


def chained_pair():
    """A source's output, and an entry whose tensors 1 and 2 are chained to it."""
    out1, out2 = torch.arange(4.0), torch.arange(4.0) + 10
    static = [torch.zeros(4), out1.detach(), out2.detach()]
    return out1, out2, entry_graphs(static, ((1, SOURCE), (2, SOURCE)))


def test_the_buffer_itself_or_another_tensor_over_it_is_accepted_and_nothing_copied():
    out1, out2, g = chained_pair()
    g.replay_forward([torch.ones(4), g.static_inputs[1], g.static_inputs[2]])
    g.replay_forward([torch.full((4,), 2.0), out1, out2.view(4)])
    assert g.fwd_graph.replays == 2
    assert g.static_inputs[0].tolist() == [2, 2, 2, 2]
    assert out1.tolist() == [0, 1, 2, 3] and out2.tolist() == [10, 11, 12, 13]


def test_every_foreign_chained_input_is_named_and_nothing_is_copied_or_replayed():
    out1, out2, g = chained_pair()
    g.replay_forward([torch.ones(4), out1, out2])
    bad1, bad2 = torch.full((4,), 7.0), out2.clone()
    with pytest.raises(ChainedInputError) as info:
        g.replay_forward([torch.full((4,), 5.0), bad1, bad2])
    assert isinstance(info.value, CudaGraphInputError)
    expected = [
        Mismatch("args[2]", "chained input", f"the output of {SOURCE}", describe(bad1)),
        Mismatch("args[3]", "chained input", f"the output of {SOURCE}", describe(bad2)),
    ]
    assert info.value.mismatches == expected
    assert str(info.value) == (
        "callables[1] (Layer): an input captured as another graph's output is not that "
        f"output in 2 place(s):\n  {expected[0]}\n  {expected[1]}\nThe graph reads these "
        "inputs in place from the output of the graph named, so pass that output itself "
        "(as the captured step did); nothing was copied or replayed."
    )
    assert g.fwd_graph.replays == 1 and g.static_inputs[0].tolist() == [1, 1, 1, 1]
    assert out1.tolist() == [0, 1, 2, 3] and out2.tolist() == [10, 11, 12, 13]
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is ChainedInputError and copy.mismatches == expected


def describe(t):
    return f"Tensor {tuple(t.shape)} {t.dtype} at {t.data_ptr():#x}"


def test_a_view_of_the_buffer_with_other_strides_is_refused():
    out = torch.arange(4.0).reshape(2, 2)
    g = entry_graphs([torch.zeros(1), out.detach()], ((1, SOURCE),))
    with pytest.raises(ChainedInputError) as info:
        g.replay_forward([torch.zeros(1), out.t()])
    assert [(m.path, m.field) for m in info.value.mismatches] == [("args[2]", "chained input")]
    assert g.fwd_graph.replays == 0 and out.tolist() == [[0, 1], [2, 3]]


def test_unchain_drops_one_link_and_counts_the_buffer_as_its_own():
    _, _, g = chained_pair()
    g.buffer_bytes = 16  # its own input buffer: 4 float32
    g.unchain(1)
    assert g.chained == ((2, SOURCE),) and g.buffer_bytes == 32
    g.unchain(5)  # not chained: nothing changes
    g.unchain(1)  # already its own
    assert g.chained == ((2, SOURCE),) and g.buffer_bytes == 32


def test_releasing_the_source_unchains_its_dependents_which_then_copy_in():
    out1, out2, g = chained_pair()
    source = entry_graphs([torch.zeros(4)], (), name=SOURCE)
    source.out_leaves = [out1, out2]
    source.dependents = [(g, 1), (g, 2)]
    fwd = source.fwd_graph
    source.release()
    assert source.released and source.dependents == [] and fwd.resets == 1
    assert g.chained == () and not g.released
    g.replay_forward([torch.ones(4), torch.full((4,), 3.0), torch.full((4,), 4.0)])
    assert g.fwd_graph.replays == 1
    assert g.static_inputs[1].data_ptr() == out1.data_ptr(), "the same buffer, now its own"
    assert out1.tolist() == [3, 3, 3, 3] and out2.tolist() == [4, 4, 4, 4]
    source.release()  # idempotent, and a released dependent is left alone
    g.release()
    assert g.released and g.chained == ()


def test_chained_input_error_is_exported():
    assert cudagraphs.ChainedInputError is ChainedInputError
    assert "ChainedInputError" in cudagraphs.__all__
    assert issubclass(ChainedInputError, CudaGraphInputError)
