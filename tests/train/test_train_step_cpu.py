"""CPU tests of the train layer: the optimizer policies (plan, prepare, snapshot,
hyperparameter guard, state keeper), gradient buckets and the bucketed all-reduce on
two gloo ranks, and graph_train_step with graphs disabled (the eager path, which must
equal the documented eager loop bit for bit) and its argument checks."""

import copy
import logging
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from _asserts import assert_bitwise_equal
from _spawn import run_ranks
from cudagraphs import (
    CudaGraphInputError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    GraphReleasedError,
    SignatureMismatchError,
)
from cudagraphs.errors import NoCudaDeviceError
from cudagraphs.train import (
    DEFAULT_BUCKET_MB,
    TrainStepOptions,
    all_reduce_gradients,
    graph_train_step,
    plan_buckets,
    plan_optimizer,
    prepare_optimizer,
)
from cudagraphs.train import optimizers as optimizers_module
from cudagraphs.train.optimizers import HyperparameterGuard, OptimizerSnapshot, StateKeeper

STEPS = 5
WORLD_SIZE = 2


# ---- helpers -------------------------------------------------------------------------
def _param(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype))


def _set_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def _steps(opt, params, n, seed=100):
    for i in range(n):
        _set_grads(params, seed + i)
        opt.step()


def _group_values(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _step_fn(model):
    def step(batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return step


def _batches(n, seed=1, rows=2):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(n)
    ]


def _eager_loop(step_fn, opt, batches, *, max_grad_norm=None, accumulation=1, reduce=False):
    """The eager equivalent documented by graph_train_step, step after step."""
    params = [p for g in opt.param_groups for p in g["params"]]
    losses = []
    for b in batches:
        for p in params:
            p.grad = None
        mbs = b if accumulation > 1 else [b]
        ls = [step_fn(mb).detach() for mb in mbs]
        if reduce:
            all_reduce_gradients(params)
        if max_grad_norm is not None:
            with_grad = [p for p in params if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm, foreach=True)
        opt.step()
        losses.append(ls[0] if accumulation == 1 else torch.stack(ls))
    return losses


def _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses):
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_bitwise_equal(a, b, f"loss of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), f"parameter {name}")
    params = [p for g in opt.param_groups for p in g["params"]]
    ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
    for p, q in zip(params, ref_params):
        assert set(opt.state[p]) == set(ref_opt.state[q])
        for key, value in ref_opt.state[q].items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(opt.state[p][key], value, f"optimizer state {key}")


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
}


def _build(opt_name):
    model = _make_model()
    ref_model = copy.deepcopy(model)
    make = OPTIMIZERS[opt_name]
    opt, ref_opt = make(model.parameters()), make(ref_model.parameters())
    prepare_optimizer(ref_opt)  # the documented reference; a no-op on the CPU
    return model, opt, ref_model, ref_opt


@pytest.fixture
def disabled(monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")


# ---- plan_optimizer ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_plan_adam_auto_on_cuda_is_capturable_fused_with_a_device_lr(cls):
    opt = cls([_param(3)], lr=1e-3)
    before = _group_values(opt)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.index == 0
    assert plan.settings == {"capturable": True, "fused": True, "foreach": False}
    assert plan.device_lr is True
    assert plan.changes == (
        "param_groups[0]['capturable'] = True",
        "param_groups[0]['fused'] = True",
        "param_groups[0]['foreach'] = False",
        "param_groups[0]['lr'] = a tensor on the device",
    )
    assert _group_values(opt) == before  # pure


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_plan_adam_keep_on_cuda_is_capturable_only_with_a_device_lr(cls):
    opt = cls([_param(3)], lr=1e-3)
    (plan,) = plan_optimizer(opt, "keep", "cuda")
    assert plan.settings == {"capturable": True}
    assert plan.device_lr is True
    assert plan.changes == (
        "param_groups[0]['capturable'] = True",
        "param_groups[0]['lr'] = a tensor on the device",
    )


def test_plan_sgd_auto_on_cuda_is_fused_with_a_device_lr():
    opt = torch.optim.SGD([_param(3)], lr=0.1, momentum=0.9)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"fused": True, "foreach": False}
    assert "capturable" not in plan.settings  # SGD has no step counter
    assert plan.device_lr is True
    assert plan.changes[-1] == "param_groups[0]['lr'] = a tensor on the device"


def test_plan_sgd_keep_on_cuda_changes_nothing_and_bakes_the_lr():
    opt = torch.optim.SGD([_param(3)], lr=0.1, momentum=0.9)
    (plan,) = plan_optimizer(opt, "keep", "cuda")
    assert plan.settings == {}
    assert plan.device_lr is False
    assert plan.changes == ()


def test_plan_sgd_keep_with_fused_already_set_reads_a_device_lr():
    opt = torch.optim.SGD([_param(3)], lr=0.1)
    opt.param_groups[0]["fused"] = True
    (plan,) = plan_optimizer(opt, "keep", "cuda")
    assert plan.settings == {}
    assert plan.device_lr is True


@pytest.mark.parametrize("impl", ["auto", "keep"])
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_plan_on_cpu_plans_nothing(cls, impl):
    opt = cls([_param(3)], lr=0.1)
    plans = plan_optimizer(opt, impl, "cpu")
    assert len(plans) == 1
    assert plans[0].settings == {}
    assert plans[0].device_lr is False
    assert plans[0].changes == ()


def test_plan_does_not_replan_values_already_set():
    opt = torch.optim.Adam([_param(3)], lr=1e-3)
    group = opt.param_groups[0]
    group["fused"] = True
    group["capturable"] = True
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"foreach": False}
    assert plan.changes == (
        "param_groups[0]['foreach'] = False",
        "param_groups[0]['lr'] = a tensor on the device",
    )
    group["foreach"] = False
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {}
    assert plan.device_lr is True  # the lr is still a number
    assert plan.changes == ("param_groups[0]['lr'] = a tensor on the device",)


def test_plan_with_fused_already_set_keeps_foreach_false_from_the_constructor():
    opt = torch.optim.AdamW([_param(3)], lr=1e-3, foreach=False)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"capturable": True, "fused": True}


def test_plan_does_not_fuse_a_group_with_an_integer_parameter():
    opt = torch.optim.Adam([_param(3), torch.zeros(3, dtype=torch.int64)], lr=1e-3)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"capturable": True}
    assert plan.device_lr is True  # capturable Adam reads a device lr
    sgd = torch.optim.SGD([_param(3), torch.zeros(3, dtype=torch.int32)], lr=0.1)
    (plan,) = plan_optimizer(sgd, "auto", "cuda")
    assert plan.settings == {}
    assert plan.device_lr is False


