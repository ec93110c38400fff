"""A program's copy-handle bookkeeping on the CPU: a handle of another program and a
handle whose payload was replaced are both refused, and told apart."""

import pytest

from cudagraphs import CopyHandle, CudaGraphInputError


def _handle(token, generation):
    return CopyHandle(program_token=token, generation=generation, event=None, sources=())


def test_the_latest_handle_of_the_program_passes():
    token = object()
    _handle(token, 3).check(token, 3, "step")


def test_a_foreign_handle_is_named_as_foreign_even_with_the_same_generation():
    mine, theirs = object(), object()
    with pytest.raises(CudaGraphInputError, match="program step: copy_handle was made by another"):
        _handle(theirs, 1).check(mine, 1, "step")


@pytest.mark.parametrize("generation", [1, 4])
def test_a_stale_handle_is_named_as_stale_with_both_payloads(generation):
    token = object()
    with pytest.raises(
        CudaGraphInputError,
        match=rf"copy_handle is stale \(payload {generation}, buffer now holds payload 3\)",
    ) as info:
        _handle(token, generation).check(token, 3, "step")
    assert "another program" not in str(info.value)


def test_a_foreign_stale_handle_is_reported_as_foreign():
    # Another program's handle is wrong whatever its generation: that is the fix to name.
    with pytest.raises(CudaGraphInputError, match="made by another program"):
        _handle(object(), 9).check(object(), 3, "step")
