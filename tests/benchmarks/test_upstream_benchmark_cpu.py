"""benchmarks/upstream.py's pure logic (CPU): per-test outcomes from pytest's JUnit XML,
their comparison, the parameter check and the targets."""

import pytest
import torch

from conftest import script

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="test_cuda.TestCuda" name="test_a"/>
  <testcase classname="test_cuda.TestCuda" name="test_b">
    <skipped type="pytest.xfail" message="expected failure"/>
  </testcase>
  <testcase classname="test_cuda.TestCuda" name="test_c"><failure message="boom"/></testcase>
  <testcase classname="test_cuda.TestCuda" name="test_d"><error message="setup"/></testcase>
  <testcase classname="test_cuda.TestCuda" name="test_e">
    <skipped type="pytest.skip" message="no CUDA"/>
  </testcase>
</testsuite></testsuites>"""


@pytest.fixture(scope="module")
def up():
    return script("upstream")


def test_junit_outcomes_name_each_test_and_tell_xfail_from_skip(up):
    assert up.junit_outcomes(XML) == {
        "TestCuda::test_a": "passed",
        "TestCuda::test_b": "xfailed",
        "TestCuda::test_c": "failed",
        "TestCuda::test_d": "error",
        "TestCuda::test_e": "skipped",
    }


def test_outcome_differences_report_every_test_either_side(up):
    torch_ = {"t1": "passed", "t2": "xfailed", "t3": "passed"}
    ours = {"t1": "passed", "t2": "failed", "t4": "passed"}
    assert up.outcome_differences(ours, torch_) == [
        "t2: torch xfailed, ours failed",
        "t3: torch passed, ours not run",
        "t4: torch not run, ours passed",
    ]
    assert up.outcome_differences(torch_, dict(torch_)) == []


def _report(up, torch_outcomes, ours_outcomes, ms, equal, megatron):
    return {
        "torch_suite": {"outcomes": {"torch": torch_outcomes, "cudagraphs": ours_outcomes}},
        "nemo": {"ms": ms, "check": {up.NEMO: {"equal": equal}}},
        "megatron": {"equal_to_eager": megatron},
    }


def test_targets(up):
    same = {"t1": "passed", "t2": "xfailed"}
    ms = {up.NEMO: 20.0, up.OURS_DEFAULT: 10.0}
    good = up.compute_targets(_report(up, same, dict(same), ms, True, True))
    assert good == {
        "torch_suite_outcomes_equal_torch": True,
        "nemo_automodel_partial_equals_eager": True,
        "megatron_te_helper_equals_eager": True,
        "ours_partial_le_0.5x_nemo_partial": True,
    }
    ms_slow = {up.NEMO: 20.0, up.OURS_DEFAULT: 10.1}
    bad = up.compute_targets(_report(up, same, {"t1": "passed"}, ms_slow, False, False))
    assert not any(bad.values())
    # An empty torch run proves nothing: not met.
    assert (
        up.compute_targets(_report(up, {}, {}, ms, True, True))["torch_suite_outcomes_equal_torch"]
        is False
    )
    assert up.compute_targets({}) == dict.fromkeys(good)


def test_compare_params_is_bitwise_and_names_the_differing(up):
    want = {"a": torch.ones(3), "b": torch.zeros(2)}
    assert up.compare_params({k: v.clone() for k, v in want.items()}, want)["equal"]
    got = {"a": torch.tensor([1.0, 1.0, 1.5]), "b": torch.zeros(2)}
    res = up.compare_params(got, want)
    assert res == {"equal": False, "differing": ["a"], "max_abs_diff": 0.5}
    assert up.compare_params({"a": want["a"]}, want)["differing"] == ["b"]


@pytest.mark.spawns  # pytest in subprocesses, which mutmut's forked workers cannot host
def test_the_torch_suite_runs_once_per_helper_in_its_own_process(up, tmp_path):
    # A stand-in for torch's test file: one test per helper that passes only under it.
    tests = tmp_path / "test_stand_in.py"
    tests.write_text(
        "import torch\n\n\n"
        "class TestCuda:\n"
        "    def test_make_graphed_callables_is_torchs(self):\n"
        "        assert torch.cuda.make_graphed_callables.__module__ == 'torch.cuda.graphs'\n\n"
        "    def test_make_graphed_callables_is_ours(self):\n"
        "        assert 'cudagraphs' in torch.cuda.make_graphed_callables.__module__\n\n"
        "    def test_other(self):\n"
        "        pass\n"
    )
    case = up.torch_suite_case(tests)
    assert case["outcomes"] == {
        "torch": {
            "TestCuda::test_make_graphed_callables_is_torchs": "passed",
            "TestCuda::test_make_graphed_callables_is_ours": "failed",
        },
        "cudagraphs": {
            "TestCuda::test_make_graphed_callables_is_torchs": "failed",
            "TestCuda::test_make_graphed_callables_is_ours": "passed",
        },
    }
    assert len(case["differences"]) == 2
    assert up.torch_suite_case(tmp_path / "missing.py")["error"].endswith("(pass --torch-tests)")
