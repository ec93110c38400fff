"""The totals of a partial manager's stats() (partial/stats.py), from the targets'
dispatchers and recordings and the blocks."""

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudagraphs.core.runtime import SetupSeconds
from cudagraphs.partial.contract import ContractSet
from cudagraphs.partial.recording import RecordedVariant, TargetRecording
from cudagraphs.partial.replay import TargetDispatcher
from cudagraphs.partial.stats import stats_of
from cudagraphs.partial.vocabulary import NarrowedBlock, SkippedBlock, Target


def _entry(name, graphs=1, off_reason=None, replayed=0, fallbacks=()):
    rec = TargetRecording(Target(name, nn.Linear(2, 2), "attention"), ContractSet())
    rec.variants = [RecordedVariant(None, None, graph=object()) for _ in range(graphs)]
    rec.off_reason = off_reason
    dispatcher = TargetDispatcher(rec)
    for _ in range(replayed):
        dispatcher.counter.replay()
    for reason in fallbacks:
        dispatcher.counter.fallback(reason)
    return dispatcher


def _skipped(name, reason):
    return SkippedBlock(name, "Block", reason, "detail")


def _narrowed(name, reason):
    return NarrowedBlock(name, "Block", "layer", ("attention",), reason, "detail")


def test_nothing_gives_the_four_base_counts():
    assert stats_of([], [], [], None) == {
        "captured": 0,
        "disabled": 0,
        "replayed": 0,
        "fallbacks": 0,
    }


def test_every_block_and_target_of_one_reason_is_counted():
    entries = [
        _entry("a", graphs=2, off_reason="slower_than_eager", replayed=3, fallbacks=["shape"]),
        _entry("b", off_reason="slower_than_eager", replayed=1, fallbacks=["shape", "alias"]),
        _entry("c", graphs=0),
    ]
    skipped = [_skipped(f"s{i}", "no_graph_safe_scope") for i in range(3)]
    skipped.append(_skipped("s3", "nothing_asked"))
    narrowed = [_narrowed("n0", "eager_experts"), _narrowed("n1", "eager_experts")]
    assert stats_of(entries, skipped, narrowed, False) == {
        "captured": 3,
        "disabled": 0,
        "replayed": 4,
        "fallbacks": 3,
        "fallback_alias": 1,
        "fallback_shape": 2,
        "skipped_no_graph_safe_scope": 3,
        "skipped_nothing_asked": 1,
        "narrowed_eager_experts": 2,
        "off_slower_than_eager": 2,
    }


def test_disabled_graphs_count_as_none_captured():
    stats = stats_of([_entry("a", graphs=2)], [], [], True)
    assert stats == {"captured": 0, "disabled": 1, "replayed": 0, "fallbacks": 0}


def _graphed(setup):
    # What a core graphed callable exposes to the stats: its graphs' shared set-up.
    return SimpleNamespace(graphs=SimpleNamespace(setup=setup, eager_only=True))


def test_set_up_seconds_are_summed_once_per_capture_call_in_milliseconds():
    first = SetupSeconds(warmup=2.5, compile=2.0, capture=0.25, compiled_frames=2)
    second = SetupSeconds(warmup=0.5, compile=0.0, capture=0.125)
    a, b = _entry("a", graphs=2), _entry("b")
    # Target a's two variants came from one call (one shared record), b's from another.
    a.recording.variants[0].graph = _graphed(first)
    a.recording.variants[1].graph = _graphed(first)
    b.recording.variants[0].graph = _graphed(second)
    stats = stats_of([a, b], [], [], False)
    assert stats["warmup_ms"] == 3000
    assert stats["compile_ms"] == 2000
    assert stats["capture_ms"] == 375
    assert stats["compiled_frames"] == 2


def test_no_set_up_keys_without_core_graphs():
    stats = stats_of([_entry("a")], [], [], False)
    assert not {"warmup_ms", "compile_ms", "capture_ms", "compiled_frames"} & set(stats)


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 9)
        ),
        min_size=1,
        max_size=4,
    ),
    owners=st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_set_up_sums_match_a_sum_over_the_distinct_calls(calls, owners):
    # Each graph belongs to one capture call (owner index); graphs of one call share its
    # record. Reference: each call that made a graph counted once.
    setups = [SetupSeconds(w / 1000, c / 1000, p / 1000, f) for w, c, p, f in calls]
    owners = [o % len(setups) for o in owners]
    entries = []
    for i, owner in enumerate(owners):
        entry = _entry(f"t{i}")
        entry.recording.variants[0].graph = _graphed(setups[owner])
        entries.append(entry)
    used = [setups[o] for o in sorted(set(owners))]
    stats = stats_of(entries, [], [], False)
    assert stats["warmup_ms"] == round(1000 * sum(s.warmup for s in used))
    assert stats["compile_ms"] == round(1000 * sum(s.compile for s in used))
    assert stats["capture_ms"] == round(1000 * sum(s.capture for s in used))
    assert stats["compiled_frames"] == sum(s.compiled_frames for s in used)
