"""CPU tests of the optimizer state a graphed step keeps in place: OptimizerSnapshot,
HyperparameterGuard (values edited in place, tensors, nested values) and StateKeeper
(load_state_dict copies into the graph's tensors; the implementation flags)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs import (
    CudaGraphsStateError,
    CudaGraphsValueError,
)
from cudagraphs.train import (
    plan_optimizer,
)
from cudagraphs.train.optimizers import (
    HyperparameterGuard,
    OptimizerSnapshot,
    StateKeeper,
    exact_at_zero_lr,
)
from helpers.asserts import assert_bitwise_equal
from helpers.train_cpu import (
    OPTIMIZERS,
    _param,
    _set_grads,
    _steps,
)


# ---- OptimizerSnapshot ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_snapshot_restores_parameters_and_earlier_state_into_the_same_tensors(name):
    params = [_param(3), _param(2, 2, seed=1)]
    opt = OPTIMIZERS[name](params)
    _steps(opt, params, 2)
    saved_params = [p.detach().clone() for p in params]
    saved_state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    objects = {id(p): dict(opt.state[p]) for p in params}
    lr = opt.param_groups[0]["lr"]
    snapshot = OptimizerSnapshot.take(opt)
    snapshot.zero_lr()
    assert opt.param_groups[0]["lr"] == 0.0
    _steps(opt, params, 3, seed=200)
    assert not torch.equal(
        opt.state[params[0]][next(iter(saved_state[id(params[0])]))],
        next(iter(saved_state[id(params[0])].values())),
    )  # state moved
    snapshot.restore()
    assert opt.param_groups[0]["lr"] == lr
    for p, saved in zip(params, saved_params):
        assert_bitwise_equal(p.detach(), saved, "restored parameter")
        assert set(opt.state[p]) == set(saved_state[id(p)])
        for key, value in saved_state[id(p)].items():
            assert opt.state[p][key] is objects[id(p)][key], f"{key} was replaced"
            assert_bitwise_equal(opt.state[p][key], value, f"restored state {key}")
            assert snapshot.state[id(p)][key].device.type == "cpu"


@pytest.mark.parametrize(
    ("name", "keys"),
    [("adam", {"step", "exp_avg", "exp_avg_sq"}), ("sgd_momentum", {"momentum_buffer"})],
)
def test_snapshot_zeroes_state_created_after_it(name, keys):
    params = [_param(3), _param(2, 2, seed=1)]
    opt = OPTIMIZERS[name](params)
    saved = [p.detach().clone() for p in params]
    snapshot = OptimizerSnapshot.take(opt)
    snapshot.zero_lr()
    _steps(opt, params, 3)
    objects = {id(p): dict(opt.state[p]) for p in params}
    snapshot.restore()
    for p, s in zip(params, saved):
        assert_bitwise_equal(p.detach(), s, "restored parameter")
        assert set(opt.state[p]) == keys
        for key in keys:
            value = opt.state[p][key]
            assert value is objects[id(p)][key]
            assert not value.any(), f"{key} not zeroed"


@pytest.mark.parametrize(
    ("make", "copied"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True), False),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True, eps=0.0), True),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False), True),
    ],
    ids=["sgd", "fused_adam", "fused_adamw_eps0", "forloop_adam"],
)
def test_snapshot_copies_parameters_to_the_host_only_where_lr_0_is_not_exact(make, copied):
    params = [_param(3), _param(2, seed=1)]
    snapshot = OptimizerSnapshot.take(make(params))
    assert bool(snapshot.params) == copied
    for _, saved in snapshot.params.values():
        assert saved.device.type == "cpu"


def test_snapshot_restores_a_parameter_kept_after_the_fact_and_a_device_lr():
    a = _param(3)
    opt = torch.optim.SGD([a], lr=torch.tensor(0.5))
    lr = opt.param_groups[0]["lr"]
    saved = a.detach().clone()
    snapshot = OptimizerSnapshot.take(opt)
    assert not snapshot.params
    snapshot.zero_lr()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.0
    snapshot.keep_params()  # what the warmup does before a step with non-finite grads
    a.grad = torch.tensor([float("inf"), 1.0, 2.0])
    opt.step()
    assert a.detach().isnan().any()  # 0 * inf
    snapshot.restore()
    assert_bitwise_equal(a.detach(), saved, "kept parameter")
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.5


def test_snapshot_restores_a_parameter_without_optimizer_state():
    # a resumed optimizer holds state for a only: restore() zeroes a's new state where
    # it had none, keeps b (kept on the host: for-loop Adam) and gives b no state.
    a, b = _param(3), _param(2, seed=1)
    opt = torch.optim.Adam([a, b], lr=0.1, foreach=False)
    a.grad = torch.ones(3)
    opt.step()
    saved_a_state = {k: v.clone() for k, v in opt.state[a].items()}
    snapshot = OptimizerSnapshot.take(opt)
    assert set(snapshot.state) == {id(a)}  # b has no state to keep
    saved_b = b.detach().clone()
    with torch.no_grad():
        b.add_(1.0)
    a.grad = torch.ones(3)
    opt.step()
    snapshot.restore()
    assert_bitwise_equal(b.detach(), saved_b, "parameter without state")
    assert b not in opt.state
    for key, value in saved_a_state.items():
        assert_bitwise_equal(opt.state[a][key], value, f"a's {key}")


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["sgd", "sgd_nesterov", "adam", "adamw", "adam_amsgrad"]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
    maximize=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
    zero_grads=st.booleans(),
)
def test_a_step_at_lr_0_leaves_parameters_bitwise_where_snapshots_rely_on_it(
    kind, weight_decay, maximize, dtype, seed, zero_grads
):
    # The reference: parameters unchanged, bit for bit, over steps at lr 0 with finite
    # gradients (zeros included: Adam's second moment is 0 there).
    params = [_param(5, dtype=dtype, seed=seed), _param(2, 3, dtype=dtype, seed=seed + 1)]
    make = {
        "sgd": lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9, weight_decay=weight_decay, maximize=maximize
        ),
        "sgd_nesterov": lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=weight_decay, maximize=maximize
        ),
        "adam": lambda ps: torch.optim.Adam(
            ps, lr=0.1, fused=True, weight_decay=weight_decay, maximize=maximize
        ),
        "adamw": lambda ps: torch.optim.AdamW(
            ps, lr=0.1, fused=True, weight_decay=weight_decay, maximize=maximize
        ),
        "adam_amsgrad": lambda ps: torch.optim.Adam(
            ps, lr=0.1, fused=True, amsgrad=True, maximize=maximize
        ),
    }[kind]
    opt = make(params)
    assert all(exact_at_zero_lr(opt, g) for g in opt.param_groups)
    before = [p.detach().clone() for p in params]
    snapshot = OptimizerSnapshot.take(opt)
    snapshot.zero_lr()
    for i in range(3):
        _set_grads(params, seed + 10 + i)
        if zero_grads:
            for p in params:
                p.grad.view(-1)[::2] = 0
        opt.step()
    for p, b in zip(params, before):
        assert_bitwise_equal(p.detach(), b, "parameter after steps at lr 0")
    snapshot.restore()
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum"])
def test_after_restore_the_optimizer_steps_as_a_fresh_one(name):
    def run(warmup):
        params = [_param(3), _param(2, 2, seed=1)]
        opt = OPTIMIZERS[name](params)
        if warmup:
            snapshot = OptimizerSnapshot.take(opt)
            snapshot.zero_lr()
            _steps(opt, params, 3, seed=300)
            snapshot.restore()
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


# ---- HyperparameterGuard and StateKeeper: values edited in place, tensor hyperparameters
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


def test_a_group_without_eps_is_not_exact_at_lr_0():
    # Read as eps 0: a fused Adam step then divides by sqrt(v) alone, 0 / 0 where a
    # gradient element was 0.
    opt = torch.optim.Adam([_param(3)], lr=0.1, fused=True)
    assert exact_at_zero_lr(opt, {"fused": True, "params": []}) is False
    assert exact_at_zero_lr(opt, {"fused": True, "eps": 1e-8, "params": []}) is True


def test_snapshot_keeps_only_the_groups_whose_step_at_lr_0_is_not_exact():
    exact, inexact = _param(3), _param(2, seed=1)
    opt = torch.optim.Adam(
        [{"params": [exact], "fused": True}, {"params": [inexact], "foreach": False}], lr=0.1
    )
    snapshot = OptimizerSnapshot.take(opt)
    assert set(snapshot.params) == {id(inexact)}


def test_snapshot_copies_of_cuda_tensors_are_on_the_host():
    # Fake CUDA tensors (metadata only, as in test_train_optimizer_plan_cpu.py): the
    # snapshot's copies of parameters and state must leave the device, or the warmup
    # would hold a second copy of the model there.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p = torch.nn.Parameter(torch.empty(3, device="cuda"))
        opt = torch.optim.Adam([p], lr=0.1, foreach=False)
        opt.state[p]["exp_avg"] = torch.zeros(3, device="cuda")
        snapshot = OptimizerSnapshot.take(opt)
    ((_, saved),) = snapshot.params.values()
    assert saved.device.type == "cpu"
    assert snapshot.state[id(p)]["exp_avg"].device.type == "cpu"
