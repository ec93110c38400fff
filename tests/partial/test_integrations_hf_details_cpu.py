"""PartialGraphsCallback's events one by one on the CPU (the Trainer's arguments and
state stood in by namespaces), and the INFO lines of a whole Trainer run: why graphs
are off, the checkpointing flag passed on, stats while and after training, recording
for an evaluation started and stopped, and the log entries updated."""

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cudagraphs.integrations.hf import (  # noqa: E402
    PartialGraphsCallback,
    _checkpointing,
    _is_copy_of,
)
from helpers.trainer import Backend, train  # noqa: E402

LOGGER = "cudagraphs"


def begun(model=None, args=None, **options):
    callback = PartialGraphsCallback(capture_backend=Backend(), **options)
    callback.on_train_begin(
        args or SimpleNamespace(), SimpleNamespace(), None, model=model or tiny()
    )
    return callback


def state(step):
    return SimpleNamespace(global_step=step, log_history=[])


# ---- why graphs are off --------------------------------------------------------------
def test_no_model_is_named_by_its_type():
    callback = PartialGraphsCallback()
    assert callback.off_reason is None, "nothing is off before a run"
    callback.on_train_begin(SimpleNamespace(), SimpleNamespace(), None, model="gpt2")
    assert callback.off_reason == "the Trainer passed no model to the callback (got str)"


def test_without_cuda_the_reason_is_said_exactly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    callback = PartialGraphsCallback()
    callback.on_train_begin(SimpleNamespace(), SimpleNamespace(), None, model=tiny())
    assert callback.off_reason == "no CUDA device is available (torch.cuda.is_available() is False)"


class _FakeDevice(nn.Module):
    """A module whose parameters say they live on ``device`` (nothing to graph)."""

    def __init__(self, device):
        super().__init__()
        self._device = device

    def parameters(self, recurse=True):
        if self._device is not None:
            yield SimpleNamespace(device=torch.device(self._device))


@pytest.mark.parametrize(
    "device, reason",
    [
        ("cpu", "the model's parameters are on cpu, not on a CUDA device"),
        (None, "the model's parameters are on None, not on a CUDA device"),
        ("cuda", "nothing graphable was found in the model"),  # past the device check
    ],
)
def test_with_cuda_the_parameters_device_decides(monkeypatch, device, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    callback = PartialGraphsCallback()
    callback.on_train_begin(SimpleNamespace(), SimpleNamespace(), None, model=_FakeDevice(device))
    assert callback.off_reason == reason and callback.manager is None


# ---- what the manager is built with -----------------------------------------------------
@pytest.mark.parametrize(
    "args, on",
    [
        (SimpleNamespace(), False),
        (SimpleNamespace(gradient_checkpointing=True), True),
        (SimpleNamespace(activation_checkpointing=True), True),
        (SimpleNamespace(activation_checkpointing=False, gradient_checkpointing=False), False),
    ],
)
def test_checkpointing_is_read_under_both_names_and_passed_on(args, on):
    assert _checkpointing(args) is on
    callback = begun(args=args)
    assert callback.manager.activation_checkpointing is on
    callback.on_train_end(args, SimpleNamespace(), None)


def test_the_defaults_reach_the_manager_and_stats_are_live_while_training():
    callback = begun()
    manager = callback.manager
    assert callback.off_reason is None and manager._speed_check is True
    assert all(e.contracts.max_variants == 4 for e in manager.recordings)
    assert callback.stats() == manager.stats() and "captured" in callback.stats()
    callback.on_train_end(SimpleNamespace(), SimpleNamespace(), None)
    assert callback.manager is None and callback.stats() == manager.stats()


def test_a_bound_of_one_variant_is_allowed():
    assert PartialGraphsCallback(max_variants=1)._options["max_variants"] == 1


# ---- recording and capture, event by event -------------------------------------------
def test_recording_starts_once_and_capture_stops_it(caplog):
    callback = begun(record_step=1)
    manager = callback.manager
    with caplog.at_level(logging.INFO, logger=LOGGER):
        callback.on_step_begin(None, state(0), None)
        callback.on_step_begin(None, state(0), None)  # still recording: nothing new
    said = [r.getMessage() for r in caplog.records if "recording optimizer step" in r.getMessage()]
    assert said == ["partial graphs: recording optimizer step 1"] and manager.recording
    manager.stop_recording()  # no step ran: nothing to capture
    callback.on_train_end(None, None, None)


def test_an_evaluation_recording_starts_only_when_asked_and_after_capture():
    ignoring = begun(inference_calls="ignore")
    ignoring.on_step_end(None, state(1), None)  # not recording, not captured
    assert not ignoring.manager.recording and not ignoring._eval_recording
    ignoring._captured = True
    ignoring.on_step_end(None, state(1), None)
    assert not ignoring.manager.recording and not ignoring._eval_recording
    ignoring.on_train_end(None, None, None)

    recording = begun(inference_calls="record")
    recording.on_step_end(None, state(1), None)  # not captured yet: no evaluation recording
    assert not recording.manager.recording and not recording._eval_recording
    recording._captured = True
    recording.on_step_end(None, state(1), None)
    assert recording.manager.recording and recording._eval_recording is True
    # No evaluation came: the next step stops that recording before training calls.
    recording.on_step_begin(None, state(1), None)
    assert not recording.manager.recording and recording._eval_recording is False
    recording.on_train_end(None, None, None)


def test_on_evaluate_captures_only_an_evaluation_recording():
    callback = begun(inference_calls="record")
    before = callback.stats()
    callback.on_evaluate(None, state(1), None)  # nothing recorded for an evaluation
    assert callback.stats() == before and not callback._eval_captured
    callback.on_train_end(None, None, None)


def test_a_whole_run_says_what_it_did_at_info(tmp_path, caplog):
    callback = PartialGraphsCallback(capture_backend=Backend(), inference_calls="record")
    after_evaluate = []

    class Probe(transformers.TrainerCallback):
        # Runs right after ours: what an evaluation left behind.
        def on_evaluate(self, args, state, control, **kwargs):
            after_evaluate.append((callback._eval_recording, callback._eval_captured))

    with caplog.at_level(logging.INFO, logger=LOGGER):
        train(tmp_path, tiny(), [callback, Probe()], steps=4, eval_steps=2)
    assert after_evaluate == [(False, True), (False, True)]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("partial graphs")]
    final = callback.stats()
    assert "partial graphs: recording optimizer step 1" in lines
    assert any(m.startswith("partial graphs: captured after optimizer step 1: {") for m in lines)
    assert any(m.startswith("partial graphs: captured the evaluation's calls: {") for m in lines)
    assert f"partial graphs [train end]: {final}" in lines
    assert callback._eval_captured is True and callback._eval_recording is False


