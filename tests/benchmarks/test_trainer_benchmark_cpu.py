"""CPU tests of ``benchmarks/trainer_callback.py``: the wiring of both variants on a
tiny model (an eager capture backend, no device sync), the per-round step sample, the
loss check, ratios and targets."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def tc():
    sys.path.insert(0, str(BENCH))
    try:
        name = "trainer_callback"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name]
    finally:
        sys.path.remove(str(BENCH))


def tiny_shape(tc):
    return replace(
        tc.CONFIGS["launch_bound"],
        seq=8,
        hidden=32,
        heads=4,
        kv_heads=2,
        intermediate=64,
        moe_intermediate=16,
        layers=2,
        experts=4,
        vocab=64,
    )


def eager(callables, sample_args, sample_kwargs):
    return list(callables)


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_both_variants_train_the_same_and_the_rounds_give_one_sample_each(tc, tmp_path, model):
    shape = tiny_shape(tc)
    built = {
        v: tc.build(
            v,
            model,
            shape,
            steps=4,
            accumulation=2,
            out_dir=str(tmp_path / v),
            use_cpu=True,
            capture_backend=eager,
            synchronize=lambda: None,
        )
        for v in tc.VARIANTS
    }
    samples, losses = tc.time_rounds(built, rounds=2, skip=1)
    assert {v: len(s["step_ms"]) for v, s in samples.items()} == {"eager": 2, "callback": 2}
    assert all(x > 0 for s in samples.values() for x in s["step_ms"] + s["train_s"])
    assert len(losses["eager"]) == 4
    check = tc.compare_losses(losses["callback"], losses["eager"])
    assert check["within_tol"] and check["equal"], check
    stats = built["callback"].callback.stats()
    # Two runs; each records step 1 and replays steps 2-4 (2 micro-batches each).
    targets = 2  # the default scopes: each of the two layers whole
    assert stats["replayed"] == 3 * 2 * targets and stats["fallbacks"] == 0, stats


def test_steady_median_skips_the_recording_steps(tc):
    assert tc.steady_median([100.0, 50.0, 3.0, 1.0, 2.0], skip=2) == 2.0
    assert tc.steady_median([5.0, 7.0], skip=3) == 6.0, "too short: every step"


def test_compare_losses(tc):
    assert tc.compare_losses([1.0, 2.0], [1.0, 2.0]) == {
        "equal": True,
        "max_rel_diff": 0.0,
        "within_tol": True,
    }
    off = tc.compare_losses([1.0, 2.1], [1.0, 2.0])
    assert not off["within_tol"] and off["max_rel_diff"] == pytest.approx(0.05)
    assert not tc.compare_losses([1.0], [1.0, 2.0])["within_tol"]
    assert not tc.compare_losses([], [])["within_tol"]


def test_finish_and_failures(tc):
    res = {
        "variants": {
            "eager": {"step_ms": {"median": 30.0}},
            "callback": {"step_ms": {"median": 20.0}, "stats": {"fallbacks": 0, "replayed": 9}},
        },
        "check": {"within_tol": True},
        "kernel_busy_ms_per_step": {"eager": 10.0, "callback": {"error": "x"}},
    }
    tc.finish(res)
    assert res["ratios"] == {
        "eager/callback": 1.5,
        "eager/kernel_busy_own": 3.0,
        "callback/kernel_busy_own": None,
    }
    assert all(res["targets"].values())
    assert tc.failures({"models": {"llama": res}}) == []
    res["check"] = {"within_tol": False}
    res["variants"]["eager"] = {"error": "boom"}
    tc.finish(res)
    assert res["targets"]["callback_step_faster_than_eager"] is None
    assert tc.failures({"models": {"llama": res}}) == [
        "llama/eager",
        "llama: losses of callback vs eager",
    ]


def test_without_a_gpu_it_says_so_and_exits_0_or_2(tc, capsys):
    assert tc.main([]) == 0
    assert tc.main(["--require-gpu"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_arguments(tc):
    opts = tc.parse_args(["--models", "llama", "--steps", "12", "--accumulation", "2"])
    assert isinstance(opts, argparse.Namespace)
    assert (opts.models, opts.steps, opts.rounds, opts.accumulation) == (["llama"], 12, 5, 2)
