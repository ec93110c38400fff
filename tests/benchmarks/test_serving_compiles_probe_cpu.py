"""CPU test of ``benchmarks/probes/serving_compiles.py``'s log reading: each recompile's
failed guards are kept, read from the lines dynamo writes after "guard failure(s):"."""

from __future__ import annotations

import pytest

from helpers.train_bench import load_probe

# What TORCH_LOGS=recompiles wrote for a function compiled with a dynamic batch and
# called with a batch of one (torch 2.13, a real run), then an unrelated line.
LOG = """\
V1202 22:39:28.204000 25746 torch/_dynamo/guards.py:5396] [0/1] [__recompiles] Recompiling function f in /tmp/so.py:7
V1202 22:39:28.204000 25746 torch/_dynamo/guards.py:5396] [0/1] [__recompiles]     triggered by the following guard failure(s):
V1202 22:39:28.204000 25746 torch/_dynamo/guards.py:5396] [0/1] [__recompiles]     - 0/0: 2 <= kv.size()[0]  # return x.sum()  # so.py:9 in f
V1202 22:39:28.204000 25746 torch/_dynamo/guards.py:5396] [0/1] [__recompiles]     - 0/0: 2 <= x.size()[0]
I1202 22:39:29.000000 25746 torch/_dynamo/symbolic_shapes.py:1] - not a guard line
V1202 22:39:30.000000 25746 torch/_dynamo/guards.py:5396] [0/2] [__recompiles]     triggered by the following guard failure(s):
V1202 22:39:30.000000 25746 torch/_dynamo/guards.py:5396] [0/2] [__recompiles]     - 0/1: ___check_type_id(n, 1)
"""


@pytest.fixture(scope="module")
def probe():
    module = load_probe("serving_compiles")
    return module


def test_recompile_reasons_are_the_failed_guards_of_each_recompile(probe):
    assert probe.recompile_reasons(LOG) == [
        "0/0: 2 <= kv.size()[0]  # return x.sum()  # so.py:9 in f",
        "0/0: 2 <= x.size()[0]",
        "0/1: ___check_type_id(n, 1)",
    ]
    assert probe.recompile_reasons("") == []


def _run(capture_s, ms, tokens):
    return {"capture_s": capture_s, "ms_per_token": ms, "tokens": tokens}


def test_decode_summary_puts_the_two_sets_side_by_side(probe):
    runs = {
        "default": _run(49.2, {"1": 1.5, "8": 1.6}, {"1": [[5, 6]], "8": [[1], [2]]}),
        "no_cudnn": _run(18.0, {"1": 1.2, "8": 2.0}, {"1": [[5, 6]], "8": [[1], [3]]}),
    }
    assert probe.decode_summary(runs) == {
        "capture_s": {"default": 49.2, "no_cudnn": 18.0},
        "capture_le_20s": {"default": False, "no_cudnn": True},
        "per_token_ratio": {"1": 0.8, "8": 1.25},
        "tokens_equal": {"1": True, "8": False},
    }


def test_decode_summary_says_none_where_a_child_failed(probe):
    runs = {"default": _run(20.0, {"1": 1.5}, {"1": [[5]]}), "no_cudnn": {"returncode": 1}}
    assert probe.decode_summary(runs) == {
        "capture_s": {"default": 20.0, "no_cudnn": None},
        "capture_le_20s": {"default": True, "no_cudnn": None},
        "per_token_ratio": {"1": None},
        "tokens_equal": {"1": None},
    }


@pytest.mark.parametrize(
    "code, out, want",
    [
        (0, 'log line\n{"capture_s": 3.5}\n', {"capture_s": 3.5, "returncode": 0}),
        (1, '{"capture_s": 3.5}\n', {"returncode": 1}),  # a failed child's output is not read
        (0, "", {"returncode": 0}),
    ],
)
def test_a_child_record_is_its_last_output_line_when_it_succeeded(
    probe, monkeypatch, code, out, want
):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen.update(cmd=cmd, **kwargs)
        return probe.subprocess.CompletedProcess(cmd, code, stdout=out, stderr="")

    monkeypatch.setattr(probe.subprocess, "run", fake_run)
    child, run = probe.run_child(["--decode-child", "no_cudnn"], {"A": "1"}, timeout=9)
    assert run == want and child.returncode == code
    assert seen["cmd"][1:] == [probe.__file__, "--decode-child", "no_cudnn"]
    assert (seen["env"], seen["timeout"]) == ({"A": "1"}, 9)


def test_regions_summary_sets_the_two_children_side_by_side(probe):
    runs = {
        "layers": {
            "capture_s": 12.5,
            "ms_per_token": {"1": 1.1, "8": 2.0},
            "tokens": {"1": [[1]], "8": [[2]]},
        },
        "whole": {
            "capture_s": 33.0,
            "ms_per_token": {"1": 1.0, "8": 2.0},
            "tokens": {"1": [[1]], "8": [[3]]},
        },
    }
    assert probe.regions_summary(runs) == {
        "capture_s": {"layers": 12.5, "whole": 33.0},
        "capture_le_20s": {"layers": True, "whole": False},
        "layers_per_token_ratio": {"1": 1.1, "8": 1.0},
        "tokens_equal": {"1": True, "8": False},
    }