# ---- the log entries ------------------------------------------------------------------
def test_on_log_updates_the_logs_and_trainers_stored_copy_only():
    callback = begun()
    value = 0.5
    logs = {"loss": value}
    stored = {"loss": value, "step": 1}  # Trainer's copy: the same value object
    other = {"loss": 0.25}
    st = SimpleNamespace(log_history=[other, stored])
    callback.on_log(None, st, None, logs=logs)
    assert logs["cudagraphs/captured"] == 0 and stored["cudagraphs/captured"] == 0
    assert "cudagraphs/captured" not in other
    for history_state in (SimpleNamespace(), SimpleNamespace(log_history=[])):
        logs = {"loss": value}
        callback.on_log(None, history_state, None, logs=logs)
        assert logs["cudagraphs/captured"] == 0
    callback.on_train_end(None, None, None)


def test_is_copy_of_needs_a_dict_with_the_very_same_values():
    v = [1]
    assert _is_copy_of({"a": v, "step": 2}, {"a": v})
    assert not _is_copy_of({"a": [1]}, {"a": v})
    assert not _is_copy_of({"b": v}, {"a": v})
    assert not _is_copy_of([("a", v)], {"a": v})


# ---- the callback's state machine against a plain reference ------------------------------
class _FakeManager:
    """Stands in for the manager: records what the callback asks, and what each
    training or evaluation call would see."""

    def __init__(self, inference_calls):
        self.inference_calls = inference_calls
        self.recording = False
        self.seen = []

    def start_recording(self):
        self.recording = True

    def stop_recording(self):
        self.recording = False

    def capture(self):
        assert self.recording, "capture() without a recording"
        self.seen.append("capture")
        self.recording = False

    def call(self, kind, step):
        self.seen.append((kind, step, self.recording))

    def stats(self):
        return {}

    def log_stats(self, phase):
        pass

    def close(self):
        pass


@settings(max_examples=300, deadline=None)
@given(
    record_step=st.integers(1, 6),
    resume=st.integers(0, 6),
    steps=st.integers(0, 6),
    evaluate_after=st.sets(st.integers(0, 12)),
    inference_calls=st.sampled_from(["ignore", "record"]),
)
def test_the_callback_records_the_first_step_at_or_after_record_step_once(
    record_step, resume, steps, evaluate_after, inference_calls
):
    # Reference: in a run of optimizer steps resume+1 .. resume+steps, exactly the
    # first one >= record_step is recorded (training calls see recording on), then
    # captured at its end; with inference_calls="record" the first evaluation after
    # that capture (after any later step) is recorded and captured, and nothing else
    # ever records.
    callback = begun(record_step=record_step, inference_calls=inference_calls)
    callback.manager.close()
    fake = callback.manager = _FakeManager(inference_calls)
    run = list(range(resume + 1, resume + steps + 1))
    for step in run:
        callback.on_step_begin(None, state(step - 1), None)
        fake.call("train", step)
        callback.on_step_end(None, state(step), None)
        if step in evaluate_after:
            fake.call("eval", step)
            callback.on_evaluate(None, state(step), None)
    recorded = next((s for s in run if s >= record_step), None)
    want = []
    eval_pending = False
    eval_done = False
    for step in run:
        eval_pending = False  # no evaluation came: stopped at this step's begin
        want.append(("train", step, step == recorded))
        if step == recorded:
            want.append("capture")
        # From the capture on, each step's end records for an evaluation, until one
        # evaluation has been captured.
        captured = recorded is not None and step >= recorded
        eval_pending = captured and inference_calls == "record" and not eval_done
        if step in evaluate_after:
            if eval_pending and not eval_done:
                want += [("eval", step, True), "capture"]
                eval_done, eval_pending = True, False
            else:
                want.append(("eval", step, False))
    assert fake.seen == want
