"""CPU tests of the training benchmarks' steps (``benchmarks/train_step.py``): guarded
interleaved steps, and the reset-and-check sequence of a step (planted bugs must show)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.train_bench import (
    _tiny,
)

# ---- guarded steps -------------------------------------------------------------------


def test_a_failing_step_is_recorded_once_and_the_others_keep_running(ts):
    calls = {"ok": 0, "bad": 0}

    def ok():
        calls["ok"] += 1

    def bad():
        calls["bad"] += 1
        raise RuntimeError("boom")

    errors: dict = {}
    steps = ts.guard_steps({"ok": ok, "bad": bad}, errors)
    for _ in range(3):
        steps["ok"]()
        steps["bad"]()
    assert calls == {"ok": 3, "bad": 1}
    assert list(errors) == ["bad"] and "RuntimeError: boom" in errors["bad"]["error"]


# ---- a step, its reset and its check -------------------------------------------------


def test_a_train_step_runs_compute_optimizer_then_zero_grad(ts):
    order = []

    class Opt:
        def step(self):
            order.append("opt")

    step = ts.TrainStep(lambda: order.append("compute"), Opt(), lambda: order.append("zero"))
    step()
    assert order == ["compute", "opt", "zero"]
    order.clear()
    step.keeping_grads()
    assert order == ["compute", "opt"]


def test_set_to_none_step_is_foreach_adamw_and_drops_grads(cpu):
    ts = cpu
    blocks = ts.make_stack(_tiny(ts), "set_to_none")
    assert all(p.grad is None for p in blocks.parameters())
    x = ts.make_input(_tiny(ts))
    step = ts.regime_step("set_to_none", blocks, lambda: ts.loss_backward(blocks[0], x))
    group = step.optimizer.param_groups[0]
    assert isinstance(step.optimizer, torch.optim.AdamW)
    assert group["foreach"] is True and group["capturable"] is False and group["lr"] == ts.LR
    step()
    assert all(p.grad is None for p in blocks.parameters())
    assert ts.regime_step("accumulate", blocks, lambda: None).optimizer is None


def test_reset_restores_weights_and_a_fresh_optimizer_state_in_place(cpu):
    ts = cpu
    cfg = _tiny(ts)
    built = ts.build_eager(cfg, "set_to_none")
    initial = ts.initial_params(cfg)
    for _ in range(2):
        built.step()
    p0 = built.blocks[0].qkv.weight
    assert not torch.equal(p0, initial["blocks.0.qkv.weight"])
    state = built.optimizer.state[p0]
    exp_avg = state["exp_avg"]
    ts.reset_state(built, "set_to_none", initial)
    assert built.blocks[0].qkv.weight is p0  # in place: graphs hold these tensors
    for name, p in built.blocks.named_parameters(prefix="blocks"):
        assert torch.equal(p, initial[name]), name
    assert state["exp_avg"] is exp_avg and not exp_avg.any()
    assert state["step"].item() == 0 and not state["exp_avg_sq"].any()

    acc = ts.build_eager(cfg, "accumulate")
    grad = acc.blocks[0].fc1.weight.grad
    acc.step()
    ts.reset_state(acc, "accumulate", {})
    assert acc.blocks[0].fc1.weight.grad is grad and not grad.any()


def test_the_check_sees_the_last_steps_grads_and_the_params_after_n_steps(cpu):
    ts = cpu
    cfg = _tiny(ts)
    initial = ts.initial_params(cfg)
    built = ts.build_eager(cfg, "set_to_none")
    grads, params = ts.check_values(built, "set_to_none", initial)
    assert set(grads) == set(params) == set(initial)
    assert all(g is not None for g in grads.values())
    assert all(p.grad is None for p in built.blocks.parameters())  # the step finished
    assert built.optimizer.state[built.blocks[0].qkv.weight]["step"].item() == ts.CHECK_STEPS
    again = ts.check_values(built, "set_to_none", initial)  # from the reset state again
    assert ts.compare_tensors(again[0], grads, 0.0)["equal"]
    assert ts.compare_tensors(again[1], params, 0.0)["equal"]


def _variant(ts, make):
    """A builder for a planted variant: the eager stack with another step."""

    def build(cfg, regime):
        built = ts.build_eager(cfg, regime)
        built.step = make(built)
        return built

    return build


def _planted(ts):
    def never_zeroes(built):  # set_to_none without zero_grad: grads accumulate
        return ts.TrainStep(built.step.compute, built.step.optimizer, None)

    def no_optimizer(built):  # the optimizer step left out
        return ts.TrainStep(built.step.compute, None, built.step.zero_grad)

    def raises(built):
        def boom():
            raise RuntimeError("planted")

        return ts.TrainStep(boom)

    return {
        "never_zeroes": _variant(ts, never_zeroes),
        "no_optimizer": _variant(ts, no_optimizer),
        "raises": _variant(ts, raises),
    }


def test_one_regime_end_to_end_catches_planted_bugs(cpu, monkeypatch):
    ts = cpu
    monkeypatch.setattr(ts, "VARIANTS", {"eager": ts.build_eager, **_planted(ts)})
    cfg = _tiny(ts, iters=2, repeats=3)
    names = ["eager", "eager_repeat", "never_zeroes", "no_optimizer", "raises"]
    res = ts.run_regime(cfg, "set_to_none", names)
    v, check = res["variants"], res["check"]
    for name in ("eager", "eager_repeat", "never_zeroes", "no_optimizer"):
        assert v[name]["ms"]["rounds"] == 3, name
        assert v[name]["ms"]["min"] <= v[name]["ms"]["median"] <= v[name]["ms"]["max"]
    assert "planted" in v["raises"]["error"] and "ms" not in v["raises"]
    assert check["grads"]["eager_repeat"]["equal"]
    assert check["params"]["eager_repeat"]["equal"]
    assert not check["grads"]["never_zeroes"]["within_tol"]
    assert not check["params"]["no_optimizer"]["within_tol"]
    assert "raises" not in check["grads"]
    assert res["regime"] == "set_to_none"
    assert res["ratios"]["eager_repeat/eager"] is not None
    assert res["targets"] == {
        "default_le_torch_helper_set_to_none": None,
        "default_owned_le_1.03x_torch_helper_set_to_none": None,
        "lent_le_torch_helper_set_to_none": None,
        "step_with_optimizer_le_raw_graph": None,
        "compute_bound_step_le_best_alternative": None,
        "compiled_step_le_1.10x_own_kernel_busy": None,
        "compiled_step_le_torch_best": None,
    }
    json.dumps(res, allow_nan=False)
    report = {"configs": {"tiny": {"regimes": {"set_to_none": res}}}}
    failed = ts.failures(report)
    assert failed[0] == "tiny/set_to_none/raises"
    # The planted bugs fail the run through their checks, not only in the JSON.
    assert any(f.startswith("tiny/set_to_none/never_zeroes: grads") for f in failed)
    assert any(f.startswith("tiny/set_to_none/no_optimizer: params") for f in failed)
    assert not any(f.startswith("tiny/set_to_none/eager_repeat") for f in failed)


def test_the_accumulate_check_compares_accumulated_grads_only(cpu, monkeypatch):
    ts = cpu
    monkeypatch.setattr(ts, "VARIANTS", {"eager": ts.build_eager})
    res = ts.run_regime(_tiny(ts), "accumulate", ["eager", "eager_repeat"])
    assert res["check"]["grads"]["eager_repeat"]["equal"]
    assert res["check"]["params"] == {}
    assert res["check"]["grads"]["eager_repeat"]["tensors"] == 8 * 12


def test_without_a_gpu_the_scripts_exit_0_or_2(ts, pt, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    for module in (ts, pt):
        assert module.main([]) == 0
        assert module.main(["--require-gpu"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_options_select_configs_regimes_and_variants(ts, pt):
    args = ts.parse_args(["--regimes", "set_to_none", "--variants", "cudagraphs", "--iters", "4"])
    assert args.regimes == ["set_to_none"] and args.variants == ["cudagraphs"]
    assert args.iters == 4 and args.configs == list(ts.CONFIGS)
    assert ts.parse_args([]).regimes == ["accumulate", "set_to_none"]
    assert pt.parse_args([]).variants == list(pt.VARIANTS)
