"""Partial-graph dispatcher and manager details on the CPU: the texts of the fallback
reports (not captured yet, parameters replaced, contract mismatch), what recording
keeps for a non-FSDP target, graphs released on close, the defaults as they act,
recomputes said once, and log_stats."""

import logging

import pytest
import torch
from torch import nn

from cudagraphs.errors import CudaGraphsTypeError
from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_manager import (
    NARROW,
    KwToy,
    eager_backend,
    pinning_backend,
    recorded,
    step,
)
from helpers.toy_models import Toy

LOGGER = "cudagraphs.partial.manager"


def warnings_of(caplog, reason):
    return [r.getMessage() for r in caplog.records if f"(reason {reason!r})" in r.getMessage()]


def test_a_recorded_call_not_captured_yet_says_to_call_capture(caplog):
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    mgr.start_recording()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step(model, torch.randint(0, 128, (1, 12)))
    (said,) = warnings_of(caplog, "not_captured")
    assert (
        "the call matches variant 1, which was recorded but not captured yet (expected "
        "during a recording step). Fix: call capture() after the recording step." in said
    )
    mgr.close()


def test_a_contract_mismatch_names_the_variant_bound():
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW, max_variants=3
    )
    mgr.start_recording()
    step(model, torch.randint(0, 128, (1, 8)))
    mgr.capture()
    dispatcher = mgr.dispatchers[0]
    args, kwargs = (torch.randn(1, 5, 64),), {}
    report = dispatcher._fallback_report("shape", args, kwargs, None)
    assert "(at most max_variants=3 per target)" in report
    mgr.close()


def test_a_replaced_parameter_report_gives_both_fixes_and_the_eager_run_gets_keywords(caplog):
    model = KwToy()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=pinning_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    model.layers[0].self_attn.q.weight.data = torch.randn(8, 8)
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = model(x)
    assert mgr.stats()["fallback_param_storage"] == 1
    (said,) = warnings_of(caplog, "param_storage")
    assert (
        "Fixes: 1. change parameters in place (copy_, load_state_dict) rather than "
        "assigning .data or new Parameters; 2. build a new manager and capture again "
        "after the change." in said
    )
    assert "stats()['fallback_param_storage'] counts them all" in said
    mgr.close()
    assert torch.equal(out, model(x)), "the eager run got the mask keyword"


def test_recording_a_plain_target_keeps_no_parameter_copies():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    assert all(v.params == () for r in mgr.recordings for v in r.variants)
    mgr.close()


class Resettable:
    def __init__(self, fn):
        self.fn, self.was_reset = fn, False

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def reset(self):
        self.was_reset = True


def test_close_resets_each_graph_and_leaves_empty_records():
    made = []

    def backend(callables, sample_args, sample_kwargs):
        made.extend(Resettable(fn) for fn in callables)
        return made[-len(callables) :]

    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=backend, scopes=NARROW)
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    dispatcher = mgr.dispatchers[0]
    variant = dispatcher.recording.variants[0]
    assert dispatcher.swap is not None
    mgr.close()
    assert len(made) == 2 and all(g.was_reset for g in made)
    assert variant.graph is None and variant.params == ()
    assert dispatcher.swap is None and dispatcher.recording.variants == []


def test_the_defaults_as_they_act():
    mgr = PartialCudaGraphManager.from_model_parts(Toy(), scopes=NARROW)
    assert mgr.activation_checkpointing is False and mgr._speed_check is True
    assert all(r.contracts.max_variants == 4 for r in mgr.recordings)
    direct = PartialCudaGraphManager(mgr.dispatchers, model_parts=None)
    assert direct.activation_checkpointing is False and direct._speed_check is True


def test_the_dispatchers_must_be_dispatchers_named_by_type():
    with pytest.raises(
        CudaGraphsTypeError, match=r"dispatchers\[1\] must be a TargetDispatcher .*got str$"
    ):
        mgr = PartialCudaGraphManager.from_model_parts(Toy(), scopes=NARROW)
        PartialCudaGraphManager([mgr.dispatchers[0], "attn"])


def test_the_backend_given_is_the_one_used():
    used = []

    def backend(callables, sample_args, sample_kwargs):
        used.append(len(callables))
        return list(callables)

    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=backend, scopes=NARROW)
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    assert used == [2]
    mgr.close()


def test_a_recompute_is_said_once_at_info(caplog):
    mgr = PartialCudaGraphManager.from_model_parts(Toy(), scopes=NARROW)
    rec = mgr.recordings[1]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr._saw_recompute(rec)
        mgr._saw_recompute(rec)
    said = [r.getMessage() for r in caplog.records if "recomputed" in r.getMessage()]
    assert said == ["partial graphs: layers.1.self_attn is recomputed in backward"]
    assert mgr.activation_checkpointing is True


def test_log_stats_labels_the_phase(caplog):
    mgr = PartialCudaGraphManager.from_model_parts(Toy(), scopes=NARROW)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr.log_stats("step 3")
    assert [r.getMessage() for r in caplog.records] == [f"partial graphs [step 3]: {mgr.stats()}"]


