"""The multi-GPU script (tests/distributed/multi_gpu.py) on a machine without GPUs:
it imports, lists its checks, and refuses to run with exit code 2."""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "distributed" / "multi_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("multi_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_lists_the_issue_checks():
    module = _load()
    assert list(module.CHECKS) == [
        "allreduce_program",
        "allreduce_core",
        "serving_agreement",
        "partial_fsdp2",
        "pipeline_order",
        "train_step_allreduce",
    ]


def test_script_refuses_without_enough_gpus(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the answer on a machine without GPUs")
    assert _load().main(["--out", str(tmp_path)]) == 2
    assert "needs" in capsys.readouterr().err
