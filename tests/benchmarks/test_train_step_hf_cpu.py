"""CPU tests of ``benchmarks/train_step_hf.py``'s pure logic: the per-model target,
the loss check (relative to eager, exact against the raw graph of the same kernels),
and which results fail the run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def hf():
    sys.path.insert(0, str(BENCH))
    try:
        for name in ("partial_train", "train_step_hf"):
            if name not in sys.modules:
                spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
        return sys.modules["train_step_hf"]
    finally:
        sys.path.remove(str(BENCH))


def test_the_target_needs_8x_eager_and_no_slower_than_both_raw_graphs(hf):
    key = "hf_llama_step_with_optimizer"
    ms = {hf.EAGER: 24.0, hf.RAW: 3.6, hf.RAW_SAME: 2.99, hf.OURS: 3.0}
    assert hf.model_targets("llama", ms)[key] is True
    assert hf.model_targets("llama", {**ms, hf.EAGER: 23.9})[key] is False  # 7.97x
    assert hf.model_targets("llama", {**ms, hf.RAW: 2.9})[key] is False
    over = {**ms, hf.OURS: 2.99 * hf.EQUAL_WORK_TOL + 0.001, hf.EAGER: 100.0}
    assert hf.model_targets("llama", over)[key] is False
    missing = {k: v for k, v in ms.items() if k != hf.RAW_SAME}
    assert hf.model_targets("llama", missing)[key] is None


def test_the_check_is_relative_to_eager_and_exact_against_the_twin(hf):
    eager = [7.0, 6.5, 5.7]
    losses = {hf.EAGER: eager, hf.RAW: [7.0, 6.51, 5.71], hf.RAW_SAME: eager, hf.OURS: eager}
    out = hf.judge(losses)
    assert out["ok"] and out["ours_equals_raw_same_optimizer"]
    assert out["loss_rel_error"][hf.RAW] > 0
    # One ulp-sized difference from the twin fails, though well within tolerance.
    near = {**losses, hf.OURS: [7.0, 6.5, 5.7000001]}
    assert not hf.judge(near)["ok"]
    far = {**losses, hf.RAW: [7.0, 6.5, 6.0]}
    assert not hf.judge(far)["ok"]
    assert hf.judge({hf.OURS: eager})["ok"] is False


def test_a_failed_variant_or_check_fails_the_run(hf):
    report = {
        "models": {
            "llama": {"variants": {hf.OURS: {"error": "x"}, hf.EAGER: {}}, "check": {"ok": True}},
            "qwen3_moe": {"variants": {hf.EAGER: {}}, "check": {"ok": False}},
        }
    }
    assert hf.failures(report) == [f"llama/{hf.OURS}", "qwen3_moe: check"]


def test_ratios_name_their_floor(hf):
    ms = {hf.EAGER: 20.0, hf.RAW: 4.0, hf.RAW_SAME: 2.0, hf.OURS: 2.5}
    r = hf.model_ratios(ms, {hf.OURS: 2.0})
    assert r[f"{hf.EAGER}/{hf.OURS}"] == 8.0
    assert r[f"{hf.OURS}/{hf.RAW_SAME}"] == 1.25
    assert r[f"{hf.OURS}/kernel_busy_own"] == 1.25
    assert r[f"{hf.RAW}/kernel_busy_own"] is None


def test_ratios_give_the_kernel_busy_floor_against_torchs_recipes(hf):
    compiled = hf.OURS_COMPILED_VARIANTS[0]
    ms = {compiled: 1.3, hf.TORCH_RO: 3.0}
    r = hf.model_ratios(ms, {compiled: 1.2})
    assert r[f"kernel_busy({compiled})/{hf.TORCH_RO}"] == 0.4
    assert r[f"kernel_busy({compiled})/{hf.TORCH_MA}"] is None


def test_a_finished_model_reports_launches_and_the_gap_per_launch(hf):
    def entry(ms, busy=None, launches=None):
        out = {"ms": {"median": ms}}
        if busy is not None:
            out.update(kernel_busy_ms=busy, kernels_per_step=launches)
        return out

    res = {
        "variants": {
            hf.EAGER: entry(20.0),
            hf.RAW_SAME: entry(2.9, 2.4, 1000.0),
            hf.OURS: entry(2.8, 2.4, 1000.0),
        }
    }
    hf.finish_model("llama", res)
    assert res["kernels_per_step"] == {hf.RAW_SAME: 1000.0, hf.OURS: 1000.0}
    assert res["launch_gap_us"] == {hf.RAW_SAME: 0.5, hf.OURS: 0.4}
    assert res["targets"] == {
        "hf_llama_step_with_optimizer": None,
        "hf_llama_compiled_step_le_0.6x_eager_kernel_step": None,
        "hf_llama_compiled_step_le_0.4x_torch_best": None,
        "hf_llama_compiled_step_le_1.10x_own_kernel_busy": None,
    }


def test_the_compiled_targets_against_ours_eager_kernels_torchs_best_and_own_busy(hf):
    ms = {
        hf.OURS: 2.8,
        hf.OURS_COMPILED: 1.3,
        hf.TORCH_RO: 2.9,
        hf.TORCH_MA: 3.5,
    }
    busy = {hf.OURS_COMPILED: 1.2}
    out = hf.model_targets("qwen3_moe", ms, busy)
    assert out["hf_qwen3_moe_compiled_step_le_0.6x_eager_kernel_step"] is True  # 1.3 <= 1.68
    assert out["hf_qwen3_moe_compiled_step_le_0.4x_torch_best"] is False  # 1.3 > 1.16
    assert out["hf_qwen3_moe_compiled_step_le_1.10x_own_kernel_busy"] is True  # 1.3 <= 1.32
    # The faster of torch's recipes that ran is the reference; one is enough.
    alone = hf.model_targets("qwen3_moe", {hf.OURS_COMPILED: 1.0, hf.TORCH_MA: 2.5})
    assert alone["hf_qwen3_moe_compiled_step_le_0.4x_torch_best"] is True
    assert alone["hf_qwen3_moe_compiled_step_le_0.6x_eager_kernel_step"] is None
    assert alone["hf_qwen3_moe_compiled_step_le_1.10x_own_kernel_busy"] is None
    edge = hf.model_targets("llama", {hf.OURS: 2.0, hf.OURS_COMPILED: 1.2})
    assert edge["hf_llama_compiled_step_le_0.6x_eager_kernel_step"] is True  # 1.2 == 0.6 * 2


def test_the_compiled_targets_take_the_faster_of_ours_compiled_variants(hf):
    ms = {hf.OURS: 2.8, hf.OURS_COMPILED: 1.3, hf.OURS_COMPILED_OPTIMIZER: 1.1, hf.TORCH_RO: 2.7}
    busy = {hf.OURS_COMPILED: 1.25, hf.OURS_COMPILED_OPTIMIZER: 0.95}
    out = hf.model_targets("llama", ms, busy)
    assert out["hf_llama_compiled_step_le_0.4x_torch_best"] is False  # 1.1 > 1.08
    assert out["hf_llama_compiled_step_le_1.10x_own_kernel_busy"] is False  # 1.1 > 1.045
    out = hf.model_targets("llama", {**ms, hf.TORCH_RO: 2.75}, busy)
    assert out["hf_llama_compiled_step_le_0.4x_torch_best"] is True  # 1.1 <= 1.1
    fused = hf.model_targets("llama", {**ms, hf.OURS_COMPILED_OPTIMIZER: 1.4}, busy)
    assert fused["hf_llama_compiled_step_le_1.10x_own_kernel_busy"] is True  # 1.3 <= 1.375
    assert hf.VARIANTS[hf.OURS_COMPILED_OPTIMIZER].keywords == {"optimizer_impl": "compiled"}


def test_torchs_recipes_never_fail_the_run_and_their_losses_are_recorded_only(hf):
    eager = [7.0, 6.5, 5.7]
    losses = {hf.EAGER: eager, hf.TORCH_RO: [7.0, 8.0, 9.0], hf.OURS_COMPILED: eager}
    out = hf.judge(losses)
    assert out["ok"] and out["loss_rel_error"][hf.TORCH_RO] > hf.LOSS_REL_TOL
    bad = hf.judge({**losses, hf.OURS_COMPILED: [7.0, 8.0, 9.0]})
    assert not bad["ok"]
    report = {
        "models": {
            "llama": {
                "variants": {hf.TORCH_MA: {"error": "x"}, hf.OURS_COMPILED: {"error": "y"}},
                "check": {"ok": True},
            }
        }
    }
    assert hf.failures(report) == [f"llama/{hf.OURS_COMPILED}"]