def test_plan_does_not_fuse_a_differentiable_group():
    opt = torch.optim.Adam([_param(3)], lr=1e-3, differentiable=True)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"capturable": True}
    sgd = torch.optim.SGD([_param(3)], lr=0.1, differentiable=True)
    (plan,) = plan_optimizer(sgd, "auto", "cuda")
    assert plan.settings == {}
    assert plan.device_lr is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_plan_fuses_every_floating_dtype_the_fused_kernels_take(dtype):
    opt = torch.optim.SGD([_param(3, dtype=dtype)], lr=0.1)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"fused": True, "foreach": False}


def test_plan_gives_a_tensor_lr_no_device_lr():
    opt = torch.optim.Adam([_param(3)], lr=torch.tensor(1e-3), foreach=False)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"capturable": True, "fused": True}
    assert plan.device_lr is False
    assert not any("'lr'" in line for line in plan.changes)


def test_plan_names_each_group_by_index():
    a, b = _param(3), _param(2, seed=1)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": torch.tensor(0.5)}], lr=0.1)
    plans = plan_optimizer(opt, "auto", "cuda")
    assert [p.index for p in plans] == [0, 1]
    assert plans[0].device_lr is True
    assert plans[1].device_lr is False
    assert plans[1].changes == (
        "param_groups[1]['fused'] = True",
        "param_groups[1]['foreach'] = False",
    )
    assert all(line.startswith("param_groups[0]") for line in plans[0].changes)


def test_plan_refuses_an_unknown_implementation():
    opt = torch.optim.Adam([_param(3)])
    with pytest.raises(CudaGraphsValueError, match=r"optimizer_impl must be one of.*'fast'"):
        plan_optimizer(opt, "fast", "cuda")


def test_plan_refuses_another_optimizer_naming_its_type():
    opt = torch.optim.RMSprop([_param(3)])
    with pytest.raises(CudaGraphsTypeError, match="got RMSprop"):
        plan_optimizer(opt, "auto", "cuda")
    with pytest.raises(CudaGraphsTypeError, match="got RMSprop"):
        plan_optimizer(opt, "auto", "cpu")


def test_plan_accepts_subclasses():
    class MyAdamW(torch.optim.AdamW):
        pass

    (plan,) = plan_optimizer(MyAdamW([_param(3)]), "keep", "cuda")
    assert plan.settings == {"capturable": True}


# ---- prepare_optimizer ---------------------------------------------------------------
@pytest.mark.parametrize("impl", ["auto", "keep"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_prepare_on_cpu_parameters_changes_nothing(name, impl):
    params = [_param(3), _param(2, 2, seed=1)]
    opt = OPTIMIZERS[name](params)
    _steps(opt, params, 2)
    before = _group_values(opt)
    lr = opt.param_groups[0]["lr"]
    state = {id(p): dict(opt.state[p]) for p in params}
    plans = prepare_optimizer(opt, impl)
    assert [p.changes for p in plans] == [()]
    assert [p.settings for p in plans] == [{}]
    assert _group_values(opt) == before
    assert opt.param_groups[0]["lr"] is lr
    for p in params:
        assert opt.state[p].keys() == state[id(p)].keys()
        assert all(opt.state[p][k] is v for k, v in state[id(p)].items())


def test_prepare_applies_a_cuda_plan_once(monkeypatch, caplog):
    # The apply half of prepare_optimizer, with the plan it would make for CUDA
    # parameters (there is no GPU here; the plan itself is tested above).
    real = optimizers_module.plan_optimizer
    monkeypatch.setattr(
        optimizers_module, "plan_optimizer", lambda opt, impl, _device: real(opt, impl, "cuda")
    )
    opt = torch.optim.AdamW([_param(3)], lr=0.25)
    with caplog.at_level(logging.INFO, logger="cudagraphs.train.optimizers"):
        plans = prepare_optimizer(opt)
    group = opt.param_groups[0]
    assert (group["capturable"], group["fused"], group["foreach"]) == (True, True, False)
    lr = group["lr"]
    assert isinstance(lr, torch.Tensor)
    assert lr.dtype == torch.float32 and lr.shape == () and lr.device.type == "cpu"
    assert lr.item() == 0.25
    logged = [r.getMessage() for r in caplog.records]
    for line in plans[0].changes:
        assert f"optimizer prepared for capture: {line}" in logged
    # Applying it twice changes nothing the second time.
    again = prepare_optimizer(opt)
    assert again[0].changes == () and again[0].settings == {}
    assert opt.param_groups[0]["lr"] is lr


# ---- OptimizerSnapshot ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_snapshot_restores_parameters_and_earlier_state_into_the_same_tensors(name):
    params = [_param(3), _param(2, 2, seed=1)]
    opt = OPTIMIZERS[name](params)
    _steps(opt, params, 2)
    saved_params = [p.detach().clone() for p in params]
    saved_state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    objects = {id(p): dict(opt.state[p]) for p in params}
    snapshot = OptimizerSnapshot.take(opt)
    _steps(opt, params, 3, seed=200)
    assert not torch.equal(params[0].detach(), saved_params[0])  # the steps did something
    snapshot.restore(opt)
    for p, saved in zip(params, saved_params):
        assert_bitwise_equal(p.detach(), saved, "restored parameter")
        assert set(opt.state[p]) == set(saved_state[id(p)])
        for key, value in saved_state[id(p)].items():
            assert opt.state[p][key] is objects[id(p)][key], f"{key} was replaced"
            assert_bitwise_equal(opt.state[p][key], value, f"restored state {key}")


@pytest.mark.parametrize(
    ("name", "keys"),
    [("adam", {"step", "exp_avg", "exp_avg_sq"}), ("sgd_momentum", {"momentum_buffer"})],
)
def test_snapshot_zeroes_state_created_after_it(name, keys):
    params = [_param(3), _param(2, 2, seed=1)]
    opt = OPTIMIZERS[name](params)
    saved = [p.detach().clone() for p in params]
    snapshot = OptimizerSnapshot.take(opt)
    _steps(opt, params, 3)
    objects = {id(p): dict(opt.state[p]) for p in params}
    snapshot.restore(opt)
    for p, s in zip(params, saved):
        assert_bitwise_equal(p.detach(), s, "restored parameter")
        assert set(opt.state[p]) == keys
        for key in keys:
            value = opt.state[p][key]
            assert value is objects[id(p)][key]
            assert not value.any(), f"{key} not zeroed"


def test_snapshot_restores_a_parameter_without_optimizer_state():
    a, b = _param(3), _param(2, seed=1)
    opt = torch.optim.Adam([a, b], lr=0.1, foreach=False)
    snapshot = OptimizerSnapshot.take(opt)
    saved_b = b.detach().clone()
    with torch.no_grad():
        b.add_(1.0)
    a.grad = torch.ones(3)
    opt.step()
    snapshot.restore(opt)
    assert_bitwise_equal(b.detach(), saved_b, "parameter without state")
    assert b not in opt.state


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum"])
def test_after_restore_the_optimizer_steps_as_a_fresh_one(name):
    def run(warmup):
        params = [_param(3), _param(2, 2, seed=1)]
        opt = OPTIMIZERS[name](params)
        if warmup:
            snapshot = OptimizerSnapshot.take(opt)
            _steps(opt, params, 3, seed=300)
            snapshot.restore(opt)
        _steps(opt, params, 4)
        return [p.detach().clone() for p in params]

    for a, b in zip(run(True), run(False)):
        assert_bitwise_equal(a, b, "parameter after warmup and restore")


def test_sgd_with_momentum_and_dampening_is_refused_by_group():
    # Its first step sets the momentum buffer to the gradient; the graph, captured after
    # warmup, holds a later step, which scales by (1 - dampening): not the same step.
    params = [_param(3), _param(2, 2, seed=1)]
    opt = torch.optim.SGD(
        [{"params": params[:1]}, {"params": params[1:], "dampening": 0.5}],
        lr=0.1,
        momentum=0.9,
    )
    with pytest.raises(CudaGraphsValueError, match=r"param_groups\[1\].*dampening=0.5"):
        plan_optimizer(opt, "auto", "cuda")
    # Without momentum, dampening changes nothing and is accepted.
    plan_optimizer(torch.optim.SGD(params, lr=0.1, dampening=0.5), "auto", "cuda")


# ---- HyperparameterGuard -------------------------------------------------------------
def _tensor_lr_adam(lr=1e-3, **kwargs):
    return torch.optim.Adam([_param(3)], lr=torch.tensor(lr), foreach=False, **kwargs)


def test_guard_writes_a_number_assigned_to_the_lr_into_the_device_lr():
    opt = _tensor_lr_adam()
    lr = opt.param_groups[0]["lr"]
    guard = HyperparameterGuard.watch(opt)
    assert guard.lrs == [lr]
    opt.param_groups[0]["lr"] = 0.5
    guard.check()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == 0.5
    guard.check()  # nothing changed since
    assert lr.item() == 0.5


def test_guard_copies_a_replacing_one_element_tensor_into_the_device_lr():
    opt = _tensor_lr_adam()
    lr = opt.param_groups[0]["lr"]
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["lr"] = torch.tensor([0.25])
    guard.check()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.shape == () and lr.item() == 0.25


def test_guard_refuses_a_replacing_lr_tensor_of_several_elements():
    opt = _tensor_lr_adam()
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])
    with pytest.raises(CudaGraphsStateError, match=r"param_groups\[0\]\['lr'\].*2 elements"):
        guard.check()


