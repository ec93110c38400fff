"""Pipeline layout, schedules and buffer-slot assignment (pure policy, CPU only)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.core.schedule import (
    Step,
    assign_buffer_slots,
    build_layout,
    build_schedule,
)
from cudagraphs.errors import CudaGraphsValueError


def steps(schedule):
    return [(s.kind, s.entry) for s in schedule]


def test_unordered_schedule_forwards_then_reverse_backwards():
    layout = build_layout(3, 3)
    assert layout.num_chunks == 1 and layout.num_microbatches == 1
    assert steps(build_schedule(layout, training=True)) == [
        ("fwd", 0),
        ("fwd", 1),
        ("fwd", 2),
        ("bwd", 2),
        ("bwd", 1),
        ("bwd", 0),
    ]
    assert steps(build_schedule(layout, training=False)) == [("fwd", 0), ("fwd", 1), ("fwd", 2)]


def test_one_chunk_one_microbatch():
    layout = build_layout(2, 2, order=[1, -1])
    assert layout.layers_per_chunk == (2,)
    assert steps(build_schedule(layout, True)) == [("fwd", 0), ("fwd", 1), ("bwd", 1), ("bwd", 0)]


def test_two_chunks_one_microbatch_matches_hook_order_contract():
    layout = build_layout(2, 2, order=[1, 2, -2, -1])
    sched = build_schedule(layout, True)
    assert [(s.kind, s.callable_index) for s in sched] == [
        ("fwd", 0),
        ("fwd", 1),
        ("bwd", 1),
        ("bwd", 0),
    ]


def test_two_chunks_three_microbatches_interleaved_1f1b():
    order = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
    layout = build_layout(4, 12, order=order)  # 2 layers per chunk
    assert layout.layers_per_chunk == (2, 2) and layout.num_microbatches == 3
    # entries: chunk-major, then microbatch, then layer
    entries = layout.entries()
    assert [(e.chunk, e.microbatch, e.layer) for e in entries[:7]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (0, 2, 0),
        (0, 2, 1),
        (1, 0, 0),
    ]
    assert [e.callable_index for e in entries] == [0, 1] * 3 + [2, 3] * 3
    sched = build_schedule(layout, True)
    idx = layout.entry_index
    expected = [
        ("fwd", idx(0, 0, 0)),
        ("fwd", idx(0, 0, 1)),
        ("fwd", idx(1, 0, 0)),
        ("fwd", idx(1, 0, 1)),
        ("fwd", idx(0, 1, 0)),
        ("fwd", idx(0, 1, 1)),
        ("fwd", idx(1, 1, 0)),
        ("fwd", idx(1, 1, 1)),
        ("bwd", idx(1, 0, 1)),
        ("bwd", idx(1, 0, 0)),
        ("bwd", idx(0, 0, 1)),
        ("bwd", idx(0, 0, 0)),
        ("fwd", idx(0, 2, 0)),
        ("fwd", idx(0, 2, 1)),
        ("fwd", idx(1, 2, 0)),
        ("fwd", idx(1, 2, 1)),
        ("bwd", idx(1, 1, 1)),
        ("bwd", idx(1, 1, 0)),
        ("bwd", idx(0, 1, 1)),
        ("bwd", idx(0, 1, 0)),
        ("bwd", idx(1, 2, 1)),
        ("bwd", idx(1, 2, 0)),
        ("bwd", idx(0, 2, 1)),
        ("bwd", idx(0, 2, 0)),
    ]
    assert steps(sched) == expected
    assert sorted(e for k, e in steps(sched) if k == "fwd") == list(range(12))
    assert sorted(e for k, e in steps(sched) if k == "bwd") == list(range(12))


def test_num_layers_per_chunk_uneven():
    order = [1, 2, -2, -1, 1, 2, -2, -1]  # 2 chunks, 2 microbatches
    layout = build_layout(3, 6, order=order, num_layers_per_chunk=[1, 2])
    assert layout.layers_per_chunk == (1, 2)
    # chunk 0: entries 0 (mb0), 1 (mb1); chunk 1: 2,3 (mb0 layers 0,1), 4,5 (mb1)
    assert layout.entry_index(0, 1, 0) == 1
    assert layout.entry_index(1, 0, 1) == 3
    assert layout.entry_index(1, 1, 0) == 4
    assert [e.callable_index for e in layout.entries()] == [0, 0, 1, 2, 1, 2]
    sched = build_schedule(layout, True)
    assert steps(sched)[:6] == [
        ("fwd", 0),
        ("fwd", 2),
        ("fwd", 3),
        ("bwd", 3),
        ("bwd", 2),
        ("bwd", 0),
    ]


def test_inference_schedule_drops_backwards():
    layout = build_layout(2, 2, order=[1, 2, -2, -1])
    assert steps(build_schedule(layout, False)) == [("fwd", 0), ("fwd", 1)]


@pytest.mark.parametrize(
    "order, message",
    [
        ([], "non-empty"),
        ("12", "non-empty"),
        ([1, 0, -1], "never 0"),
        ([1, 2.0, -2, -1], r"2\.0 \(float\).*entries are ints"),
        ([-1, 1], "before its forward"),
        ([1, 2, -2, -1, 1, -1, 1], "as often forward as backward"),
        ([1, 1, -1, -1, 2, -2], "as often forward as backward"),
        ([2, -2], "as often forward as backward"),
    ],
)
def test_invalid_orders(order, message):
    with pytest.raises(ValueError, match=message):
        build_layout(2, 2, order=order)


def test_layout_count_errors():
    with pytest.raises(ValueError, match="sample_args has 3 entries but there are 2 callables"):
        build_layout(2, 3)
    with pytest.raises(ValueError, match="only meaningful together with _order"):
        build_layout(2, 2, num_layers_per_chunk=[2])
    with pytest.raises(ValueError, match="cannot be split evenly"):
        build_layout(3, 3, order=[1, 2, -2, -1])
    with pytest.raises(ValueError, match="must hold 2 positive ints"):
        build_layout(3, 3, order=[1, 2, -2, -1], num_layers_per_chunk=[3])
    with pytest.raises(ValueError, match="must hold 2 positive ints"):
        build_layout(3, 3, order=[1, 2, -2, -1], num_layers_per_chunk=[0, 3])
    with pytest.raises(ValueError, match="sums to 4 but there are 3"):
        build_layout(3, 3, order=[1, 2, -2, -1], num_layers_per_chunk=[2, 2])
    with pytest.raises(ValueError, match=r"needs 8 \(ordered by chunk"):
        build_layout(4, 4, order=[1, 2, -2, -1, 1, 2, -2, -1])


def test_buffer_slots_unordered_never_share():
    layout = build_layout(3, 3)
    sched = build_schedule(layout, True)
    assert assign_buffer_slots(sched, ["a", "a", "a"]) == [0, 1, 2]


def test_buffer_slots_interleaved_reuse_after_backward():
    order = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
    layout = build_layout(4, 12, order=order)
    sched = build_schedule(layout, True)
    keys = [e.callable_index for e in layout.entries()]
    slots = assign_buffer_slots(sched, keys)
    idx = layout.entry_index
    # Microbatches 0 and 1 are alive together; microbatch 2's forward comes after
    # microbatch 0's backward, so it takes microbatch 0's slot, layer by layer.
    for chunk in (0, 1):
        for layer in (0, 1):
            m0, m1, m2 = (slots[idx(chunk, m, layer)] for m in range(3))
            assert m0 != m1
            assert m2 == m0
    # different callables never share
    by_slot = {}
    for e, s in enumerate(slots):
        by_slot.setdefault(s, set()).add(keys[e])
    assert all(len(v) == 1 for v in by_slot.values())
    # the number of slots is what the schedule needs at most: 2 live microbatches x 4 layers
    assert len(set(slots)) == 8


def test_buffer_slots_respect_keys():
    # Same callable, different shapes (keys) -> no sharing even when lifetimes allow it.
    sched = [Step("fwd", 0, 0), Step("bwd", 0, 0), Step("fwd", 1, 0), Step("bwd", 1, 0)]
    assert assign_buffer_slots(sched, ["k", "k"]) == [0, 0]
    assert assign_buffer_slots(sched, ["k", "other"]) == [0, 1]


def test_buffer_slots_need_a_forward_for_every_entry():
    with pytest.raises(ValueError, match=r"entries \[1\] have no forward"):
        assign_buffer_slots([Step("fwd", 0, 0), Step("bwd", 0, 0)], ["a", "a"])


def test_bad_order_entries_are_listed_up_to_three_with_their_types():
    # The message quotes the first three entries that are not ints, with their types.
    match = r"_order holds 0\.5 \(float\), True \(bool\), '1' \(str\): entries are ints"
    with pytest.raises(ValueError, match=match):
        build_layout(2, 2, order=[0.5, True, "1", None, 1, -1])


def test_a_zero_in_order_is_named_by_position():
    with pytest.raises(ValueError, match=r"_order\[2\] is 0: .*never 0"):
        build_layout(2, 2, order=[1, -1, 0, 2, -2])


def test_numpy_integers_and_arrays_are_ints_of_order():
    np = pytest.importorskip("numpy")
    want = build_layout(4, 4, order=[1, 2, -2, -1], num_layers_per_chunk=[2, 2])
    for order in (np.array([1, 2, -2, -1]), [np.int64(1), np.int32(2), np.int8(-2), -1]):
        got = build_layout(4, 4, order=order, num_layers_per_chunk=np.array([2, 2]))
        assert got == want
        assert all(type(x) is int for x in got.order)
        assert all(type(n) is int for n in got.layers_per_chunk)


@pytest.mark.parametrize(
    "order, message",
    [
        # the second backward of chunk 1 has no forward: microbatch 1 (0-based)
        ([1, -1, -1, 1], r"_order\[2\] = -1 runs backward microbatch 1 of chunk 1 before"),
        # chunk ids in messages are the 1-based ids of _order
        ([1, -2, 2, -1], r"_order\[1\] = -2 runs backward microbatch 0 of chunk 2 before"),
    ],
)
def test_backward_before_forward_names_position_microbatch_and_chunk(order, message):
    with pytest.raises(ValueError, match=message):
        build_layout(2, 2, order=order)


@pytest.mark.parametrize(
    "order, found",
    [
        # chunk 1 sets the microbatch count (2); chunk 2 runs once
        ([1, 1, -1, -1, 2, -2], r"\(chunk 1: 2\); found \['chunk 2: 1 forwards, 1 backwards'\]"),
        # chunk 1 never runs: it has 0 microbatches, chunk 2 has 1
        ([2, -2], r"\(chunk 1: 0\); found \['chunk 2: 1 forwards, 1 backwards'\]"),
    ],
)
def test_uneven_chunks_are_named_with_their_counts(order, found):
    with pytest.raises(ValueError, match=found):
        build_layout(2, 2, order=order)


def test_a_forward_without_its_backward_is_rejected():
    # Chunk 2 runs 2 forwards but 1 backward: its backward count matches chunk 1's
    # microbatch count (1), only its forward count is off.
    with pytest.raises(ValueError, match=r"found \['chunk 2: 2 forwards, 1 backwards'\]"):
        build_layout(2, 2, order=[1, 2, -2, -1, 2])


def test_a_backward_before_its_forward_is_refused_by_entry():
    # build_schedule never makes one, but assign_buffer_slots is public: a hand-made
    # schedule gets the reason, not a bare KeyError.
    with pytest.raises(
        CudaGraphsValueError, match="entry 0: its backward comes before its forward"
    ):
        assign_buffer_slots([Step("bwd", 0, 0), Step("fwd", 0, 0)], ["a"])


def _reference_order_check(order):
    """What makes an _order valid, written plainly: (chunks, microbatches) or None."""
    if not order or any(x == 0 for x in order):
        return None
    chunks = max(abs(x) for x in order)
    forwards = [sum(1 for x in order if x == c) for c in range(1, chunks + 1)]
    backwards = [sum(1 for x in order if x == -c) for c in range(1, chunks + 1)]
    if len(set(forwards + backwards)) != 1 or forwards[0] == 0:
        return None
    for end in range(len(order) + 1):  # no backward before its forward, at any point
        prefix = order[:end]
        if any(prefix.count(-c) > prefix.count(c) for c in range(1, chunks + 1)):
            return None
    return chunks, forwards[0]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=12))
def test_order_validation_agrees_with_a_plain_reference(order):
    want = _reference_order_check(order)
    if want is None:
        # The order's own error (each starts "_order"), not a count of sample_args.
        chunks = max(abs(x) for x in order) or 1
        with pytest.raises(ValueError, match=r"^_order"):
            build_layout(chunks, chunks * max(1, order.count(1)), order=order)
        return
    chunks, micro = want
    layout = build_layout(chunks, chunks * micro, order=order)
    assert layout.num_microbatches == micro and layout.layers_per_chunk == (1,) * chunks
    schedule = build_schedule(layout, training=True)
    # Every entry is run forward once and backward once, backward after forward.
    seen = {}
    for pos, step in enumerate(schedule):
        seen.setdefault(step.entry, []).append((step.kind, pos))
    assert len(seen) == chunks * micro
    assert all([k for k, _ in v] == ["fwd", "bwd"] for v in seen.values())


@st.composite
def _interleavings(draw):
    """A schedule of n entries, each forward before its backward, in a random order,
    and a key per entry drawn from a few."""
    n = draw(st.integers(1, 7))
    pending = list(range(n))
    live: list[int] = []
    steps = []
    while pending or live:
        start = bool(pending) and (not live or draw(st.booleans()))
        if start:
            e = pending.pop(draw(st.integers(0, len(pending) - 1)))
            steps.append(Step("fwd", e, 0))
            live.append(e)
        else:
            e = live.pop(draw(st.integers(0, len(live) - 1)))
            steps.append(Step("bwd", e, 0))
    keys = [draw(st.sampled_from(["a", "b", ("a",), 1])) for _ in range(n)]
    return steps, keys


@settings(max_examples=400, deadline=None)
@given(_interleavings())
def test_buffer_slots_never_share_across_keys_or_live_ranges_and_use_the_fewest(case):
    schedule, keys = case
    slots = assign_buffer_slots(schedule, keys)
    start = {s.entry: i for i, s in enumerate(schedule) if s.kind == "fwd"}
    end = {s.entry: i for i, s in enumerate(schedule) if s.kind == "bwd"}
    n = len(keys)
    for a in range(n):
        for b in range(a + 1, n):
            if slots[a] != slots[b]:
                continue
            assert keys[a] == keys[b], (a, b, keys, slots)  # equal keys, exact
            assert type(keys[a]) is type(keys[b])
            assert end[a] < start[b] or end[b] < start[a], (a, b, schedule, slots)
    # The fewest slots per key: the most entries of that key live at once.
    for key in {repr(k) for k in keys}:
        members = [e for e in range(n) if repr(keys[e]) == key]
        most = max(sum(1 for e in members if start[e] <= i <= end[e]) for i in range(len(schedule)))
        assert len({slots[e] for e in members}) == most
