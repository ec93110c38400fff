"""CPU tests of ``optimizer_impl="compiled"``: the plan (``foreach``, a device learning
rate; property-tested with every other implementation against the rule written out),
``compiled_optimizer_step``, and a graphed step whose optimizer step is compiled,
captured and replayed over stand-in graphs (``helpers.stand_in_train_step``): it
compiles in the warmup only, never in the capture, and trains bit for bit like the
eager loop that calls the same compiled step. ``"auto"`` compiles the optimizer step
of a step that compiles (the rule property-tested against its statement; the switch
in the warmup through the same stand-in capture), and of no other."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs import CudaGraphsTypeError
from cudagraphs.train import compiled_optimizer_step, plan_optimizer
from cudagraphs.train.optimizers import IMPLEMENTATIONS, adopts_compiled_step
from cudagraphs.train.step import graph_train_step
from helpers.asserts import assert_bitwise_equal
from helpers.stand_in_train_step import CpuPool, install_replaying
from helpers.train_cpu import _batches, _mlp, _param, _step_fn


# ---- the plan ----------------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_plan_compiled_adam_on_cuda_is_capturable_foreach_with_a_device_lr(cls):
    opt = cls([_param(3)], lr=1e-3)
    (plan,) = plan_optimizer(opt, "compiled", "cuda")
    assert plan.settings == {"capturable": True, "fused": False, "foreach": True}
    assert plan.device_lr is True
    assert plan.changes == (
        "param_groups[0]['capturable'] = True",
        "param_groups[0]['fused'] = False",
        "param_groups[0]['foreach'] = True",
        "param_groups[0]['lr'] = a tensor on the device",
    )


def test_plan_compiled_sgd_on_cuda_is_foreach_with_a_device_lr():
    # Compiled, foreach SGD reads a tensor learning rate without a host sync
    # (torch/optim/sgd.py, _multi_tensor_sgd under torch.compiler.is_compiling()).
    opt = torch.optim.SGD([_param(3)], lr=0.1, momentum=0.9)
    (plan,) = plan_optimizer(opt, "compiled", "cuda")
    assert plan.settings == {"fused": False, "foreach": True}
    assert plan.device_lr is True


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_plan_compiled_on_cpu_plans_nothing(cls):
    (plan,) = plan_optimizer(cls([_param(3)], lr=0.1), "compiled", "cpu")
    assert plan.settings == {} and plan.device_lr is False and plan.changes == ()


FLAGS = st.sampled_from([None, False, True])


@st.composite
def groups(draw):
    kind = draw(st.sampled_from(["adam", "adamw", "sgd"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    params = [_param(3)] + ([torch.zeros(2, dtype=dtype)] if dtype != torch.float32 else [])
    lr = draw(st.sampled_from([0.01, "tensor", "tensor_elsewhere"]))
    make = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind]
    opt = make(params, lr=0.01)
    group = opt.param_groups[0]
    for key in ("fused", "foreach", *(("capturable",) if kind != "sgd" else ())):
        group[key] = draw(FLAGS)
    group["differentiable"] = draw(st.booleans())
    if lr == "tensor":
        group["lr"] = torch.tensor(0.01)
    elif lr == "tensor_elsewhere":  # not on the parameters' device
        group["lr"] = torch.tensor(0.01, device="meta")
    return kind, opt


def expected_group(kind, group, implementation, device_type):
    """What the group must hold once the plan is applied, written as the rule reads."""
    want = dict(group)
    if device_type != "cuda":
        return want, False
    if kind != "sgd":
        want["capturable"] = True
    fusable = not group["differentiable"] and all(
        p.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        for p in group["params"]
    )
    if implementation in ("auto", "fused") and fusable:
        want.update(fused=True, foreach=False)
    if implementation == "compiled":
        want.update(fused=False, foreach=True)
    reads_device_lr = (
        bool(want["fused"])
        or (kind != "sgd" and bool(want["capturable"]))
        or implementation == "compiled"
    )
    lr = group["lr"]
    on_device = isinstance(lr, torch.Tensor) and lr.device == group["params"][0].device
    return want, reads_device_lr and not on_device


@settings(max_examples=300, deadline=None)
@given(groups(), st.sampled_from(IMPLEMENTATIONS), st.sampled_from(["cuda", "cpu"]))
def test_plan_matches_the_rule_for_every_group(case, implementation, device_type):
    kind, opt = case
    group = opt.param_groups[0]
    before = dict(group)
    (plan,) = plan_optimizer(opt, implementation, device_type)
    assert dict(group) == before, "plan_optimizer changed the optimizer"
    want, device_lr = expected_group(kind, group, implementation, device_type)
    assert {**group, **plan.settings} == want
    assert all(group.get(k) != v for k, v in plan.settings.items()), "a no-op setting"
    assert plan.device_lr is device_lr
    lines = [f"param_groups[0]['{k}'] = {v}" for k, v in plan.settings.items()]
    lines += ["param_groups[0]['lr'] = a tensor on the device"] if device_lr else []
    assert plan.changes == tuple(lines)


# ---- compiled_optimizer_step ---------------------------------------------------------
def test_compiled_optimizer_step_refuses_what_is_not_an_optimizer():
    with pytest.raises(CudaGraphsTypeError, match="optimizer must be a torch optimizer"):
        compiled_optimizer_step(object())


# ---- a graphed step with a compiled optimizer step -----------------------------------
@pytest.fixture
def replaying(monkeypatch):
    return install_replaying(monkeypatch)


def _sgd(params):
    # What the plan makes of SGD on CUDA (the CPU plan changes nothing): foreach, with
    # the learning rate as a tensor, which the warmup zeroes in place (no recompile).
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    opt.param_groups[0]["lr"] = torch.tensor(0.05)
    return opt


def _assert_like_the_compiled_step_loop(model, ref, ref_opt, ref_fn, batches, losses):
    """The eager loop calling the same compiled optimizer step gives ``losses`` and
    leaves ``ref`` equal to ``model``, bit for bit."""
    ref_step, ref_losses = compiled_optimizer_step(ref_opt), []
    for b in batches:
        for p in ref.parameters():
            p.grad = None
        ref_losses.append(ref_fn(b).detach())
        ref_step()
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_bitwise_equal(a, b, f"loss of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), f"parameter {name}")


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_optimizer_step_compiles_in_the_warmup_and_replays_like_its_eager_loop(
    replaying,
):
    model = _mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    capture = replaying(opt)
    batches = _batches(5, seed=11)
    step = graph_train_step(
        _step_fn(model), batches[0], optimizer=opt, optimizer_impl="compiled", pool=CpuPool()
    )
    # The capture compiled nothing (else CompiledCaptureError): the warmup did it all.
    assert step.graphed and step.stats.compiled_frames >= 1
    assert 0 < step.stats.compile_seconds <= step.stats.warmup_seconds
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), "parameter after capture")
    losses = [step(b).clone() for b in batches]
    assert capture.replays() == {"train step": len(batches)}

    _assert_like_the_compiled_step_loop(model, ref, ref_opt, _step_fn(ref), batches, losses)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bitwise_equal(
            opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"], "momentum"
        )


# ---- "auto": the optimizer step compiled where the step compiles --------------------
@settings(max_examples=200, deadline=None)
@given(st.sampled_from(IMPLEMENTATIONS), st.booleans(), st.integers(-1, 6))
def test_auto_adopts_the_compiled_step_exactly_as_the_rule_says(impl, compiled, left):
    # The rule as documented: only "auto", only a step that compiled, and two warmup
    # steps left after the first (one compiles the optimizer step, one compiles nothing).
    expected = impl == "auto" and compiled and left >= 2
    assert adopts_compiled_step(impl, compiled, left) is expected


def _compiled_stepper(model):
    return _step_fn(torch.compile(model))


@pytest.mark.usefixtures("fresh_dynamo")
def test_auto_on_a_compiled_step_compiles_the_optimizer_step_and_replays_like_its_loop(
    replaying,
):
    model = _mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    capture = replaying(opt)
    batches = _batches(4, seed=13)
    step = graph_train_step(_compiled_stepper(model), batches[0], optimizer=opt, pool=CpuPool())
    assert step.graphed and step.optimizer_compiled, "auto on a compiling step: compiled"
    # Compiled in the warmup only (the capture refuses a compile).
    assert step.stats.compiled_frames >= 2
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), "parameter after capture")
    losses = [step(b).clone() for b in batches]
    assert capture.replays() == {"train step": len(batches)}

    _assert_like_the_compiled_step_loop(
        model, ref, ref_opt, _compiled_stepper(ref), batches, losses
    )


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    ("compiles", "impl", "warmup"),
    [(False, "auto", 3), (True, "fused", 3), (True, "auto", 2)],
    ids=["eager_step", "fused_asked", "too_few_warmup_steps"],
)
def test_auto_keeps_the_plain_optimizer_step_elsewhere(replaying, compiles, impl, warmup):
    model = _mlp()
    opt = _sgd(model.parameters())
    capture = replaying(opt)
    batches = _batches(2, seed=17)
    step_fn = _compiled_stepper(model) if compiles else _step_fn(model)
    step = graph_train_step(
        step_fn,
        batches[0],
        optimizer=opt,
        optimizer_impl=impl,
        warmup_steps=warmup,
        pool=CpuPool(),
    )
    assert step.graphed and not step.optimizer_compiled
    step(batches[1])
    assert capture.replays() == {"train step": 1}


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_switch_plans_the_compiled_step_and_keeps_groups_inexact_at_zero_lr(
    replaying, monkeypatch, caplog
):
    # What the CPU cannot show by numbers (its plan changes nothing, and SGD is exact at
    # learning rate 0): the switch plans the compiled implementation, and keeps on the
    # host the parameters of each group its new kind no longer leaves exact at lr 0 (the
    # capturable foreach AdamW on CUDA), before any step of that kind.
    import logging

    from cudagraphs.train import step as step_module
    from cudagraphs.train.optimizers import OptimizerSnapshot

    model = _mlp()
    opt = _sgd(model.parameters())
    group = opt.param_groups[0]
    replaying(opt)
    planned, kept = [], []
    real_prepare, real_keep = step_module.prepare_optimizer, OptimizerSnapshot.keep_params

    def prepare(optimizer, implementation="auto"):
        planned.append(implementation)
        return real_prepare(optimizer, implementation)

    def inexact(optimizer, g):
        assert optimizer is opt and g is group, "asked of another group"
        return False

    def keep(snapshot, params=None):
        kept.append(params)
        return real_keep(snapshot, params)

    monkeypatch.setattr(step_module, "prepare_optimizer", prepare)
    monkeypatch.setattr(step_module, "exact_at_zero_lr", inexact)
    monkeypatch.setattr(OptimizerSnapshot, "keep_params", keep)
    batches = _batches(2, seed=19)
    with caplog.at_level(logging.INFO, logger=step_module.logger.name):
        step = graph_train_step(_compiled_stepper(model), batches[0], optimizer=opt, pool=CpuPool())
    assert step.optimizer_compiled
    assert planned == ["auto", "compiled"]
    assert group["params"] in kept, "the inexact group's parameters were not kept"
    assert None not in kept, "kept every parameter instead of the group's"
    assert any("compiles the optimizer step too" in r.getMessage() for r in caplog.records)
