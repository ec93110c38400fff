"""The totals of a partial manager's stats() (partial/stats.py), from the targets'
dispatchers and recordings and the blocks."""

from torch import nn

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
