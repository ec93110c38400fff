"""The replay path's copy helper (CPU tensors behave the same here)."""

import torch

from cudagraphs.core.runtime import copy_into


def test_copies_sources_that_are_not_the_buffers():
    dsts = [torch.zeros(3), torch.zeros(2, 2)]
    copy_into(dsts, [torch.ones(3), torch.full((2, 2), 2.0)])
    assert dsts[0].tolist() == [1, 1, 1] and dsts[1].tolist() == [[2, 2], [2, 2]]


def test_skips_the_buffer_itself_and_none():
    buf = torch.arange(4.0)
    other = torch.zeros(2)
    copy_into([buf, other], [buf, None])
    assert buf.tolist() == [0, 1, 2, 3] and other.tolist() == [0, 0]


def test_a_transposed_view_of_the_buffer_is_copied_not_skipped():
    buf = torch.arange(4.0).reshape(2, 2)
    view = buf.t()  # same address and shape, other strides
    expected = view.clone()
    copy_into([buf], [view])
    assert torch.equal(buf, expected)