def test_guard_lets_a_scheduler_write_the_device_lr_in_place():
    opt = _tensor_lr_adam(lr=0.1)
    lr = opt.param_groups[0]["lr"]
    guard = HyperparameterGuard.watch(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    guard.check()  # 'initial_lr', added by the scheduler, is bookkeeping
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.05)


def test_guard_refuses_a_changed_weight_decay_naming_group_key_and_values():
    opt = _tensor_lr_adam()
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(
        CudaGraphsStateError,
        match=r"param_groups\[0\]\['weight_decay'\]: captured 0, now 0\.1",
    ):
        guard.check()


def test_guard_refuses_changed_betas():
    opt = _tensor_lr_adam()
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["betas"] = (0.8, 0.999)
    with pytest.raises(
        CudaGraphsStateError,
        match=r"param_groups\[0\]\['betas'\]: captured \(0\.9, 0\.999\), now \(0\.8, 0\.999\)",
    ):
        guard.check()


def test_guard_names_every_changed_key_at_once():
    a, b = _param(3), _param(2, seed=1)
    opt = torch.optim.Adam([{"params": [a]}, {"params": [b]}], lr=torch.tensor(1e-3), foreach=False)
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["weight_decay"] = 0.1
    opt.param_groups[0]["eps"] = 1e-6
    opt.param_groups[1]["amsgrad"] = True
    with pytest.raises(CudaGraphsStateError) as info:
        guard.check()
    message = str(info.value)
    assert "param_groups[0]['weight_decay']: captured 0, now 0.1" in message
    assert "param_groups[0]['eps']: captured 1e-08, now 1e-06" in message
    assert "param_groups[1]['amsgrad']: captured False, now True" in message
    assert "'betas'" not in message
    assert message.index("param_groups[0]") < message.index("param_groups[1]")  # in order


def test_guard_refuses_a_changed_float_lr_which_is_baked():
    opt = torch.optim.SGD([_param(3)], lr=0.1, foreach=False)
    guard = HyperparameterGuard.watch(opt)
    assert guard.lrs == [None]
    opt.param_groups[0]["lr"] = 0.2
    with pytest.raises(
        CudaGraphsStateError, match=r"param_groups\[0\]\['lr'\]: captured 0\.1, now 0\.2"
    ):
        guard.check()
    opt.param_groups[0]["lr"] = 0.1  # back to the captured value: accepted
    guard.check()


def test_guard_refuses_an_added_parameter_group():
    opt = _tensor_lr_adam()
    guard = HyperparameterGuard.watch(opt)
    opt.add_param_group({"params": [_param(2, seed=1)]})
    with pytest.raises(CudaGraphsStateError, match="2 parameter groups.*captured with 1"):
        guard.check()


def test_guard_ignores_initial_lr_added_or_changed():
    opt = torch.optim.SGD([_param(3)], lr=0.1, foreach=False)
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["initial_lr"] = 0.1
    guard.check()
    opt.param_groups[0]["initial_lr"] = 0.7
    guard.check()
    watched = HyperparameterGuard.watch(opt)  # present when watched: still ignored
    opt.param_groups[0]["initial_lr"] = 0.9
    watched.check()


def test_guard_accepts_equal_values_in_new_objects():
    opt = _tensor_lr_adam(weight_decay=0.01)
    guard = HyperparameterGuard.watch(opt)
    group = opt.param_groups[0]
    betas, weight_decay = group["betas"], group["weight_decay"]
    group["betas"] = tuple(list(betas))
    group["weight_decay"] = float(str(weight_decay))
    assert group["betas"] is not betas and group["weight_decay"] is not weight_decay
    guard.check()


def test_guard_accepts_a_state_load_of_the_same_hyperparameters():
    opt = _tensor_lr_adam(weight_decay=0.01)
    lr = opt.param_groups[0]["lr"]
    guard = HyperparameterGuard.watch(opt)
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)  # torch deep-copies the groups: a new lr tensor
    assert opt.param_groups[0]["lr"] is not lr
    guard.check()
    assert opt.param_groups[0]["lr"] is lr


# ---- StateKeeper ---------------------------------------------------------------------
def _adam_with_keeper(steps=2):
    params = [_param(3), _param(2, 2, seed=1)]
    opt = torch.optim.Adam(params, lr=torch.tensor(0.01), foreach=False)
    _steps(opt, params, steps)
    return params, opt, StateKeeper.install(opt)