def test_a_dispatcher_outside_a_manager_warns_on_the_managers_logger(caplog):
    mgr = PartialCudaGraphManager.from_model_parts(Toy(), scopes=NARROW)
    dispatcher = mgr.dispatchers[0]
    dispatcher.warn_once = None
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        dispatcher._warn("cause", "%s ran %d times", "x", 2)
    assert [r.getMessage() for r in caplog.records] == ["x ran 2 times"]


def test_a_target_run_twice_in_one_forward_is_noted_and_refused():
    from cudagraphs.partial import TargetSelectionError

    model = Toy(twice=True)
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    assert [r.repeated for r in mgr.recordings] == [True, False]
    with pytest.raises(TargetSelectionError, match=r"\['layers.0.self_attn'\] ran more than once"):
        mgr.capture()
    mgr.start_recording()  # a new recording starts clean
    assert not any(r.repeated for r in mgr.recordings)
    mgr.close()


def test_a_recompute_under_declared_checkpointing_is_not_news(caplog):
    mgr = PartialCudaGraphManager.from_model_parts(
        Toy(), scopes=NARROW, activation_checkpointing=True
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr._saw_recompute(mgr.recordings[0])
    assert not [r for r in caplog.records if "recomputed" in r.getMessage()]


def test_a_bad_backend_is_refused_before_discovery():
    # Nothing graphable here: without the early check this would return None.
    with pytest.raises(CudaGraphsTypeError, match="capture_backend"):
        PartialCudaGraphManager.from_model_parts(nn.Linear(2, 2), capture_backend=5)


def test_turning_a_dispatcher_off_gives_the_module_its_own_forward_back():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    first, second = mgr.dispatchers
    assert model.layers[0].self_attn.forward is first
    first.turn_off("slower_than_eager")
    assert "forward" not in vars(model.layers[0].self_attn), "the class's forward again"
    assert first.recording.off_reason == "slower_than_eager"
    assert first.recording.graphs() == [] and first.swap is None
    model(torch.randn(2, 8))
    stats = mgr.stats()
    assert (
        stats["replayed"] == 1 and stats["fallbacks"] == 0 and stats["off_slower_than_eager"] == 1
    )
    mgr.close()


def test_while_a_capture_runs_the_dispatchers_pass_calls_through_uncounted():
    from cudagraphs.partial.replay import dispatch_paused

    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    with dispatch_paused(mgr.dispatchers):
        model(torch.randn(2, 8))
    assert mgr.stats()["replayed"] == 0 and mgr.stats()["fallbacks"] == 0
    assert not any(d.passthrough for d in mgr.dispatchers)
    model(torch.randn(2, 8))
    assert mgr.stats()["replayed"] == 2
    mgr.close()


def test_a_second_capture_timing_its_graphs_counts_no_call_of_its_own():
    from cudagraphs.partial.speed import SpeedCheck

    model = Toy()
    # A clock that never moves: every graph ties with eager, and a tie keeps the graph.
    check = SpeedCheck(rounds=1, iters=1, warmup=1, clock=lambda: 0.0, synchronize=lambda: None)
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW, speed_check=check
    )
    mgr.start_recording()
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    mgr.capture()
    mgr.start_recording()  # another variant, while the first one's dispatchers are installed
    model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    before = mgr.stats()  # recorded before the dispatch: the new variant, not captured yet
    assert before["fallback_not_captured"] == 2 and before["replayed"] == 0
    mgr.capture()  # the speed check runs each target's forward several times
    assert mgr.stats() == before | {"captured": 4}
    model(torch.randn(3, 8, requires_grad=True))
    assert mgr.stats()["replayed"] == 2
    mgr.close()


@pytest.mark.parametrize("with_manager_warnings, said_times", [(False, 2), (True, 1)])
def test_a_dispatcher_reports_fallbacks_once_per_cause_only_under_a_manager(
    caplog, with_manager_warnings, said_times
):
    from cudagraphs.diagnostics import WarnOnce
    from cudagraphs.partial import TargetDispatcher

    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    recording = mgr.recordings[0]
    mgr.close()
    # A dispatcher starts dispatching (not passing calls through). With no manager to
    # say a cause once it warns at every fallback; given a manager's warnings, once.
    warn_once = WarnOnce(logging.getLogger(LOGGER)) if with_manager_warnings else None
    dispatcher = TargetDispatcher(recording, warn_once)
    assert dispatcher.passthrough is False
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            # The fallback runs the attention's own forward, which needs its
            # position embeddings: the report comes before that call fails.
            with pytest.raises(TypeError):
                dispatcher(torch.randn(1, 5, 64))
    said = [r for r in caplog.records if "ran eagerly (reason" in r.getMessage()]
    assert len(said) == said_times
    assert sum(dispatcher.counter.fallbacks.values()) == 2
