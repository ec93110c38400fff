"""CPU tests of the train layer's optimizer plan: which optimizers and settings a graphed
step takes (plan_optimizer, with its defaults and the fixes it names) and how
prepare_optimizer turns capturable on (also on fake CUDA parameters)."""

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cudagraphs import (
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
)
from cudagraphs.train import optimizers as optimizers_module
from cudagraphs.train import (
    plan_optimizer,
    prepare_optimizer,
)
from cudagraphs.train.optimizers import HyperparameterGuard
from helpers.train_cpu import (
    OPTIMIZERS,
    _group_values,
    _param,
    _steps,
)


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


def test_plan_keeps_a_tensor_lr_on_the_parameters_device():
    opt = torch.optim.Adam([_param(3)], lr=torch.tensor(1e-3), foreach=False)
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.settings == {"capturable": True, "fused": True}
    assert plan.device_lr is False
    assert not any("'lr'" in line for line in plan.changes)


def test_plan_moves_a_tensor_lr_off_the_parameters_device_to_it():
    # lr=torch.tensor(1e-3) on the host beside CUDA parameters, as the compiled-
    # optimizer tutorials write it: the fused kernels read a host lr as a number at
    # capture, so a scheduler's writes would never reach the graph. (The meta device
    # stands for the host here, the CPU for the parameters' device.)
    opt = torch.optim.Adam([_param(3)], lr=0.1, foreach=False)
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, device="meta")
    (plan,) = plan_optimizer(opt, "auto", "cuda")
    assert plan.device_lr is True
    assert plan.changes[-1] == "param_groups[0]['lr'] = a tensor on the device"


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
    # without one (as in tests/core/test_canonicalize_cpu.py). Make and use them inside one
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
