"""The main job on a GPU: it runs end to end and every demo reports results equal to
eager (the CPU paths of the command line are in test_contract_cpu.py)."""

import json

import pytest

pytestmark = pytest.mark.cuda


def test_main_job_runs_and_every_demo_equals_eager(capsys):
    from cudagraphs.__main__ import main

    rc = main(["--layers", "2", "--iters", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["training_grads_equal"] is True, result
    assert result["program_equal_to_eager"] is True, result
    assert result["decode_tokens_equal"] is True, result
    if "partial_loss_equal" in result:  # with transformers installed
        assert result["partial_loss_equal"] is True and result["partial_fallbacks"] == 0, result
        assert result["generate_tokens_equal"] is True, result
        assert result["generate_graphed_tokens_per_s"] > result["generate_eager_tokens_per_s"]
    for key in ("eager_ms", "graphed_ms", "kernel_busy_ms", "program_replay_ms"):
        assert result[key] > 0, (key, result)
    # Each graphed demo says where its capture's memory went.
    assert result["graphed_memory"]["pool_reserved_bytes"] > 0, result
    assert result["decode_runner_memory"]["pool_reserved_bytes"] > 0, result
    assert rc == 0


def test_env_command_names_the_gpu_driver_and_staging(capsys):
    import torch

    from cudagraphs.__main__ import main

    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert torch.cuda.get_device_name() in report["cuda_device"]
    assert report["cuda_driver"].startswith("CUDA "), report
    assert report["program_staging_auto"] in ("graph", "copy")
    assert report["torch_cuda"] == torch.version.cuda
