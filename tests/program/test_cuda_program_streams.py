"""CudaGraphProgram on a real GPU: prefetch (copy_inputs_from, replay_prepared) and the
ordering of every write into the fixed input buffer across streams.

Replays run the kernels that eager execution runs, so every comparison with eager is
bitwise (``torch.equal``). Inputs are drawn on the CPU, so values do not depend on the
CUDA generator's state (some tests break captures on purpose).
"""

import pytest
import torch

from cudagraphs import (
    CopyHandle,
    CudaGraphInputError,
)
from helpers.asserts import assert_bitwise_equal
from helpers.program_cuda import (
    SLEEP_CYCLES,
    _capture,
    _pinned,
    _randn,
    _scale_shift,
)

pytestmark = pytest.mark.cuda

POOL_MODES = [pytest.param(False, id="own_pool"), pytest.param(True, id="shared_pool")]


# ---- 3. prefetch: copy_inputs_from + replay_prepared ------------------------------------


def _affine_tanh(w):
    def affine_tanh(x, b):
        return torch.tanh(x @ w) + b

    return affine_tanh


def test_prefetch_pinned_inputs_on_transfer_stream():
    fn = _affine_tanh(_randn(64, 64, seed=99))
    program = _capture(fn, _randn(128, 64), _randn(64, seed=1))
    steps = [(_pinned(128, 64, seed=10 + i), _pinned(64, seed=20 + i)) for i in range(6)]
    transfer, compute = torch.cuda.Stream(), torch.cuda.Stream()
    owned, checks = [], []
    try:
        for x, b in steps:
            handle = program.copy_inputs_from(x, b, stream=transfer, non_blocking=True)
            assert isinstance(handle, CopyHandle)
            with torch.cuda.stream(compute):
                borrowed = program.replay_prepared(copy_handle=handle)
                checks.append(borrowed.sum(0))  # consumed on the compute stream
                owned.append(program.replay_prepared(copy_handle=handle, copy_output=True))
        torch.cuda.synchronize()
        for i, ((x, b), out, check) in enumerate(zip(steps, owned, checks)):
            expected = fn(x.cuda(), b.cuda())
            assert_bitwise_equal(out, expected, f"prefetched step {i}")
            assert_bitwise_equal(check, expected.sum(0), f"borrowed output at step {i}")
        last = fn(*(t.cuda() for t in steps[-1]))
        assert_bitwise_equal(program.output, last, "borrowed output after the loop")
    finally:
        program.close()


def test_stale_and_foreign_copy_handles_are_rejected():
    program = _capture(_scale_shift, _randn(512))
    other = _capture(_scale_shift, _randn(512))
    a, b, c = (_randn(512, seed=s) for s in (1, 2, 3))
    try:
        # Both programs made exactly one copy: only the owner tells the handles apart.
        foreign = other.copy_inputs_from(c)
        h_a = program.copy_inputs_from(a)
        with pytest.raises(CudaGraphInputError, match="copy_handle was made by another program"):
            program.replay_prepared(copy_handle=foreign)
        assert_bitwise_equal(program.replay_prepared(copy_handle=h_a), _scale_shift(a), "h_a")
        assert_bitwise_equal(other.replay_prepared(copy_handle=foreign), _scale_shift(c), "c")

        h_b = program.copy_inputs_from(b)
        with pytest.raises(CudaGraphInputError, match=r"copy_handle is stale \(payload 1, .* 2\)"):
            program.replay_prepared(copy_handle=h_a)  # older than h_b
        assert_bitwise_equal(program.replay_prepared(copy_handle=h_b), _scale_shift(b), "h_b")
        assert_bitwise_equal(program.replay_prepared(), _scale_shift(b), "current payload")

        h_c = program.copy_inputs_from(c)
        program.replay(a)  # replaces the payload h_c copied
        with pytest.raises(CudaGraphInputError, match="copy_handle is stale"):
            program.replay_prepared(copy_handle=h_c)
        assert_bitwise_equal(program.replay_prepared(), _scale_shift(a), "payload after replay")
    finally:
        program.close()
        other.close()


# ---- 3b. ordering of writes into the fixed input buffer ---------------------------------


def _slow_double(t):
    torch.cuda._sleep(SLEEP_CYCLES)  # the graph reads its input only after this
    return t * 2


def _slow_program():
    return _capture(_slow_double, _randn(4096), warmup=1)


def _event_after_sleep(cycles):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def test_replay_on_another_stream_does_not_overwrite_inputs_of_a_running_replay():
    program = _slow_program()
    x1, x2 = _randn(4096, seed=1), _randn(4096, seed=2)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(first):
            owned = program.replay(x1, copy_output=True)
        with torch.cuda.stream(second):
            program.replay(x2)
        torch.cuda.synchronize()
        assert_bitwise_equal(
            owned,
            x1 * 2,
            "first replay: a replay() from another stream copied its inputs "
            "into the buffer while the first replay still read it",
        )
        assert_bitwise_equal(program.output, x2 * 2, "second replay")
    finally:
        program.close()


def test_copy_inputs_from_waits_for_the_running_replay():
    program = _slow_program()
    x1, x2 = _randn(4096, seed=1), _randn(4096, seed=2)
    compute, transfer = torch.cuda.Stream(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(compute):
            owned = program.replay(x1, copy_output=True)
        handle = program.copy_inputs_from(x2, stream=transfer)
        torch.cuda.synchronize()
        assert_bitwise_equal(owned, x1 * 2, "replay running while the prefetch was issued")
        with torch.cuda.stream(compute):
            out = program.replay_prepared(copy_handle=handle, copy_output=True)
        torch.cuda.synchronize()
        assert_bitwise_equal(out, x2 * 2, "replay of the prefetched payload")
    finally:
        program.close()


@pytest.mark.parametrize("newer", ["replay", "copy_inputs_from"])
def test_an_older_delayed_copy_does_not_overwrite_a_newer_payload(newer):
    program = _slow_program()
    old, new = _randn(4096, seed=1), _randn(4096, seed=2)
    try:
        # The old copy waits for an event that fires half way through the replay below.
        delay = _event_after_sleep(SLEEP_CYCLES // 2)
        program.copy_inputs_from(old, stream=torch.cuda.Stream(), wait_for=delay)
        if newer == "replay":
            owned = program.replay(new, copy_output=True)
        else:
            handle = program.copy_inputs_from(new, stream=torch.cuda.Stream(), wait_for=[])
            owned = program.replay_prepared(copy_handle=handle, copy_output=True)
        torch.cuda.synchronize()
        assert_bitwise_equal(owned, new * 2, f"{newer} of the newest payload")
        # The payload a replay without a newer copy reads is still the newest one. (Under
        # in-graph staging replay() reads `new` in place and leaves the buffer alone.)
        again = program.replay_prepared(copy_output=True)
        torch.cuda.synchronize()
        assert_bitwise_equal(again, new * 2, "the payload at the end")
        if program.staging == "copy" or newer == "copy_inputs_from":
            assert_bitwise_equal(program._buffer.tensors[0], new, "input buffer at the end")
    finally:
        program.close()
