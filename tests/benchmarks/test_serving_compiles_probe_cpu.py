"""CPU test of ``benchmarks/probes/serving_compiles.py``'s log reading: each recompile's
failed guards are kept, read from the lines dynamo writes after "guard failure(s):"."""

from __future__ import annotations

import importlib.util

import pytest

from helpers.train_bench import BENCH

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
    spec = importlib.util.spec_from_file_location(
        "serving_compiles", BENCH / "probes" / "serving_compiles.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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


def test_regional_layers_share_one_compile_and_keep_hfs_tokens(probe, monkeypatch):
    # --regional's model: each decoder layer's decode step runs one compiled function
    # with its own cache layer, so the layer index is never a guard. Compiles then
    # follow the shapes (the buckets), not the layers; the prefill stays eager.
    pytest.importorskip("transformers")
    import torch
    import torch._dynamo
    import transformers
    from torch._dynamo.utils import counters

    from helpers.hf_generate import EOS, PAD, captured, hf_generate, prompts
    from helpers.hf_models import CONFIGS

    def four_layers():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(
            "llama", **{**CONFIGS["llama"], "num_hidden_layers": 4}
        )
        return transformers.AutoModelForCausalLM.from_config(config).eval()

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(
        probe.serving_hf, "COMPILE_OPTIONS", {"backend": backend, "fullgraph": True}
    )
    torch._dynamo.reset()
    counters.clear()
    try:
        model, ref = four_layers(), four_layers()
        ref.load_state_dict(model.state_dict())
        probe.regional(model)
        assert all(isinstance(layer, probe.Region) for layer in model.model.layers)
        gen = captured(model, (1, 2, 4))
        after_capture = len(graphs)
        # A compile per layer would be at least 4 per shape: the shapes' compiles alone
        # (static, dynamic batch, one row, the mask's two forms) are fewer.
        assert 1 <= after_capture <= 4, f"{after_capture} compiles for 4 layers"
        for batch in (1, 3):
            ids, mask = prompts(batch, seed=batch)
            ours = gen.generate(ids, mask, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)
            assert torch.equal(
                ours, hf_generate(ref, ids, mask, 6, eos_token_id=EOS, pad_token_id=PAD)
            )
        assert len(graphs) == after_capture, (
            "requests (eager prefill, bucket shapes) compiled nothing"
        )
        assert gen.stats()["eager_runs"] == {}
    finally:
        torch._dynamo.reset()