def test_keeper_loads_a_state_dict_into_the_captured_tensors():
    params, opt, keeper = _adam_with_keeper()
    objects = {id(p): dict(opt.state[p]) for p in params}
    lr = opt.param_groups[0]["lr"]
    saved = copy.deepcopy(opt.state_dict())
    expected = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    _steps(opt, params, 3, seed=500)
    lr.fill_(0.003)  # as a scheduler would
    opt.load_state_dict(saved)
    for p in params:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in expected[id(p)].items():
            assert opt.state[p][key] is objects[id(p)][key], f"{key} was replaced"
            assert_bitwise_equal(opt.state[p][key], value, f"loaded {key}")
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.01)
    keeper.remove()


def test_keeper_zeroes_the_captured_tensors_on_a_state_saved_before_any_step():
    params = [_param(3), _param(2, 2, seed=1)]
    opt = torch.optim.Adam(params, lr=torch.tensor(0.01), foreach=False)
    fresh = copy.deepcopy(opt.state_dict())
    assert fresh["state"] == {}
    _steps(opt, params, 2)
    objects = {id(p): dict(opt.state[p]) for p in params}
    StateKeeper.install(opt)
    opt.load_state_dict(fresh)
    for p in params:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in objects[id(p)].items():
            assert opt.state[p][key] is value
            assert not value.any(), f"{key} not zeroed"


def test_keeper_fills_a_number_lr_and_puts_back_the_prepared_settings():
    params, opt, _ = _adam_with_keeper()
    lr = opt.param_groups[0]["lr"]
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 0.125  # a checkpoint of an unprepared optimizer
    saved["param_groups"][0]["foreach"] = True
    saved["param_groups"][0]["capturable"] = True
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert group["lr"] is lr and lr.item() == 0.125
    assert group["foreach"] is False
    assert group["capturable"] is False


def test_keeper_leaves_other_loaded_hyperparameters_to_the_guard():
    params, opt, _ = _adam_with_keeper()
    guard = HyperparameterGuard.watch(opt)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["weight_decay"] = 0.5
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["weight_decay"] == 0.5
    with pytest.raises(CudaGraphsStateError, match=r"\['weight_decay'\]: captured 0, now 0\.5"):
        guard.check()


def test_keeper_remove_detaches_the_hook():
    params, opt, keeper = _adam_with_keeper()
    objects = {id(p): dict(opt.state[p]) for p in params}
    lr = opt.param_groups[0]["lr"]
    saved = copy.deepcopy(opt.state_dict())
    keeper.remove()
    assert keeper.handle is None
    keeper.remove()  # twice is fine
    opt.load_state_dict(saved)
    for p in params:
        for key, value in objects[id(p)].items():
            assert opt.state[p][key] is not value  # torch's load replaced them
    assert opt.param_groups[0]["lr"] is not lr


# ---- plan_buckets --------------------------------------------------------------------
def _grads(*specs):
    return [torch.zeros(n, dtype=dtype) for n, dtype in specs]


def _layout(buckets, grads):
    index = {id(g): i for i, g in enumerate(grads)}
    return [[index[id(g)] for g in b.grads] for b in buckets]


F32, F64 = torch.float32, torch.float64
CAP_104_BYTES = 104 / 2**20  # bucket_mb whose cap is exactly 104 bytes


def test_buckets_split_on_a_dtype_change_and_keep_order():
    grads = _grads((3, F32), (4, F32), (2, F64), (5, F32), (1, F32))
    buckets = plan_buckets(grads)
    assert _layout(buckets, grads) == [[0, 1], [2], [3, 4]]
    assert [b.numels for b in buckets] == [(3, 4), (2,), (5, 1)]
    assert [b.nbytes for b in buckets] == [28, 16, 24]
    assert all(b.grads[0] is grads[i] for b, i in zip(buckets, [0, 2, 3]))


def test_buckets_split_on_a_device_change():
    grads = [torch.zeros(3), torch.zeros(3, device="meta"), torch.zeros(3, device="meta")]
    assert _layout(plan_buckets(grads), grads) == [[0], [1, 2]]


def test_buckets_respect_the_size_cap_with_the_cap_itself_allowed():
    # 13 float32 = 52 bytes: two fill the 104-byte cap exactly, a third starts a bucket.
    grads = _grads((13, F32), (13, F32), (13, F32), (1, F32), (12, F32), (1, F32))
    buckets = plan_buckets(grads, bucket_mb=CAP_104_BYTES)
    assert _layout(buckets, grads) == [[0, 1], [2, 3, 4], [5]]
    assert [b.nbytes for b in buckets] == [104, 104, 4]


def test_buckets_cap_with_a_small_float_bucket_mb():
    grads = _grads((10, F32), (10, F32), (10, F32), (10, F32), (10, F32))
    # 1e-4 MiB = 104 bytes: two 40-byte gradients fit, a third does not.
    assert _layout(plan_buckets(grads, bucket_mb=1e-4), grads) == [[0, 1], [2, 3], [4]]


def test_an_oversized_gradient_sits_alone_in_its_bucket():
    grads = _grads((2, F32), (40, F32), (2, F32), (3, F32))
    buckets = plan_buckets(grads, bucket_mb=CAP_104_BYTES)
    assert _layout(buckets, grads) == [[0], [1], [2, 3]]
    assert buckets[1].nbytes == 160


def test_buckets_with_the_default_cap_hold_everything_of_one_dtype():
    grads = _grads((1000, F32), (2000, F32), (3000, F32))
    assert DEFAULT_BUCKET_MB == 25.0
    assert _layout(plan_buckets(grads), grads) == [[0, 1, 2]]
    assert plan_buckets([]) == []


@pytest.mark.parametrize("bucket_mb", [0, 0.0, -1.0])
def test_buckets_refuse_a_non_positive_size(bucket_mb):
    with pytest.raises(CudaGraphsValueError, match="bucket_mb must be positive"):
        plan_buckets(_grads((3, F32)), bucket_mb=bucket_mb)


def test_buckets_refuse_a_size_that_is_not_a_number():
    with pytest.raises(CudaGraphsTypeError, match="bucket_mb must be a number"):
        plan_buckets(_grads((3, F32)), bucket_mb="25")


# ---- all_reduce_gradients on two gloo ranks ------------------------------------------
# (shape, dtype, has a gradient): mixed dtypes, so several buckets; one without grad.
_REDUCE_PARAMS = [
    ((3, 4), "float32", True),
    ((5,), "float32", True),
    ((2, 2), "float64", True),
    ((7,), "float32", False),
    ((6,), "float64", True),
    ((4,), "float32", True),
]


