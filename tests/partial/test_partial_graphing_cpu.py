"""One capture() of a partial-graph manager on the CPU: the default backend's call of
the core, the capture scope, speed checks per group, CUDAGRAPHS_DISABLE and the exact
messages of a capture."""

import logging

import pytest
import torch

import cudagraphs.core
from cudagraphs.capture_state import is_graph_capturing
from cudagraphs.core.sharing import BufferSharing
from cudagraphs.errors import CudaGraphsStateError, CudaGraphsValueError, TargetSelectionError
from cudagraphs.partial import PartialCudaGraphManager, graphing
from cudagraphs.partial.build import build_recordings
from cudagraphs.partial.graphing import read_disabled
from cudagraphs.partial.replay import TargetDispatcher
from cudagraphs.partial.speed import SpeedCheck
from helpers.partial_core import FakeCore
from helpers.toy_models import Toy

LOGGER = "cudagraphs.partial.manager"
NARROW = ("attention", "moe_router")
TARGETS = ["layers.0.self_attn", "layers.1.self_attn"]


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)


@pytest.fixture
def disabled(monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")


def counting_backend(seen):
    """An eager backend that records whether it ran inside the capture scope."""

    def backend(callables, sample_args, sample_kwargs):
        seen.append(is_graph_capturing())
        return list(callables)

    return backend


def recorded(model=None, **kwargs):
    model = model or Toy()
    kwargs.setdefault("scopes", NARROW)
    mgr = PartialCudaGraphManager.from_model_parts(model, **kwargs)
    mgr.start_recording()
    model(torch.randn(2, 8))
    return model, mgr


def said(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


# --- read_disabled ----------------------------------------------------------------------


def changed(was, now):
    return (
        f"CUDAGRAPHS_DISABLE changed since this manager's first capture() (graphs were {was} "
        f"then, {now} now); one manager does not mix graphed and eager targets. Fixes: "
        "1. set CUDAGRAPHS_DISABLE before the first capture() and keep it; 2. close() this "
        "manager and build a new one."
    )


def test_read_disabled_turned_on_after_the_first_capture(disabled):
    assert read_disabled(None) is True and read_disabled(True) is True
    with pytest.raises(CudaGraphsStateError) as info:
        read_disabled(False)
    assert str(info.value) == changed("enabled", "disabled")


def test_read_disabled_turned_off_after_the_first_capture(enabled):
    assert read_disabled(None) is False and read_disabled(False) is False
    with pytest.raises(CudaGraphsStateError) as info:
        read_disabled(True)
    assert str(info.value) == changed("disabled", "enabled")


# --- calls_to_capture: a target that runs twice ---------------------------------------


def repeated(where):
    return (
        f"['layers.0.self_attn'] ran more than once {where}; one graph cannot stand for "
        "several calls of one forward (the second replay would overwrite the first one's "
        "outputs and saved activations). Fix: leave these modules out of the targets "
        "(scopes= without their scope, or an include= that does not name them)."
    )


def test_a_repeat_within_one_forward_is_refused_with_the_whole_message(enabled):
    _, mgr = recorded(Toy(twice=True), capture_backend=counting_backend([]))
    with pytest.raises(TargetSelectionError) as info:
        mgr.capture()
    assert str(info.value) == repeated("within one forward of the model")


def test_a_repeat_without_model_parts_explains_why_forwards_look_alike(enabled):
    model = Toy(twice=True)
    built = build_recordings([model], include=None, max_variants=4, scopes=NARROW)
    dispatchers = [TargetDispatcher(r) for r in built.recordings]
    mgr = PartialCudaGraphManager(dispatchers, capture_backend=counting_backend([]))
    mgr.start_recording()
    model(torch.randn(2, 8))
    with pytest.raises(TargetSelectionError) as info:
        mgr.capture()
    assert str(info.value) == repeated(
        "while recording (this manager was built without its model parts, so forwards "
        "cannot be told apart and gradient accumulation looks the same; build it with "
        "from_model_parts to record several micro-batches)"
    )


# --- capture_calls: scope, messages, groups ----------------------------------------------


@pytest.mark.parametrize(
    "pooled, tail", [(False, ""), (True, ", one pool each (activation checkpointing)")]
)
def test_a_capture_runs_in_the_capture_scope_and_says_how_many(enabled, caplog, pooled, tail):
    seen = []
    model, mgr = recorded(capture_backend=counting_backend(seen), activation_checkpointing=pooled)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr.capture()
    assert seen == ([True, True] if pooled else [True])
    assert said(caplog, logging.INFO) == [f"partial graphs: captured 2 call(s){tail}"]
    assert said(caplog, logging.WARNING) == []
    assert not mgr.dispatchers[0].warn_once.said("disabled")
    model(torch.randn(2, 8))
    assert mgr.stats()["captured"] == 2 and mgr.stats()["replayed"] == 2
    mgr.close()


def test_disabled_prepares_eagerly_outside_the_capture_scope(disabled, caplog, monkeypatch):
    seen = []
    monkeypatch.setattr(graphing, "eager_backend", counting_backend(seen))
    model, mgr = recorded(capture_backend=counting_backend([]))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr.capture()
    assert seen == [False], "the eager backend ran, outside the capture scope"
    assert said(caplog, logging.WARNING) == [
        "partial graphs are disabled (CUDAGRAPHS_DISABLE=1): the 2 target(s) of this "
        "manager run eagerly through the same recording, contract matching and counting, "
        "and no graph is captured; stats()['disabled'] is 1. Unset CUDAGRAPHS_DISABLE to "
        "graph them."
    ]
    assert said(caplog, logging.INFO) == ["partial graphs: prepared eagerly (disabled) 2 call(s)"]
    assert mgr.dispatchers[0].warn_once.said("disabled")
    model(torch.randn(2, 8))
    assert mgr.stats()["disabled"] == 1 and mgr.stats()["replayed"] == 2
    mgr.close()


def test_disabled_pooled_says_one_pool_each(disabled, caplog):
    _, mgr = recorded(capture_backend=counting_backend([]), activation_checkpointing=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr.capture()
    assert said(caplog, logging.INFO) == [
        "partial graphs: prepared eagerly (disabled) 2 call(s), one pool each "
        "(activation checkpointing)"
    ]
    mgr.close()


class SlowGraphs:
    """A fake clock that only graphed calls advance (one second each), so that every
    graph loses the speed check, and the backend whose graphs advance it."""

    def __init__(self):
        self.now, self.readings = 0.0, 0

    def clock(self):
        self.readings += 1
        return self.now

    def backend(self, callables, sample_args, sample_kwargs):
        def graphed(fn):
            def run(*args, **kwargs):
                self.now += 1.0
                return fn(*args, **kwargs)

            return run

        return [graphed(fn) for fn in callables]

    def check(self):
        return SpeedCheck(rounds=1, iters=1, warmup=0, clock=self.clock, synchronize=lambda: None)


@pytest.mark.parametrize("pooled", [False, True])
def test_every_group_is_speed_checked(enabled, caplog, pooled):
    slow = SlowGraphs()
    _, mgr = recorded(
        capture_backend=slow.backend, speed_check=slow.check(), activation_checkpointing=pooled
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mgr.capture()
    assert slow.readings > 0
    assert mgr.stats()["off_slower_than_eager"] == 2, "both targets (one group each if pooled)"
    (warning,) = said(caplog, logging.WARNING)
    assert warning.startswith("partial graphs: 2 target(s) ran slower graphed than eager")
    mgr.close()


def test_disabled_is_never_speed_checked(disabled, caplog):
    slow = SlowGraphs()
    model, mgr = recorded(capture_backend=slow.backend, speed_check=slow.check())
    mgr.capture()
    assert slow.readings == 0, "no timing of eager runs against themselves"
    model(torch.randn(2, 8))
    stats = mgr.stats()
    assert "off_slower_than_eager" not in stats and stats["replayed"] == 2, stats
    mgr.close()


# --- the default backend: the core's make_graphed_callables -------------------------------


def test_the_default_backend_hands_the_recorded_calls_to_the_core(enabled, monkeypatch):
    core = FakeCore()
    monkeypatch.setattr(cudagraphs.core, "make_graphed_callables", core)
    model, mgr = recorded()
    mgr.capture()
    ((modules, sample_args, sample_kwargs),) = core.calls
    assert isinstance(modules, tuple) and [m.__qualname__ for m in modules] == [
        f"partial[{n}]" for n in TARGETS
    ]
    assert isinstance(sample_args, tuple) and len(sample_args) == 2
    attn = model.layers[0].self_attn
    assert [id(p) for p in sample_args[0][0]] == [id(p) for p in attn.parameters()]
    assert sample_args[0][1].shape == (2, 8)
    assert sample_kwargs == [{}, {}]
    # Attention inputs are norms' outputs, never another target's: nothing chained,
    # incoming-gradient buffers shared by shape.
    assert core.sharing == [BufferSharing(grad_outputs=True, chained_inputs={})]
    # Lent gradients: owned copies could not take the place of the activations the
    # graphs hold in their pool (memory; .graphing).
    assert core.owned == [False]
    # The manager releases the cache around its captures itself; the core's own
    # release would remake eager workspaces the "model" scope never uses.
    assert core.release_cache == [False]
    model(torch.randn(2, 8))
    assert core.replays == 2 and mgr.stats()["replayed"] == 2
    mgr.close()


def test_the_default_backend_takes_a_single_result_for_one_callable(enabled, monkeypatch):
    core = FakeCore(bare=True)
    monkeypatch.setattr(cudagraphs.core, "make_graphed_callables", core)
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, scopes=("moe_router",), include="layers.0.self_attn"
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    assert len(core.calls) == 1 and len(core.calls[0][0]) == 1
    model(torch.randn(2, 8))
    assert core.replays == 1 and mgr.stats()["replayed"] == 1
    mgr.close()


def test_a_backend_with_the_wrong_count_is_refused(enabled):
    _, mgr = recorded(capture_backend=lambda c, a, k: list(c)[:1])
    with pytest.raises(CudaGraphsValueError) as info:
        mgr.capture()
    assert str(info.value) == (
        f"capture_backend returned 1 callable(s) for 2 call(s) ({TARGETS}); it must "
        "return one graphed callable per call, in order"
    )