def test_regions_summary_says_none_where_a_child_failed(probe):
    runs = {
        "layers": {"capture_s": 12.5, "ms_per_token": {"1": 1.1}, "tokens": {"1": [[1]]}},
        "whole": {"returncode": 1},
    }
    summary = probe.regions_summary(runs)
    assert summary["capture_le_20s"] == {"layers": True, "whole": None}
    assert summary["layers_per_token_ratio"] == {"1": None}
    assert summary["tokens_equal"] == {"1": None}


def test_installed_bodies_are_counted_from_dynamos_log_lines(probe):
    log = (
        "V1203 [0/0] [__hierarchical_compile] _layer_forward: Installing subgraph with "
        "identifier 'subgraph_0', bringing total count for '_layer_forward' function to 1\n"
        "V1203 [0/0] [__hierarchical_compile] subgraph_reuse: not eligible\n"
    )
    assert len(probe.INSTALLED.findall(log)) == 1


def test_compile_phases_are_dynamos_seconds_per_phase(probe):
    import torch

    compiled = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    compiled(torch.ones(3))
    phases = probe.compile_phases(floor=0.0)
    assert "_compile.compile_inner" in phases, phases
    assert all(isinstance(v, float) and v >= 0 for v in phases.values())
    assert probe.compile_phases(floor=1e9) == {}


def _attention_run(backends, ms, tokens=None):
    run = {"backends": backends, "ms_per_token": ms}
    if tokens is not None:
        run["tokens"] = tokens
    return run


def test_attention_summary_takes_medians_per_set_and_the_ratio(probe):
    runs = [
        _attention_run("layers", {"1": 1.5, "8": 1.7}, {"1": [[5]], "8": [[1], [2]]}),
        _attention_run("math", {"1": 1.2, "8": 1.9}, {"1": [[5]], "8": [[1], [3]]}),
        _attention_run("layers", {"1": 1.7, "8": 1.7}, {"1": [[7]], "8": [[1], [2]]}),
        _attention_run("math", {"1": 1.4, "8": 1.5}, {"1": [[5]], "8": [[1], [2]]}),
    ]
    summary = probe.attention_summary(runs)
    assert summary["ms_per_token"] == {
        "layers": {"1": 1.6, "8": 1.7},
        "math": {"1": 1.3, "8": 1.7},
    }
    assert summary["math_over_layers"] == {"1": 0.8125, "8": 1.0}
    # Against the first layers run's tokens; every math run must equal them.
    assert summary["tokens_equal"] == {"1": True, "8": False}


def test_attention_summary_says_none_where_a_set_never_ran(probe):
    runs = [
        _attention_run("layers", {"1": 1.5}, {"1": [[5]]}),
        {"backends": "math", "returncode": 1},
    ]
    summary = probe.attention_summary(runs)
    assert summary["ms_per_token"] == {"layers": {"1": 1.5}}
    assert summary["math_over_layers"] == {"1": None}
    assert summary["tokens_equal"] == {"1": None}


def test_the_attention_runs_alternate_the_two_sets(probe):
    assert probe.ATTENTION_RUNS == ("layers", "math", "layers", "math")
    assert set(probe.ATTENTION_RUNS) <= set(probe.REGION_SETS) | set(probe.BACKEND_SETS)


def test_stacked_summary_adds_kernels_and_busy_time_per_set(probe):
    def run(backends, ms, kernels, busy):
        out = _attention_run(backends, {"1": ms}, {"1": [[5]]})
        out["activity"] = {"1": {"kernels_per_token": kernels, "kernel_busy_ms_per_token": busy}}
        return out

    runs = [
        run("stacked", 1.4, 296.0, 1.2),
        run("unstacked", 1.6, 344.0, 1.4),
        run("stacked", 1.4, 296.0, 1.3),
        {"backends": "unstacked", "returncode": 1},
    ]
    summary = probe.stacked_summary(runs)
    assert summary["unstacked_over_stacked"] == {"1": round(1.6 / 1.4, 4)}
    assert summary["tokens_equal"] == {"1": True}
    assert summary["kernels_per_token"] == {"stacked": {"1": 296.0}, "unstacked": {"1": 344.0}}
    assert summary["kernel_busy_ms_per_token"]["stacked"] == {"1": 1.25}


def test_the_stacked_runs_alternate_the_two_sets(probe):
    assert probe.STACK_RUNS == ("stacked", "unstacked", "stacked", "unstacked")
    assert set(probe.STACK_SETS) == {"stacked", "unstacked"}


def test_the_pack_gqa_runs_alternate_and_summarize_packed_over_unpacked(probe):
    assert probe.PACK_RUNS == ("packed", "unpacked", "packed", "unpacked")
    assert probe.PACK_SETS == {"packed": True, "unpacked": False}

    def run(backends, ms, kernels):
        out = _attention_run(backends, {"8": ms}, {"8": [[5]]})
        out["activity"] = {"8": {"kernels_per_token": kernels, "kernel_busy_ms_per_token": 1.0}}
        return out

    summary = probe.pack_gqa_summary([run("packed", 1.4, 265.0), run("unpacked", 1.5, 297.0)])
    assert summary["packed_over_unpacked"] == {"8": round(1.4 / 1.5, 4)}
    assert summary["kernels_per_token"] == {"packed": {"8": 265.0}, "unpacked": {"8": 297.0}}