def _rank_grads(rank):
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        torch.randn(shape, generator=g, dtype=getattr(torch, dtype)) * (rank + 1)
        if has_grad
        else None
        for shape, dtype, has_grad in _REDUCE_PARAMS
    ]


def _reduce_params(rank):
    params = []
    for (shape, dtype, _), grad in zip(_REDUCE_PARAMS, _rank_grads(rank)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)))
        p.grad = grad
        params.append(p)
    return params


def _all_reduce_worker(rank):
    out = {}
    for name, kwargs in [("default", {}), ("small_buckets", {"bucket_mb": 1e-5})]:
        params = _reduce_params(rank)
        grads = [p.grad for p in params]
        all_reduce_gradients(params, **kwargs)
        out[name] = [
            None
            if p.grad is None
            else {
                "same_tensor": p.grad is g,
                "dtype": str(p.grad.dtype),
                "values": p.grad.flatten().tolist(),
            }
            for p, g in zip(params, grads)
        ]
    return out


@pytest.mark.spawns
def test_all_reduce_gradients_averages_over_two_gloo_ranks(tmp_path):
    results = run_ranks(_all_reduce_worker, WORLD_SIZE, tmp_path)
    per_rank = [_rank_grads(r) for r in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        for name in ("default", "small_buckets"):
            got = result[name]
            assert len(got) == len(_REDUCE_PARAMS)
            for i, (_shape, dtype, has_grad) in enumerate(_REDUCE_PARAMS):
                if not has_grad:
                    assert got[i] is None, f"rank {rank} {name}: param {i} got a gradient"
                    continue
                assert got[i]["same_tensor"], "the gradient was replaced, not written"
                assert got[i]["dtype"] == f"torch.{dtype}"
                expected = (per_rank[0][i] + per_rank[1][i]) / WORLD_SIZE
                actual = torch.tensor(got[i]["values"], dtype=expected.dtype)
                assert_bitwise_equal(
                    actual, expected.flatten(), f"rank {rank} {name}: mean gradient {i}"
                )
    assert results[0] == results[1]


# ---- graph_train_step with graphs disabled -------------------------------------------
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_disabled_step_is_eager_and_equals_the_eager_loop(disabled, name):
    model, opt, ref_model, ref_opt = _build(name)
    initial = [p.detach().clone() for p in model.parameters()]
    batches = _batches(STEPS)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt)
    assert step.graphed is False
    assert step.stats.graphs == 0
    assert step.stats.accumulation_steps == 1
    assert step.stats.all_reduce is False
    assert step.stats.optimizer_changes == ()
    assert step.grad_norm is None
    assert all(p.grad is None for p in model.parameters())  # nothing ran yet
    for p, q in zip(model.parameters(), initial):
        assert_bitwise_equal(p.detach(), q, "parameter before the first step")
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches)
    _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    assert all(loss.shape == () and not loss.requires_grad for loss in losses)
    assert not any(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), initial))
    assert all(p.grad is not None for p in model.parameters())  # the last step's


def test_disabled_step_clips_as_the_eager_loop(disabled):
    model, opt, ref_model, ref_opt = _build("sgd_momentum")
    unclipped_model = copy.deepcopy(ref_model)
    unclipped_opt = OPTIMIZERS["sgd_momentum"](unclipped_model.parameters())
    batches = _batches(STEPS)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, max_grad_norm=0.01)
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches, max_grad_norm=0.01)
    _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    _eager_loop(_step_fn(unclipped_model), unclipped_opt, batches)
    # The clipping did clip: without it the parameters end elsewhere.
    assert not torch.equal(model.weight.detach(), unclipped_model.weight.detach())
    assert step.grad_norm is None  # only a graphed step exposes it


def test_disabled_step_accumulates_micro_batches_as_the_eager_loop(disabled):
    model, opt, ref_model, ref_opt = _build("adamw")
    flat = _batches(2 * STEPS)
    batches = [flat[i : i + 2] for i in range(0, len(flat), 2)]
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    assert step.stats.graphs == 0 and step.stats.accumulation_steps == 2
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches, accumulation=2)
    assert losses[0].shape == (2,)
    _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    step(tuple(flat[:2]))  # a tuple of micro-batches is a batch too


def test_disabled_step_refuses_a_wrong_number_of_micro_batches(disabled):
    model, opt, *_ = _build("sgd_momentum")
    flat = _batches(3)
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    with pytest.raises(CudaGraphsTypeError, match="accumulation_steps=2.*got a list of 3"):
        step(flat)
    with pytest.raises(CudaGraphsTypeError, match="accumulation_steps=2.*got a list of 1"):
        step(flat[:1])
    with pytest.raises(CudaGraphsTypeError, match="accumulation_steps=2.*got a tuple of 3"):
        step(tuple(flat))
    assert all(p.grad is None for p in model.parameters())


def test_disabled_step_refuses_a_non_list_with_accumulation(disabled):
    model, opt, *_ = _build("sgd_momentum")
    flat = _batches(2)
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    with pytest.raises(CudaGraphsTypeError, match="list or tuple of 2 micro-batches; got a Tensor"):
        step(flat[0][0])


def test_disabled_step_refuses_a_batch_of_another_shape_before_any_work(disabled):
    model, opt, *_ = _build("adamw")
    batches = _batches(2)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt)
    step(batches[0])
    before = [p.detach().clone() for p in model.parameters()]
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    wrong = _batches(1, rows=3)[0]
    with pytest.raises(CudaGraphInputError, match=r"batch\[0\]: shape") as info:
        step(wrong)
    assert isinstance(info.value, SignatureMismatchError)
    assert info.value.mismatches and info.value.mismatches[0].field == "shape"
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "parameter after a refused batch")
    for p, e in zip(model.parameters(), exp_avg):
        assert_bitwise_equal(opt.state[p]["exp_avg"], e, "exp_avg after a refused batch")


def test_disabled_step_names_the_bad_micro_batch(disabled):
    model, opt, *_ = _build("sgd_momentum")
    flat = _batches(2)
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    bad = (flat[1][0].double(), flat[1][1])
    with pytest.raises(SignatureMismatchError, match=r"batch\[1\]\[0\]: dtype"):
        step([flat[0], bad])
    assert all(p.grad is None for p in model.parameters())  # refused before step_fn ran


def test_disabled_step_refuses_a_step_fn_returning_no_tensor(disabled):
    model, opt, *_ = _build("sgd_momentum")
    batch = _batches(1)[0]

    def returns_float(b):
        loss = _step_fn(model)(b)
        return loss.item()

    step = graph_train_step(returns_float, batch, optimizer=opt)
    with pytest.raises(CudaGraphsTypeError, match="returned float"):
        step(batch)


