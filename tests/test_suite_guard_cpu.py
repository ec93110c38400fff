"""The test suite's own guard: a run of GPU tests alone on a machine without usable
CUDA fails, saying why, instead of passing with every test skipped; a plain run keeps
skipping the GPU tests (CPU only: on a GPU machine both runs would just pass)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA"),
]


def _pytest(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_gpu_only_run_without_cuda_fails_with_the_reason():
    run = _pytest("-m", "cuda", "tests/core/test_cuda_contract.py")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    out = run.stdout + run.stderr
    assert "GPU test(s) were selected, but CUDA is not usable here" in out
    assert "torch.cuda.is_available() is False" in out


def test_gpu_files_alone_without_cuda_fail_too():
    run = _pytest("tests/core/test_cuda_contract.py")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr


def test_a_plain_run_still_skips_gpu_tests():
    run = _pytest("tests/core/test_cuda_contract.py", "tests/core/test_hooks_cpu.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped" in run.stdout and "passed" in run.stdout
