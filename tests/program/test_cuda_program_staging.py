"""In-graph staging of program inputs (``capture(staging=...)``) on a real GPU.

Under ``staging="graph"`` the graph copies each input from the caller's tensor, whose
address is set per replay. These tests check that a replay always reads the tensor
it was given, also with launches still queued, sources that cannot be bound, and the
prefetch path that writes the program's own buffer.
"""

import pytest
import torch

from cudagraphs import CudaGraphPool, CudaGraphProgram
from helpers.asserts import assert_bitwise_equal

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 50_000_000  # tens of milliseconds of GPU time on an H200


def _randn(*shape, seed=0, device="cuda", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _affine(x):
    return x * 3 + 1


def _two(x, y):
    return {"sum": x + y.float(), "y": y * 2}


@pytest.fixture
def program():
    p = CudaGraphProgram.capture(_affine, example_inputs=(_randn(4096),), staging="graph")
    yield p
    p.close()


def test_auto_stages_small_programs_in_the_graph_and_large_ones_by_copy():
    one = CudaGraphProgram.capture(_affine, example_inputs=(_randn(64),))
    many = CudaGraphProgram.capture(
        lambda xs: [x + 1 for x in xs], example_inputs=([_randn(8, seed=i) for i in range(8)],)
    )
    forced = CudaGraphProgram.capture(_affine, example_inputs=(_randn(64),), staging="copy")
    try:
        assert one.staging == "graph"
        assert many.staging == "copy"
        assert forced.staging == "copy"
    finally:
        for p in (one, many, forced):
            p.close()


def test_each_replay_reads_the_tensor_it_was_given(program):
    sources = [_randn(4096, seed=s) for s in range(4)]
    for i in range(12):
        x = sources[i % 4]
        assert_bitwise_equal(program.replay(x), _affine(x), f"replay {i}")
    # In-place changes to the same tensor are seen: the graph reads it at replay time.
    x = sources[0]
    x.add_(5)
    assert_bitwise_equal(program.replay(x), _affine(x), "after an in-place change")


def test_queued_launches_keep_their_own_sources(program):
    # A long kernel first, so every replay below is still queued when the next one
    # changes the memcpy node's source.
    sources = [_randn(4096, seed=s) for s in range(6)]
    torch.cuda._sleep(SLEEP_CYCLES)
    outs = [program.replay(x, copy_output=True) for x in sources]
    torch.cuda.synchronize()
    for i, (out, x) in enumerate(zip(outs, sources)):
        assert_bitwise_equal(out, _affine(x), f"queued replay {i}")


def test_the_same_source_twice_updates_the_node_once(program):
    x, y = _randn(4096, seed=1), _randn(4096, seed=2)
    staging = program._staging
    program.replay(x)
    before = staging.rebinds
    program.replay(x)
    program.replay(x)
    assert staging.rebinds == before
    program.replay(y)
    assert staging.rebinds == before + 1


@pytest.mark.parametrize("kind", ["cpu", "pinned", "own_output", "view_of_output"])
def test_sources_that_cannot_be_bound_are_copied(program, kind):
    program.replay(_randn(4096, seed=7))  # the node now points at a caller's tensor
    if kind == "cpu":
        x = _randn(4096, seed=3, device="cpu")
    elif kind == "pinned":
        x = _randn(4096, seed=3, device="cpu").pin_memory()
    else:
        # The graph-internal copy of the input is what the function reads; with
        # x * 3 + 1 the output is another buffer, so feed it back (and a view of it).
        program.replay(_randn(4096, seed=3))
        out = program.output
        x = out if kind == "own_output" else out[:]
    expected = _affine(x.cuda() if x.device.type == "cpu" else x.clone())
    assert_bitwise_equal(program.replay(x), expected, kind)
    y = _randn(4096, seed=4)
    assert_bitwise_equal(program.replay(y), _affine(y), f"the next replay after {kind}")


def test_identity_output_fed_back_is_copied_not_bound():
    # The output is the graph-internal copy itself: feeding it back would make the
    # node copy a buffer onto itself.
    program = CudaGraphProgram.capture(
        lambda x: x, example_inputs=(_randn(256),), staging="graph", check_first_replay=True
    )
    try:
        x = _randn(256, seed=5)
        out = program.replay(x)
        assert_bitwise_equal(out, x, "identity")
        again = program.replay(out)
        assert_bitwise_equal(again, x, "identity of its own output")
    finally:
        program.close()


def test_replay_prepared_after_replay_reads_the_bound_source(program):
    x = _randn(4096, seed=1)
    program.replay(x)
    del x  # the program keeps it alive while its node points at it
    torch.cuda.empty_cache()
    junk = _randn(4096 * 4, seed=9)  # would reuse freed memory
    out = program.replay_prepared(copy_output=True)
    assert_bitwise_equal(out, _affine(_randn(4096, seed=1)), "replay_prepared on the held source")
    del junk


def test_prefetch_after_bound_replays_reads_the_buffer(program):
    x, y = _randn(4096, seed=1), _randn(4096, seed=2)
    program.replay(x)
    transfer = torch.cuda.Stream()
    handle = program.copy_inputs_from(y.cpu().pin_memory(), stream=transfer)
    out = program.replay_prepared(copy_handle=handle, copy_output=True)
    assert_bitwise_equal(out, _affine(y), "prefetched payload after a bound replay")
    assert_bitwise_equal(program.replay(x), _affine(x), "bound again afterwards")


def test_two_inputs_of_different_dtypes():
    x, y = _randn(512), _randn(512, dtype=torch.float16)
    program = CudaGraphProgram.capture(_two, example_inputs=(x, y), staging="graph")
    try:
        assert len(program._staging.inputs) == 2
        for s in range(4):
            a, b = _randn(512, seed=s), _randn(512, seed=10 + s, dtype=torch.float16)
            got, want = program.replay(a, b), _two(a, b)
            assert_bitwise_equal(got["sum"], want["sum"], f"sum {s}")
            assert_bitwise_equal(got["y"], want["y"], f"y {s}")
        # One bound, one copied (a CPU source).
        a, b = _randn(512, seed=20), _randn(512, seed=21, dtype=torch.float16, device="cpu")
        got, want = program.replay(a, b), _two(a, b.cuda())
        assert_bitwise_equal(got["sum"], want["sum"], "mixed sum")
    finally:
        program.close()


def test_pool_programs_with_graph_staging_replay_in_any_order():
    pool = CudaGraphPool()
    fns = [_affine, lambda x: x.sin() * 2, lambda x: (x @ x.T).sum(0)]
    try:
        programs = [
            CudaGraphProgram.capture(f, example_inputs=(_randn(64, 64),), pool=pool) for f in fns
        ]
        assert all(p.staging == "graph" for p in programs)
        outs = {}
        for step, order in enumerate([(0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)]):
            for k in order:
                x = _randn(64, 64, seed=100 * step + k)
                outs[k] = (programs[k].replay(x), fns[k](x))
            for k, (got, want) in outs.items():
                assert_bitwise_equal(got, want, f"step {step}, program {k}")
    finally:
        pool.close()


def test_noncontiguous_example_is_staged_by_copy():
    x = _randn(32, 64).t()  # a transposed example: no 1-D memcpy can feed it
    program = CudaGraphProgram.capture(_affine, example_inputs=(x,), staging="auto")
    try:
        assert program.staging == "copy"
        y = _randn(32, 64, seed=3).t()
        assert_bitwise_equal(program.replay(y), _affine(y), "transposed input")
    finally:
        program.close()


def test_staging_graph_without_a_stageable_input_is_refused():
    with pytest.raises(ValueError, match="staging='graph'"):
        CudaGraphProgram.capture(_affine, example_inputs=(_randn(32, 64).t(),), staging="graph")


def test_a_delayed_prefetch_does_not_overwrite_a_later_prefetch_across_a_bound_replay(program):
    old, bound, newest = (_randn(4096, seed=s) for s in (1, 2, 3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES // 2)
        delay = torch.cuda.Event()
        delay.record(side)
    program.copy_inputs_from(old, stream=torch.cuda.Stream(), wait_for=delay)
    program.replay(bound)  # reads `bound` in place, writes no buffer
    handle = program.copy_inputs_from(newest, stream=torch.cuda.Stream())
    out = program.replay_prepared(copy_handle=handle, copy_output=True)
    torch.cuda.synchronize()
    assert_bitwise_equal(out, _affine(newest), "the newest prefetch, after the delayed one")