def test_disabled_step_refuses_a_step_fn_without_backward(disabled):
    model, opt, *_ = _build("sgd_momentum")
    before = [p.detach().clone() for p in model.parameters()]
    batch = _batches(1)[0]

    def forward_only(b):
        x, y = b
        return torch.nn.functional.mse_loss(model(x), y)

    step = graph_train_step(forward_only, batch, optimizer=opt)
    with pytest.raises(CudaGraphsValueError, match=r"loss\.backward\(\)"):
        step(batch)
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "parameter after a step without gradients")
    assert opt.state == {}


def test_disabled_step_after_reset_raises(disabled):
    model, opt, *_ = _build("sgd_momentum")
    batch = _batches(1)[0]
    step = graph_train_step(_step_fn(model), batch, optimizer=opt)
    step(batch)
    step.reset()
    assert step.graphed is False
    with pytest.raises(GraphReleasedError, match="reset"):
        step(batch)
    with pytest.raises(GraphReleasedError):
        step.capture()


def test_an_invalid_disable_flag_is_refused_naming_it(monkeypatch):
    model, opt, *_ = _build("sgd_momentum")
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "maybe")
    with pytest.raises(CudaGraphsValueError, match="CUDAGRAPHS_DISABLE='maybe'"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable GPU")
def test_without_a_gpu_graph_train_step_raises_no_cuda_device(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    model, opt, *_ = _build("adamw")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NoCudaDeviceError, match="graph_train_step needs a CUDA device") as info:
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)
    assert isinstance(info.value, CudaGraphsStateError)
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "parameter after the refusal")
    assert all(p.grad is None for p in model.parameters())
    assert opt.state == {}


# ---- argument checks -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_grad_norm": 0.0}, CudaGraphsValueError, "max_grad_norm must be positive"),
        ({"max_grad_norm": -1.0}, CudaGraphsValueError, "max_grad_norm must be positive"),
        ({"max_grad_norm": float("nan")}, CudaGraphsValueError, "max_grad_norm must be positive"),
        ({"max_grad_norm": "1.0"}, CudaGraphsTypeError, "max_grad_norm must be a number"),
        (
            {"accumulation_steps": 0},
            CudaGraphsValueError,
            r"accumulation_steps must be an int >= 1",
        ),
        ({"accumulation_steps": 2.0}, CudaGraphsTypeError, "accumulation_steps must be an int"),
        ({"warmup_steps": 0}, CudaGraphsValueError, r"warmup_steps must be an int >= 1"),
        ({"warmup_steps": True}, CudaGraphsTypeError, "warmup_steps must be an int"),
        ({"all_reduce": "yes"}, CudaGraphsTypeError, "all_reduce must be a bool"),
        ({"all_reduce": 1}, CudaGraphsTypeError, "all_reduce must be a bool"),
    ],
)
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainStepOptions(**kwargs)
    model, opt, *_ = _build("adamw")
    with pytest.raises(error, match=match):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt, **kwargs)
    assert opt.state == {}


def test_good_options_are_kept():
    options = TrainStepOptions(max_grad_norm=1, accumulation_steps=4, warmup_steps=1)
    assert (options.max_grad_norm, options.accumulation_steps, options.warmup_steps) == (1, 4, 1)
    assert TrainStepOptions().optimizer_impl == "auto"
    assert TrainStepOptions().bucket_mb == DEFAULT_BUCKET_MB


def test_a_step_fn_that_is_not_callable_is_refused(disabled):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsTypeError, match="step_fn must be callable"):
        graph_train_step("step", _batches(1)[0], optimizer=opt)


def test_an_optimizer_that_is_not_a_torch_optimizer_is_refused(disabled):
    model, _, *_ = _build("adamw")
    with pytest.raises(CudaGraphsTypeError, match="optimizer must be a torch optimizer"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=list(model.parameters()))


def test_an_unsupported_optimizer_is_refused_naming_its_type(disabled):
    model = _make_model()
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(CudaGraphsTypeError, match="got RMSprop"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)


def test_an_unknown_optimizer_impl_is_refused(disabled):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsValueError, match="optimizer_impl must be one of"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt, optimizer_impl="fast")


@pytest.mark.parametrize("sample", [None, [], {"a": None}, ((),)])
def test_a_sample_batch_without_a_tensor_is_refused(disabled, sample):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsValueError, match="sample_batch holds no tensor"):
        graph_train_step(_step_fn(model), sample, optimizer=opt)


def test_a_sample_batch_with_a_python_number_is_refused_by_path(disabled):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsTypeError, match=r"sample_batch\[1\]: unsupported leaf"):
        graph_train_step(_step_fn(model), (torch.zeros(2, 4), 3), optimizer=opt)


def test_an_optimizer_without_parameters_is_refused(disabled):
    model, opt, *_ = _build("adamw")
    opt.param_groups[0]["params"] = []
    with pytest.raises(CudaGraphsValueError, match="holds no parameters"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)


# ---- TrainStepOptions.reduces --------------------------------------------------------
def test_reduces_as_asked_else_only_when_distributed():
    assert not torch.distributed.is_initialized()
    assert TrainStepOptions(all_reduce=True).reduces() is True
    assert TrainStepOptions(all_reduce=False).reduces() is False
    assert TrainStepOptions().reduces() is False


# ---- the disabled step on two gloo ranks ---------------------------------------------
def _train_step_worker(rank):
    os.environ["CUDAGRAPHS_DISABLE"] = "1"
    singles = [torch.distributed.new_group([r]) for r in range(WORLD_SIZE)]
    model = _make_model()
    ref_model = copy.deepcopy(model)
    opt = OPTIMIZERS["adamw"](model.parameters())
    ref_opt = OPTIMIZERS["adamw"](ref_model.parameters())
    batches = _batches(STEPS, seed=10 + rank)  # each rank its own data
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, max_grad_norm=0.5)
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches, max_grad_norm=0.5, reduce=True)
    return {
        "reduces_default": TrainStepOptions().reduces(),
        "reduces_own_group": TrainStepOptions(process_group=singles[rank]).reduces(),
        "reduces_false": TrainStepOptions(all_reduce=False).reduces(),
        "stats_all_reduce": step.stats.all_reduce,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
        "params_equal": all(
            torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())
        ),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "losses": [loss.item() for loss in losses],
    }


@pytest.mark.spawns
def test_disabled_step_on_two_ranks_averages_gradients_as_the_eager_loop(tmp_path):
    results = run_ranks(_train_step_worker, WORLD_SIZE, tmp_path)
    for r in results:
        assert r["reduces_default"] is True
        assert r["reduces_own_group"] is False
        assert r["reduces_false"] is False
        assert r["stats_all_reduce"] is True
        assert r["losses_equal"] and r["params_equal"]
    # Averaged gradients: both ranks end with the same model from different data.
    assert results[0]["losses"] != results[1]["losses"]
    assert results[0]["params"] == results[1]["params"]


