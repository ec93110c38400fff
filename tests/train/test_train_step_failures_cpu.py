"""``GraphedTrainStep.capture`` failing part way, on the CPU: in the warmup (at its
first or a later step), in the capture, and after a warmup whose gradients were not
finite. Whatever fails, the model, the learning rates and the optimizer state must be
as before, ``.grad`` must be ``None``, and eager training must go on exactly as if
nothing had been tried (checked against a reference that never was).

The device-only calls of ``capture`` are replaced for the CPU: the device check, the
pool's streams and its warmup scope (a no-op scope), the memory meter and the capture
of the graphs (``capture_step_graphs``: here it runs the step's forward and backward,
as a capture records them, then fails). The warmup, the optimizer snapshot and the
error handling run as written.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cudagraphs.train import prepare_optimizer
from cudagraphs.train import step as step_module
from cudagraphs.train.records import TrainStepOptions
from cudagraphs.train.step import GraphedTrainStep
from helpers.stand_in_train_step import CpuPool, run_capture_on_cpu
from helpers.train_cpu import (
    OPTIMIZERS,
    _assert_same_training,
    _batches,
    _eager_loop,
    _mlp,
    _step_fn,
)


class PlantedError(RuntimeError):
    pass


@pytest.fixture
def cpu_capture(monkeypatch):
    """Lets ``capture`` run on the CPU; returns the list the failing capture logs to."""
    calls = []

    def failing_capture(micro, update, batch, n, pool, stream):
        calls.append(n)
        micro(batch())  # what a capture records first: forward and backward
        raise PlantedError("planted failure in the capture of the train step")

    run_capture_on_cpu(monkeypatch)
    monkeypatch.setattr(step_module, "capture_step_graphs", failing_capture)
    return calls


def _pair(opt_name, resumed):
    model = _mlp()
    make = OPTIMIZERS[opt_name]
    opt = make(model.parameters())
    if resumed:  # optimizer state exists before graphing
        _eager_loop(_step_fn(model), opt, _batches(2, seed=3, rows=2))
    ref_model = copy.deepcopy(model)
    ref_opt = make(ref_model.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    prepare_optimizer(ref_opt)
    return model, opt, ref_model, ref_opt


def _step(model, fail_on_call=None, non_finite_in_warmup=False):
    calls = []
    plain = _step_fn(model)

    def step(batch):
        calls.append(1)
        if fail_on_call is not None and len(calls) - 1 == fail_on_call:
            raise PlantedError(f"planted failure in call {fail_on_call} of step_fn")
        if non_finite_in_warmup and len(calls) <= 3:
            x, y = batch
            loss = torch.nn.functional.mse_loss(model(x), y) * float("inf")
            loss.backward()
            return loss
        return plain(batch)

    return step, calls


def _lrs(opt):
    return [
        float(g["lr"]) if not isinstance(g["lr"], torch.Tensor) else g["lr"].item()
        for g in opt.param_groups
    ]


def _after_failure_as_never_tried(model, opt, ref_model, ref_opt, lrs_before):
    assert all(p.grad is None for p in model.parameters()), ".grad must be None after failure"
    assert _lrs(opt) == lrs_before, "learning rates must be restored"
    _assert_same_training(model, opt, ref_model, ref_opt, [], [])
    batches = _batches(3, seed=11)
    losses = _eager_loop(_step_fn(model), opt, batches)
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches)
    _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)


def _graphed(step_fn, opt, warmup_steps=3, accumulation=1):
    options = TrainStepOptions(warmup_steps=warmup_steps, accumulation_steps=accumulation)
    sample = _batches(1, seed=5)[0]
    return GraphedTrainStep(step_fn, sample, opt, options)


def _fails(graphed, match):
    """Capture ``graphed`` into a CPU pool, expecting the planted failure; returns it
    and the learning rates from before."""
    lrs = _lrs(graphed.optimizer)
    with pytest.raises(PlantedError, match=match):
        graphed.capture(CpuPool())
    return graphed, lrs


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("fail_on_call", [0, 2])
def test_a_warmup_failing_at_a_step_leaves_everything_as_before(
    cpu_capture, opt_name, resumed, fail_on_call
):
    model, opt, ref_model, ref_opt = _pair(opt_name, resumed)
    step_fn, calls = _step(model, fail_on_call=fail_on_call)
    graphed, lrs_before = _fails(_graphed(step_fn, opt), f"call {fail_on_call}")
    assert len(calls) == fail_on_call + 1 and cpu_capture == []
    assert not graphed.graphed
    _after_failure_as_never_tried(model, opt, ref_model, ref_opt, lrs_before)


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_capture_failing_after_the_warmup_leaves_everything_as_before(
    cpu_capture, opt_name, resumed, accumulation
):
    model, opt, ref_model, ref_opt = _pair(opt_name, resumed)
    step_fn, calls = _step(model)
    _, lrs_before = _fails(_graphed(step_fn, opt, accumulation=accumulation), "capture of")
    # Three warmup steps of `accumulation` micro-batches, then the capture's one call.
    assert len(calls) == 3 * accumulation + 1 and cpu_capture == [accumulation]
    _after_failure_as_never_tried(model, opt, ref_model, ref_opt, lrs_before)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_non_finite_warmup_gradients_then_a_failed_capture_leave_everything_as_before(
    cpu_capture, opt_name
):
    """At learning rate 0 an infinite gradient still moves a parameter (0 * inf is
    NaN): the warmup keeps the parameters on the host and puts them back."""
    model, opt, ref_model, ref_opt = _pair(opt_name, resumed=True)
    step_fn, _ = _step(model, non_finite_in_warmup=True)
    graphed = _graphed(step_fn, opt)
    lrs_before = _lrs(opt)
    with pytest.raises(PlantedError):
        graphed.capture(CpuPool())
    _after_failure_as_never_tried(model, opt, ref_model, ref_opt, lrs_before)


def test_a_learning_rate_held_as_a_tensor_is_restored_in_place(cpu_capture):
    """A scheduler writes a tensor learning rate in place: after the failure the group
    holds the same tensor object, with the value it had."""
    model, opt, ref_model, ref_opt = _pair("adamw", resumed=True)
    for g, h in zip(opt.param_groups, ref_opt.param_groups):
        g["lr"] = torch.tensor(0.02)
        h["lr"] = torch.tensor(0.02)
    lr_tensor = opt.param_groups[0]["lr"]
    step_fn, _ = _step(model)
    with pytest.raises(PlantedError):
        _graphed(step_fn, opt).capture(CpuPool())
    assert opt.param_groups[0]["lr"] is lr_tensor
    _after_failure_as_never_tried(model, opt, ref_model, ref_opt, [torch.tensor(0.02).item()])
