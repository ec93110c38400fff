"""CPU tests of ``benchmarks/program_replay.py``'s target logic (the script itself
needs a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("program_replay", BENCH / "program_replay.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["program_replay"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_one_input_target_compares_rotating_with_its_floor_in_launches(bench):
    us = {
        "raw": 3.0,
        "cudagraphs_program": 4.0,
        "raw_plus_copy_below_autograd": 5.0,
        "cudagraphs_program_rotating": 9.0,
        "raw_plus_copy_below_autograd_rotating": 5.5,
    }
    targets, figures = bench.per_call_targets("one_input", us)
    (name,) = targets
    assert "rotating" in name and name.endswith("le_1x_raw")
    assert targets[name] is False  # 3.5 us over the floor, more than one 3 us launch
    assert figures["rotating_minus_floor_us"] == 3.5
    assert figures["rotating_minus_floor_in_raw_launches"] == pytest.approx(1.167, abs=1e-3)
    assert figures["same_source_minus_floor_us"] == -1.0
    us["cudagraphs_program_rotating"] = 8.5
    assert bench.per_call_targets("one_input", us)[0][name] is True


def test_tree_target_is_on_the_below_autograd_floor_and_reports_both(bench):
    us = {"raw_plus_copy": 10.0, "raw_plus_copy_below_autograd": 8.0, "cudagraphs_program": 11.0}
    targets, figures = bench.per_call_targets("tree_64", us)
    assert targets == {"cudagraphs_program_le_1.3x_raw_plus_copy_below_autograd": False}
    assert figures["cudagraphs_program/raw_plus_copy"] == 1.1
    assert figures["cudagraphs_program/raw_plus_copy_below_autograd"] == 1.375
    assert figures["minus_floor_us"] == 3.0


def test_a_missing_variant_leaves_its_target_unknown_not_true(bench):
    targets, _ = bench.per_call_targets("one_input", {"raw": 3.0})
    assert list(targets.values()) == [None]
    targets, _ = bench.per_call_targets("tree_64", {"cudagraphs_program": 1.0})
    assert list(targets.values()) == [None]
