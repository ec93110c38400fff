"""CPU tests of ``benchmarks/train_fp8.py``'s pure logic: the variants it builds, the
loss curves' SQNR against a direct reference, and its targets."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import script


@pytest.fixture(scope="module")
def fp8():
    return script("train_fp8")


def test_every_recipe_gets_its_three_variants_after_the_bf16_references(fp8):
    names = [v.name for v in fp8.variants()]
    assert names == [
        "eager_bf16",
        "graphed_bf16",
        "graphed_bf16_compiled",
        "graphed_fp8_tensorwise",
        "graphed_fp8_tensorwise_compiled",
        "eager_fp8_tensorwise_compiled",
        "graphed_fp8_rowwise",
        "graphed_fp8_rowwise_compiled",
        "eager_fp8_rowwise_compiled",
    ]
    by_name = {v.name: v for v in fp8.variants(["rowwise"])}
    assert by_name["graphed_fp8_rowwise_compiled"] == fp8.Variant(
        "graphed_fp8_rowwise_compiled", "rowwise", True, True
    )
    assert by_name["eager_bf16"] == fp8.Variant("eager_bf16", None, False, False)
    assert "graphed_fp8_tensorwise" not in by_name


def test_sqnr_of_known_curves(fp8):
    assert fp8.sqnr_db([1.0, 1.0], [1.0, 1.0]) == math.inf
    # noise 0.1 * signal: 20 dB
    assert fp8.sqnr_db([3.0, 4.0], [3.3, 4.4]) == pytest.approx(20.0, abs=1e-3)
    assert fp8.sqnr_db([], []) is None
    assert fp8.sqnr_db([1.0], [1.0, 2.0]) is None
    assert fp8.sqnr_db([1.0, float("nan")], [1.0, 1.0]) is None
    assert fp8.sqnr_db([1.0], [float("inf")]) is None
    assert fp8.sqnr_db([0.0, 0.0], [0.1, 0.0]) is None


FINITE = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@given(st.lists(st.tuples(FINITE, FINITE), min_size=1, max_size=40))
def test_sqnr_matches_the_definition(pairs):
    fp8 = script("train_fp8")
    ref, got = [a for a, _ in pairs], [b for _, b in pairs]
    out = fp8.sqnr_db(ref, got)
    signal = math.sqrt(sum(a * a for a in ref))
    noise = math.sqrt(sum((a - b) ** 2 for a, b in pairs))
    if noise == 0:
        assert out == math.inf
    elif signal == 0:
        assert out is None
    else:
        assert out == pytest.approx(20 * math.log10(signal / noise), abs=1e-3)


def test_targets_compare_each_compiled_graphed_recipe_with_compiled_graphed_bf16(fp8):
    ms = {
        "graphed_bf16_compiled": 10.0,
        "graphed_fp8_tensorwise_compiled": 7.9,
        "graphed_fp8_rowwise_compiled": 8.5,
        "graphed_fp8_tensorwise": 5.0,  # eager kernels: not the like-for-like pair
    }
    out = fp8.compute_targets(ms, {"tensorwise": 30.0, "rowwise": 24.9})
    assert out == {
        "fp8_tensorwise_step_le_0.8x_bf16_step": True,
        "fp8_tensorwise_loss_200_steps_sqnr_ge_25db": True,
        "fp8_rowwise_step_le_0.8x_bf16_step": False,
        "fp8_rowwise_loss_200_steps_sqnr_ge_25db": False,
        "fp8_step_le_0.8x_bf16_step": True,
    }


def test_missing_numbers_give_none_not_false(fp8):
    out = fp8.compute_targets({"graphed_fp8_rowwise_compiled": 7.0}, {}, ["rowwise"])
    assert out == {
        "fp8_rowwise_step_le_0.8x_bf16_step": None,
        "fp8_rowwise_loss_200_steps_sqnr_ge_25db": None,
        "fp8_step_le_0.8x_bf16_step": None,
    }
    edge = fp8.compute_targets(
        {"graphed_bf16_compiled": 10.0, "graphed_fp8_rowwise_compiled": 8.0},
        {"rowwise": 25.0},
        ["rowwise"],
    )
    assert edge["fp8_step_le_0.8x_bf16_step"] and edge["fp8_rowwise_loss_200_steps_sqnr_ge_25db"]


def test_without_a_gpu_the_benchmark_says_so_and_measures_nothing(fp8, capsys):
    assert fp8.main([]) == 0
    assert fp8.main(["--require-gpu"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_loss_curve_trains_at_the_loss_check_rate_not_the_timed_one(fp8, monkeypatch):
    # The SQNR is read in a regime where bf16 repeats itself: a curve's optimizer gets
    # LOSS_LR (or the rate asked for), and the timed steps keep LR.
    seen: list[float] = []

    class Stub:
        def step(self, *batch):
            return 0.5

        def release(self):
            pass

    def fake_build(v, data, lr=fp8.LR):
        seen.append(lr)
        return Stub()

    monkeypatch.setattr(fp8, "build", fake_build)
    monkeypatch.setattr(fp8, "free_memory", lambda: None)
    v = fp8.Variant("graphed_bf16_compiled", None, True, True)
    curve = fp8.loss_curve(v, [(None, None)])
    assert curve == [0.5] * fp8.LOSS_STEPS
    fp8.loss_curve(v, [(None, None)], 3e-6)
    assert seen == [fp8.LOSS_LR, 3e-6]
    assert fp8.LOSS_LR < fp8.LR


def test_the_batch_sets_the_data_shape_and_a_bad_one_is_refused(fp8, capsys):
    ((x, y),) = fp8.make_data(1, batch=3, device="cpu")
    assert x.shape == y.shape == (3, fp8.SEQ, fp8.BLOCK.hidden)
    assert torch.equal(y, x.roll(1, dims=-1))
    with pytest.raises(SystemExit):
        fp8.main(["--batch", "0"])
    assert "--batch takes a positive number" in capsys.readouterr().err
