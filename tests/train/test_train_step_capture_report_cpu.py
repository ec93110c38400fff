"""What ``GraphedTrainStep.capture`` reports and refuses, on the CPU: the compile
account of its warmup (seconds, frames, graph breaks: ``stats``), a compile in the last
warmup step or in the capture refused with the step and the phase named, frames dynamo
gave up said on the step's logger, the INFO line of the stats and the WARNING of masks
built under capture, the optimizer's state kept across ``load_state_dict``, the
all-reduce and the clip as configured, and what ``stats`` and ``grad_norm`` read
before a capture and after ``reset``.

dynamo's records are stood in by scripted reports (one per ``CompileWatch.start``, in
the order ``capture`` starts its watches: each warmup step, then the capture), so that
no test compiles; the capture is the replaying stand-in of
``helpers.stand_in_train_step``.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from cudagraphs.compile_watch import CompiledFrame, CompileReport
from cudagraphs.errors import CompiledCaptureError, CudaGraphCaptureError
from cudagraphs.hf_masks import unread_masks_warning
from cudagraphs.settings import DISABLE_ENV
from cudagraphs.train import step as step_module
from cudagraphs.train.records import TrainStepOptions
from cudagraphs.train.step import GraphedTrainStep
from helpers.stand_in_graphs import OpNames
from helpers.stand_in_train_step import CpuPool, install_replaying
from helpers.train_cpu import _batches, _mlp, _step_fn

LOGGER = "cudagraphs.train.step"


def _frame(name, seconds=0.25, graph_breaks=0, failure=None, reason=None):
    return CompiledFrame(name, "model.py:3", "0/0", seconds, reason, graph_breaks, failure)


class ScriptedWatch:
    """Stands in for ``CompileWatch``: the n-th ``start`` finishes with ``reports[n]``
    (empty past the script); ``devices`` records the device index each start got."""

    def __init__(self, reports=()):
        self.reports = list(reports)
        self.devices = []

    def start(self, device_index=None):
        self.devices.append(device_index)
        n = len(self.devices) - 1
        report = self.reports[n] if n < len(self.reports) else CompileReport()
        return SimpleNamespace(finish=lambda: report)


@pytest.fixture
def rig(monkeypatch):
    """The replaying capture on ``cpu:0`` (a device with an index, as a GPU's), and a
    ``watch(reports)`` that installs a :class:`ScriptedWatch`."""
    make = install_replaying(monkeypatch)
    monkeypatch.setattr(GraphedTrainStep, "_device", lambda self: torch.device("cpu", 0))

    def watch(reports=()):
        scripted = ScriptedWatch(reports)
        monkeypatch.setattr(step_module, "CompileWatch", scripted)
        return scripted

    return SimpleNamespace(make=make, watch=watch, monkeypatch=monkeypatch)


def _step(rig, *, warmup_steps=3, step_fn=None, **options):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rig.make(opt)
    options.setdefault("optimizer_impl", "keep")
    opts = TrainStepOptions(warmup_steps=warmup_steps, **options)
    return GraphedTrainStep(step_fn or _step_fn(model), _batches(1, seed=5)[0], opt, opts)


def test_the_warmup_compile_account_lands_in_the_stats(rig):
    watch = rig.watch(
        [CompileReport((_frame("f", 1.5, graph_breaks=1), _frame("g", 0.5, graph_breaks=2)))]
    )
    stats = _step(rig).capture(CpuPool()).stats
    assert stats.compile_seconds == 2.0
    assert stats.compiled_frames == 2
    assert stats.graph_breaks == 3
    assert watch.devices == [0, 0, 0, 0], "each warmup step, then the capture, on the device"


def test_a_compile_in_the_last_warmup_step_is_refused_naming_the_step_and_the_phase(rig):
    rig.watch([CompileReport(), CompileReport(), CompileReport((_frame("late"),))])
    step = _step(rig)
    with pytest.raises(CompiledCaptureError) as info:
        step.capture(CpuPool())
    assert str(info.value).startswith(
        "graph_train_step: torch.compile compiled 1 frame(s) during the last warmup step,"
    )
    assert step.grad_norm is None and not step.graphed
    assert step(_batches(1, seed=6)[0]).isfinite(), "eager training goes on"


def test_a_frame_dynamo_gave_up_in_the_warmup_is_said_on_the_steps_logger(rig, caplog):
    rig.watch([CompileReport((_frame("f", failure="recompile limit reached"),))])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _step(rig).capture(CpuPool())
    said = [r for r in caplog.records if "gave up compiling" in r.getMessage()]
    assert len(said) == 1 and said[0].name == LOGGER
    assert said[0].getMessage().startswith("graph_train_step: dynamo gave up compiling f ")


def test_a_frame_dynamo_gave_up_in_the_capture_is_said_and_the_graph_kept(rig, caplog):
    # It ran eagerly inside the capture: the graph holds its eager kernels, correct.
    given_up = _frame("inner", failure="Unsupported: Dynamo recompile limit exceeded")
    rig.watch([CompileReport()] * 3 + [CompileReport((given_up,))])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    step = _step(rig).capture(CpuPool())
    assert step.graphed
    said = [r.getMessage() for r in caplog.records if "gave up compiling" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("graph_train_step: dynamo gave up compiling inner")


def test_a_frame_dynamo_gave_up_is_no_compile_for_the_account_or_the_optimizer(rig):
    # optimizer_impl="auto" compiles the optimizer step for a compiled model: a first
    # warmup step whose only frame was given up (it ran eagerly) is no compiled model.
    given_up = _frame("f", failure="Unsupported: Dynamo recompile limit exceeded")
    rig.watch([CompileReport((given_up, _frame("g", 0.5)))])
    assert _step(rig).capture(CpuPool()).stats.compiled_frames == 1
    rig.watch([CompileReport((given_up,))])
    step = _step(rig, optimizer_impl="auto").capture(CpuPool())
    assert step.stats.compiled_frames == 0 and not step.optimizer_compiled


def test_a_compile_inside_a_failed_capture_is_named_as_its_likelier_cause(rig):
    planted = CudaGraphCaptureError("planted: operation not permitted when stream is capturing")

    def failing(*args, **kwargs):
        raise planted

    rig.monkeypatch.setattr(step_module, "capture_step_graphs", failing)
    rig.watch([CompileReport()] * 3 + [CompileReport((_frame("inner"),))])
    step = _step(rig)
    with pytest.raises(CompiledCaptureError) as info:
        step.capture(CpuPool())
    assert str(info.value).startswith(
        "graph_train_step: torch.compile compiled 1 frame(s) during the capture,"
    )
    assert info.value.__cause__ is planted
    assert step.grad_norm is None


def test_a_failed_capture_without_a_compile_raises_its_own_error(rig):
    planted = CudaGraphCaptureError("planted")
    rig.monkeypatch.setattr(
        step_module, "capture_step_graphs", lambda *a, **k: (_ for _ in ()).throw(planted)
    )
    rig.watch()
    with pytest.raises(CudaGraphCaptureError) as info:
        _step(rig).capture(CpuPool())
    assert info.value is planted


def test_a_compile_during_a_capture_that_succeeded_is_refused(rig):
    rig.watch([CompileReport()] * 3 + [CompileReport((_frame("during"),))])
    with pytest.raises(CompiledCaptureError) as info:
        _step(rig).capture(CpuPool())
    assert str(info.value).startswith(
        "graph_train_step: torch.compile compiled 1 frame(s) during the capture,"
    )


def test_the_capture_logs_its_stats_and_warns_of_masks_built_under_capture(rig, caplog):
    unread = ("model.layers.0: an attention mask with padding",)

    @contextmanager
    def masks():
        yield SimpleNamespace(unread=list(unread))

    rig.monkeypatch.setattr(step_module, "eager_mask_choice", masks)
    rig.watch()
    caplog.set_level(logging.INFO, logger=LOGGER)
    step = _step(rig).capture(CpuPool())
    assert step.stats.masks_built_in_capture == unread
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert f"train step captured: {step.stats}" in messages
    assert unread_masks_warning("graph_train_step", unread) in messages


def test_cudagraphs_disable_says_the_step_runs_eagerly(rig, caplog, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    caplog.set_level(logging.INFO, logger=LOGGER)
    step = _step(rig).capture(CpuPool())
    assert not step.graphed
    assert "CUDAGRAPHS_DISABLE is set: the train step runs eagerly" in caplog.messages


def test_a_warning_step_fn_gives_in_the_warmup_reaches_the_caller(rig):
    # The warmup hides only torch's warning about capturable optimizers.
    model = _mlp()
    plain = _step_fn(model)
    calls = []

    def step_fn(batch):
        calls.append(1)
        if len(calls) == 1:  # the first warmup step only
            warnings.warn("step_fn says so", UserWarning, stacklevel=1)
        return plain(batch)

    rig.watch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rig.make(opt)
    opts = TrainStepOptions(warmup_steps=2, optimizer_impl="keep")
    step = GraphedTrainStep(step_fn, _batches(1, seed=5)[0], opt, opts)
    with pytest.warns(UserWarning, match="step_fn says so"):
        step.capture(CpuPool())


def test_stats_and_grad_norm_before_a_capture_and_after_reset(rig):
    rig.watch()
    step = _step(rig, max_grad_norm=1.0)
    assert step.stats is None and step.grad_norm is None
    step.capture(CpuPool())
    step(_batches(1, seed=6)[0])
    assert step.grad_norm is not None
    step.reset()
    assert step.grad_norm is None and not step.graphed


def test_load_state_dict_after_capture_keeps_the_captured_state_tensors(rig):
    rig.watch()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rig.make(opt)
    opts = TrainStepOptions(warmup_steps=2, optimizer_impl="keep")
    step = GraphedTrainStep(_step_fn(model), _batches(1, seed=5)[0], opt, opts).capture(CpuPool())
    step(_batches(1, seed=6)[0])
    p = next(iter(model.parameters()))
    buf = opt.state[p]["momentum_buffer"]
    saved = opt.state_dict()
    saved["state"][0]["momentum_buffer"] = torch.full_like(buf, 7.0)
    opt.load_state_dict(saved)
    assert opt.state[p]["momentum_buffer"] is buf, "the tensor the graph reads"
    assert torch.equal(buf, torch.full_like(buf, 7.0)), "holding the loaded values"


def test_the_update_reduces_with_the_groups_and_bucket_size_asked_for(rig):
    made = []

    class Reducer:
        def __init__(self, grads, group, bucket_mb):
            made.append((grads, group, bucket_mb))

        def __call__(self):
            made.append("reduced")

    rig.monkeypatch.setattr(step_module, "GradientReducer", Reducer)
    # all_reduce=True needs a process group (TrainStepOptions checks it is there).
    rig.monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    group = object()
    step = _step(rig, all_reduce=True, process_group=group, bucket_mb=7.0)
    step(_batches(1, seed=6)[0])  # before capture: the same step, eagerly
    (grads, got_group, bucket_mb), done = made
    assert got_group is group and bucket_mb == 7.0 and done == "reduced"
    assert [g is p.grad for g, p in zip(grads, step.params)] == [True] * len(step.params)


def test_the_clip_takes_every_gradient_in_one_foreach_norm(rig):
    step = _step(rig, max_grad_norm=0.5)
    with OpNames() as ops:
        step(_batches(1, seed=6)[0])
    assert ops.names.count("_foreach_norm") == 1
    assert "linalg_vector_norm" in ops.names  # the norm of the norms


def test_a_step_fn_that_pops_from_its_batch_is_graphed_as_it_runs_eagerly(rig):
    # HF's compute_loss pattern (labels = inputs.pop("labels")): each warmup step and
    # the capture get containers of their own over the batch buffer's tensors.
    model = _mlp()
    calls = []

    def step_fn(batch):
        labels = batch.pop("labels")
        calls.append(sorted(batch))
        loss = torch.nn.functional.mse_loss(model(batch["x"]), labels)
        loss.backward()
        return loss.detach()

    x, y = _batches(1, seed=5)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rig.make(opt)
    opts = TrainStepOptions(warmup_steps=2, optimizer_impl="keep")
    sample = {"x": x, "labels": y}
    step = GraphedTrainStep(step_fn, sample, opt, opts).capture(CpuPool())
    assert step.graphed and sorted(sample) == ["labels", "x"]  # the user's dict untouched
    batch = {"x": x, "labels": y}
    loss = step(batch)
    assert torch.isfinite(loss).all() and calls[-1] == ["x"]
    assert sorted(batch) == ["labels", "x"]  # a replay runs no Python: nothing popped


def test_a_failed_second_capture_leaves_a_step_that_runs_eagerly_and_captures_again(rig):
    model = _mlp()
    fail = []
    plain = _step_fn(model)

    def step_fn(batch):
        if fail:
            raise RuntimeError("planted failure in a warmup step")
        return plain(batch)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rig.make(opt)
    opts = TrainStepOptions(warmup_steps=2, optimizer_impl="keep")
    batch = _batches(1, seed=5)[0]
    step = GraphedTrainStep(step_fn, batch, opt, opts).capture(CpuPool())
    step(batch)
    fail.append(1)
    with pytest.raises(RuntimeError, match="planted failure"):
        step.capture(CpuPool())
    fail.clear()
    assert not step.graphed
    before = [p.detach().clone() for p in model.parameters()]
    assert torch.isfinite(step(batch)).all()  # eagerly, and it trains
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    step.capture(CpuPool())
    assert step.graphed
    assert torch.isfinite(step(batch)).all()



def test_parameters_moved_to_new_memory_after_capture_are_refused(rig):
    # model.to(dtype) / .data assignment: the graphs would keep training the old memory.
    from cudagraphs.errors import CudaGraphsStateError

    step = _step(rig, warmup_steps=2)
    step.capture(CpuPool())
    batch = _batches(1, seed=6)[0]
    step(batch)
    last = step.params[-1]
    last.data = last.data.clone()
    with pytest.raises(CudaGraphsStateError, match="moved to new memory since capture"):
        step(batch)
    step.capture(CpuPool())  # captured again around the new memory: steps run
    assert step.graphed and torch.isfinite(step(batch)).all()


def test_gradients_made_non_finite_by_the_all_reduce_keep_the_parameters(rig):
    # Another rank's inf reaches this rank's gradients only through the all-reduce:
    # the finiteness check of the warmup must read them after it, or the lr-0 warmup
    # step writes 0 * inf = NaN into this rank's parameters, never restored.
    class InfFromAnotherRank:
        def __init__(self, grads, group, bucket_mb):
            self.grads = grads

        def __call__(self):
            for g in self.grads:
                g.fill_(float("inf"))

    rig.monkeypatch.setattr(step_module, "GradientReducer", InfFromAnotherRank)
    rig.monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    step = _step(rig, all_reduce=True, warmup_steps=2)
    before = [p.detach().clone() for p in step.params]
    step.capture(CpuPool())
    assert all(torch.equal(a, p) for a, p in zip(before, step.params))