# ---- review fixes: values edited in place, tensor hyperparameters, bucket_mb ---------
def test_guard_sees_a_list_hyperparameter_edited_in_place():
    opt = torch.optim.SGD([_param(3)], lr=0.1)
    opt.param_groups[0]["schedule"] = [0.9, 0.999]  # a list-valued hyperparameter
    guard = HyperparameterGuard.watch(opt)
    guard.check()
    opt.param_groups[0]["schedule"][0] = 0.8  # same list object, new value
    with pytest.raises(CudaGraphsStateError, match=r"\['schedule'\]: captured \[0.9, 0.999\]"):
        guard.check()


def test_keeper_puts_back_every_tensor_hyperparameter_after_a_load():
    params = [_param(3)]
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    opt = torch.optim.Adam(params, lr=torch.tensor(0.01), betas=betas, foreach=False)
    _steps(opt, params, 1)
    opt.param_groups[0]["eps_t"] = eps = torch.tensor(1e-8)  # any tensor-valued key
    keeper = StateKeeper.install(opt)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["eps_t"] = torch.tensor(2e-8)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["eps_t"] is eps and eps.item() == pytest.approx(2e-8)
    keeper.remove()


def test_options_refuse_a_bucket_size_that_is_not_positive():
    with pytest.raises(CudaGraphsValueError, match="bucket_mb must be positive"):
        TrainStepOptions(bucket_mb=0)
    with pytest.raises(CudaGraphsTypeError, match="bucket_mb"):
        TrainStepOptions(bucket_mb="25")


# ---- the reducer's packing, in process (a stand-in all_reduce plays the other ranks) --
def test_the_reducer_packs_reduces_divides_and_unpacks_every_gradient(monkeypatch):
    import torch.distributed as dist

    from cudagraphs.train.gradients import GradientReducer

    grads = [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.full((4,), 2.0, dtype=torch.float32),
        torch.arange(3, dtype=torch.float64),
        torch.ones(2, 2, dtype=torch.float32).t(),  # non-contiguous
    ]
    originals = [g.clone() for g in grads]
    # Two other "ranks" contribute 10x and 100x of this rank's values.
    calls = []

    def fake_all_reduce(flat, group=None):
        calls.append((flat.dtype, flat.numel(), group))
        flat.mul_(1 + 10 + 100)

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    reducer = GradientReducer(grads, group="g", bucket_mb=1e-4)  # 104 bytes per bucket
    reducer()
    for g, o in zip(grads, originals):
        assert torch.allclose(g, o * 111 / 3), (g, o)
    # One collective per bucket, each of one dtype, all on the given group.
    assert [(d, n) for d, n, _ in calls] == [
        (b.grads[0].dtype, sum(b.numels)) for b in reducer.buckets
    ]
    assert {grp for *_, grp in calls} == {"g"} and reducer.world_size == 3
    assert len(reducer.buckets) >= 3  # the dtype change and the size cap both split


def test_all_reduce_gradients_skips_parameters_without_a_gradient(monkeypatch):
    import torch.distributed as dist

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda flat, group=None: seen.append(flat.numel()))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(5))
    a.grad = torch.full((3,), 4.0)
    all_reduce_gradients([a, b])
    assert seen == [3] and b.grad is None
    assert torch.equal(a.grad, torch.full((3,), 2.0))  # the stand-in summed nothing
    seen.clear()
    all_reduce_gradients([b])  # no gradient at all: no collective
    assert seen == []


# ---- plan_optimizer: defaults, keys a group lacks, the fixes named -------------------
def test_plan_defaults_to_auto_for_cuda():
    opt = torch.optim.AdamW([_param(3)], lr=1e-3)
    assert plan_optimizer(opt) == plan_optimizer(opt, "auto", "cuda")
    assert plan_optimizer(opt)[0].settings == {"capturable": True, "fused": True, "foreach": False}


def test_plan_reads_keys_a_group_lacks_as_torch_defaults():
    # Groups are plain dicts (an optimizer subclass's own groups, a checkpoint of an
    # older torch): a missing key means torch's default, not differentiable, no
    # momentum, no dampening.
    sgd = torch.optim.SGD([_param(3)], lr=0.1, momentum=0.9)
    del sgd.param_groups[0]["differentiable"]
    del sgd.param_groups[0]["dampening"]
    (plan,) = plan_optimizer(sgd, "auto", "cuda")
    assert plan.settings == {"fused": True, "foreach": False}
    no_momentum = torch.optim.SGD([_param(3)], lr=0.1, dampening=0.5)
    del no_momentum.param_groups[0]["momentum"]
    (plan,) = plan_optimizer(no_momentum, "auto", "cuda")  # dampening without momentum
    assert plan.settings == {"fused": True, "foreach": False}


def test_plan_adam_already_capturable_still_gets_a_device_lr():
    opt = torch.optim.Adam([_param(3)], lr=1e-3, capturable=True)
    (plan,) = plan_optimizer(opt, "keep", "cuda")
    assert plan.settings == {}
    assert plan.device_lr is True  # capturable Adam reads a device lr
    assert plan.changes == ("param_groups[0]['lr'] = a tensor on the device",)


def test_plan_sgd_with_a_capturable_flag_still_bakes_its_lr():
    # SGD has no capturable mode: a flag left in its group does not make the unfused
    # kernels read a device learning rate.
    opt = torch.optim.SGD([_param(3)], lr=0.1)
    opt.param_groups[0]["capturable"] = True
    (plan,) = plan_optimizer(opt, "keep", "cuda")
    assert plan.settings == {}
    assert plan.device_lr is False
    assert plan.changes == ()


def test_refusals_name_their_fixes():
    with pytest.raises(
        CudaGraphsTypeError,
        match=r"Adam, AdamW and SGD.*use one of them.*cudagraphs\.graph_stack.*optimizer eagerly",
    ):
        plan_optimizer(torch.optim.RMSprop([_param(3)]), "auto", "cuda")
    sgd = torch.optim.SGD([_param(3)], lr=0.1, momentum=0.9, dampening=0.5)
    with pytest.raises(CudaGraphsValueError, match=r"1\. dampening=0; 2\. use Adam or AdamW"):
        plan_optimizer(sgd, "auto", "cuda")
    opt = torch.optim.SGD([_param(3)], lr=0.1)
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(
        CudaGraphsStateError,
        match=r"change only the learning rate.*cycle_momentum=False.*call reset\(\)",
    ):
        guard.check()


# ---- prepare_optimizer on (fake) CUDA parameters -------------------------------------
def _fake_cuda_param(*shape):
    # Fake tensors hold metadata only, so they can claim a CUDA device on a machine
    # without one (as in tests/core/test_canonicalize.py). Make and use them inside one
    # FakeTensorMode: the tensors prepare_optimizer creates are fake too.
    return torch.nn.Parameter(torch.empty(*shape, dtype=torch.float32, device="cuda"))


@pytest.fixture
def float64_default():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_prepare_on_cuda_parameters_applies_the_cuda_plan(float64_default):
    with FakeTensorMode():
        a, b = _fake_cuda_param(3), _fake_cuda_param(2, 2)
        opt = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=0.25)
        opt.add_param_group({"params": []})
        # A step counter left on the CPU (a checkpoint loaded before preparing), in
        # float64: it moves to its parameter's device, as float32. One already there
        # stays as it is.
        opt.state[a]["step"] = torch.tensor(3.0, dtype=torch.float64)
        on_device = opt.state[b]["step"] = torch.tensor(3.0, dtype=torch.float32, device="cuda")
        plans = prepare_optimizer(opt)
    planned = {"capturable": True, "fused": True, "foreach": False}
    assert [p.settings for p in plans] == [planned] * 3
    assert all(p.device_lr for p in plans)
    for group in opt.param_groups:
        assert {k: group[k] for k in planned} == planned
        assert isinstance(group["lr"], torch.Tensor)
        # float32 whatever torch's default dtype (float64 here)
        assert (group["lr"].dtype, group["lr"].shape) == (torch.float32, ())
    assert opt.param_groups[0]["lr"].device.type == "cuda"
    assert opt.param_groups[1]["lr"].device.type == "cuda"
    # The group without parameters has no device: its learning rate sits on the CPU.
    assert opt.param_groups[2]["lr"].device.type == "cpu"
    step = opt.state[a]["step"]
    assert (step.device.type, step.dtype) == ("cuda", torch.float32)
    assert opt.state[b]["step"] is on_device


def test_prepare_with_parameters_on_cuda_and_on_the_cpu_plans_nothing():
    with FakeTensorMode():
        cpu = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.Adam([{"params": [_fake_cuda_param(3)]}, {"params": [cpu]}], lr=0.1)
        plans = prepare_optimizer(opt)
    assert [p.settings for p in plans] == [{}, {}]
    assert [p.device_lr for p in plans] == [False, False]
    assert all(g["lr"] == 0.1 for g in opt.param_groups)


# ---- HyperparameterGuard: tensors, nested values, None -------------------------------
def test_guard_refuses_a_replaced_tensor_hyperparameter_even_of_the_same_value():
    # The graph reads a tensor hyperparameter at its captured address: a write in
    # place reaches it; a new tensor, or a number, put in its place does not.
    opt = torch.optim.SGD([_param(3)], lr=0.1)
    group = opt.param_groups[0]
    group["decay_t"] = decay = torch.tensor(0.5)
    guard = HyperparameterGuard.watch(opt)
    guard.check()
    decay.fill_(0.25)
    guard.check()
    for replacement in (torch.tensor(0.25), 0.25):
        group["decay_t"] = replacement
        with pytest.raises(
            CudaGraphsStateError,
            match=r"param_groups\[0\]\['decay_t'\]: captured tensor\(0\.2500\)",
        ):
            guard.check()
    group["decay_t"] = decay  # the captured tensor back: accepted
    guard.check()


def test_guard_sees_a_nested_list_hyperparameter_edited_in_place():
    opt = torch.optim.SGD([_param(3)], lr=0.1)
    opt.param_groups[0]["schedule"] = [[0.9, 0.999], [0.5]]
    guard = HyperparameterGuard.watch(opt)
    guard.check()
    opt.param_groups[0]["schedule"][0][0] = 0.8  # an inner list, in place
    with pytest.raises(
        CudaGraphsStateError,
        match=r"\['schedule'\]: captured \[\[0\.9, 0\.999\], \[0\.5\]\], now \[\[0\.8",
    ):
        guard.check()


def test_guard_refuses_a_hyperparameter_changed_from_none():
    opt = torch.optim.SGD([_param(3)], lr=0.1)
    assert opt.param_groups[0]["foreach"] is None  # torch picks the implementation
    guard = HyperparameterGuard.watch(opt)
    guard.check()
    opt.param_groups[0]["foreach"] = True
    with pytest.raises(CudaGraphsStateError, match=r"\['foreach'\]: captured None, now True"):
        guard.check()


def test_guard_counts_a_value_it_cannot_compare_as_changed():
    class NoEquality:
        def __eq__(self, other):
            raise TypeError("no boolean equality")

        __hash__ = object.__hash__

    opt = torch.optim.SGD([_param(3)], lr=0.1)
    opt.param_groups[0]["custom"] = NoEquality()
    guard = HyperparameterGuard.watch(opt)
    opt.param_groups[0]["custom"] = NoEquality()
    with pytest.raises(CudaGraphsStateError, match=r"\['custom'\]: captured <"):
        guard.check()


# ---- StateKeeper: the implementation flags -------------------------------------------
def test_keeper_puts_back_the_prepared_fused_flag():
    params, opt, keeper = _adam_with_keeper()
    assert keeper.optimizer is opt
    assert opt.param_groups[0]["fused"] is None
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["fused"] = True
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["fused"] is None
    keeper.remove()


# ---- all_reduce_gradients: group and bucket size -------------------------------------
def test_all_reduce_gradients_uses_the_given_group_and_bucket_size(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(
        dist, "all_reduce", lambda flat, group=None: calls.append((flat.numel(), group))
    )
    # The group's world size, not the default group's.
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4 if group == "g" else 2)
    params = [torch.nn.Parameter(torch.zeros(10)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((10,), 8.0)
    all_reduce_gradients(params, group="g", bucket_mb=1e-4)  # 104 bytes: two 40-byte grads
    assert calls == [(20, "g"), (10, "g")]
    for p in params:
        assert torch.equal(p.grad, torch.full((10,), 2.0))  # the stand-in summed nothing


def test_guard_compares_values_without_a_boolean_equality_by_what_they_print():
    class Elementwise:  # as a numpy array: == gives something bool() refuses
        def __init__(self, values):
            self.values = list(values)

        def __eq__(self, other):
            raise ValueError("truth value of an array is ambiguous")

        __hash__ = object.__hash__

        def __repr__(self):
            return f"Elementwise({self.values})"

    opt = torch.optim.SGD([_param(3)], lr=0.1)
    opt.param_groups[0]["weights"] = Elementwise([1.0, 2.0])
    guard = HyperparameterGuard.watch(opt)
    guard.check()  # untouched: no false alarm
    opt.param_groups[0]["weights"].values[0] = 3.0
    with pytest.raises(CudaGraphsStateError, match=r"captured Elementwise\(\[1.0, 2.0\]\)"):
        guard.check()


def test_the_planned_device_lr_is_a_bool_whatever_the_flags_hold():
    opt = torch.optim.SGD([_param(3)], lr=0.1, foreach=False)
    opt.param_groups[0]["fused"] = 1  # truthy, not a bool
    (plan,) = plan_optimizer(opt, "keep", "cuda")
    assert plan.device_lr is True
