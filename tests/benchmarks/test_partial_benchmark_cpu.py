"""CPU tests of ``benchmarks/partial_train.py``: the wiring of one config and regime end
to end on tiny CPU models (CUDA calls stubbed out)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

# ---- partial_train -------------------------------------------------------------------


def test_partial_compare_step_checks_the_loss_and_every_gradient(pt):
    want = {"loss": torch.tensor(2.0), "a.weight": torch.ones(3), "b.weight": torch.ones(2)}
    same = {k: v.clone() for k, v in want.items()}
    out = pt.compare_step(same, want)
    assert out["equal"] and out["within_tol"] and out["grads"]["tensors"] == 2
    off = {**same, "b.weight": torch.tensor([1.0, 1.5])}
    out = pt.compare_step(off, want)
    assert not out["within_tol"] and out["grads"]["worst"] == "b.weight"
    loss_off = {**same, "loss": torch.tensor(2.01)}
    out = pt.compare_step(loss_off, want)
    assert out["grads"]["within_tol"] and not out["within_tol"]
    assert out["loss_rel_err"] == pytest.approx(0.005, rel=1e-4)
    nan = pt.compare_step({**same, "loss": torch.tensor(math.nan)}, want)
    assert nan["loss_rel_err"] is None and not nan["within_tol"]


def test_partial_summary_ratios_and_targets(pt):
    def summary(median):
        return {"median": median, "min": median, "max": median, "rounds": 7}

    result = {
        "variants": {
            "eager": {"ms": summary(30.0), "kernel_busy_ms": 2.0},
            "partial": {
                "ms": summary(20.0),
                "kernel_busy_ms": 2.5,
                "stats": {"fallbacks": 0, "replayed": 10},
            },
            "whole_layer": {"error": "x"},
        }
    }
    result["variants"]["partial_widest"] = {
        "ms": summary(5.0),
        "stats": {"fallbacks": 0, "replayed": 10},
    }
    result["check"] = {"partial": {"loss_equal": True}, "partial_widest": {"loss_equal": True}}
    pt.summarize_model(result, pt.CONFIGS["launch_bound"], "llama")
    r = result["ratios"]
    assert r["eager/partial"] == 1.5 and r["eager/whole_layer"] is None
    assert r["eager/partial_widest"] == 6.0
    assert r["partial/kernel_busy_eager"] == 10.0 and r["partial/kernel_busy_own"] == 8.0
    assert result["targets"] == {
        "partial_speedup_ge_1.3x_launch_bound": True,
        "llama_launch_bound_ge_5x_eager": True,
        "zero_fallbacks": True,
        "eager_equal_losses": True,
    }
    result["variants"]["partial"]["ms"] = summary(24.0)
    result["variants"]["partial_widest"]["stats"]["fallbacks"] = 1
    result["check"]["eager_experts_loop"] = {"loss_equal": False}  # a reference row
    pt.summarize_model(result, pt.CONFIGS["launch_bound"], "mixtral")
    targets = result["targets"]
    assert targets["partial_speedup_ge_1.3x_launch_bound"] is False
    assert targets["mixtral_launch_bound_ge_3x_eager"] is True
    assert targets["zero_fallbacks"] is False and targets["eager_equal_losses"] is True
    result["check"]["partial"]["loss_equal"] = False
    pt.summarize_model(result, pt.CONFIGS["larger"], "mixtral")
    assert result["targets"] == {"zero_fallbacks": False, "eager_equal_losses": False}
    report = {"configs": {"larger": {"models": {"mixtral": result}}}}
    assert pt.flat_targets(report) == {
        "mixtral_larger_zero_fallbacks": False,
        "mixtral_larger_eager_equal_losses": False,
    }


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _partial_builders(pt):
    x = torch.randn(2, 4)

    def make(scale: float, stats: bool = False):
        def build(model, shape):
            net = _TinyLM()
            for p in net.parameters():
                p.grad = torch.zeros_like(p)
            replayed = {"n": 0}

            def step():
                replayed["n"] += 1
                loss = net(x).pow(2).mean() * scale
                loss.backward()
                return loss.detach()

            def get_stats():
                return {"captured": 1, "replayed": replayed["n"], "fallbacks": 0}

            return pt.Built(step, net, 0.0, stats=get_stats if stats else None)

        return build

    return {"eager": make(1.0), "partial": make(1.0, stats=True), "whole_layer": make(1.1)}


def test_partial_one_model_end_to_end(pt, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(pt, "BUILDERS", _partial_builders(pt))
    shape = pt.replace(pt.CONFIGS["launch_bound"], iters=2, repeats=3)
    res = pt.run_model("llama", shape, ["eager", "partial", "whole_layer"])
    assert res["regime"] == "accumulate"
    assert res["check"]["partial"]["equal"]
    assert not res["check"]["whole_layer"]["within_tol"]  # its loss is scaled: planted
    assert res["check"]["whole_layer"]["grads"]["tensors"] == 4
    partial = res["variants"]["partial"]
    assert partial["ms"]["rounds"] == 3
    # every step after the build: the check's, the warmup's and the timed ones
    assert partial["replays_per_step"] == 1.0
    assert res["targets"]["zero_fallbacks"] is True
    assert res["targets"]["eager_equal_losses"] is False  # whole_layer's planted scale
    json.dumps(res, allow_nan=False)
    report = {"configs": {"launch_bound": {"models": {"llama": res}}}}
    assert pt.failures(report) == ["launch_bound/llama/whole_layer: check beyond tolerance"]
    qwen = pt.run_model("qwen3_moe", shape, ["eager", "partial", "whole_layer"])
    assert "whole_layer" not in qwen["variants"]
    loop = pt.run_model("llama", shape, ["eager", "eager_experts_loop"])
    assert "eager_experts_loop" not in loop["variants"], "a dense model has no experts"


def test_the_parameter_rule_allows_a_few_flipped_updates_and_refuses_a_missing_step(ts):
    torch.manual_seed(0)
    lr, steps = 1e-3, 3
    bound = 2 * steps * lr * ts.ADAM_MAX_UPDATE
    start = (torch.randn(64, 64) * 0.02).to(torch.bfloat16)
    sign = torch.randn(64, 64).sign().to(torch.bfloat16)
    eager = start - steps * lr * sign
    flipped = sign.clone()
    flipped.view(-1)[:40] *= -1  # 1% of the elements saw their gradient's sign flip
    graphed = start - steps * lr * flipped
    ok = ts.compare_params({"w": graphed}, {"w": eager}, max_update=bound)
    assert ok["within_tol"] and not ok["equal"], ok
    assert ok["max_mismatch_fraction"] == pytest.approx(40 / 4096, abs=2e-3)
    assert ok["max_abs_diff"] <= bound
    missing_step = ts.compare_params({"w": start}, {"w": eager}, max_update=bound)
    assert not missing_step["within_tol"] and missing_step["beyond_tol"] == ["w"]
    assert missing_step["max_mismatch_fraction"] > 0.5
    far = graphed.clone()
    far[0, 0] += 1.0  # one element off by far more than any update
    too_far = ts.compare_params({"w": far}, {"w": eager}, max_update=bound)
    assert not too_far["within_tol"] and "(an element beyond max_update)" in too_far["beyond_tol"]
    same = ts.compare_params({"w": eager.clone()}, {"w": eager}, max_update=bound)
    assert same["equal"] and same["within_tol"] and same["max_mismatch_fraction"] == 0.0
    nan = eager.clone()
    nan[0, 0] = float("nan")
    assert not ts.compare_params({"w": nan}, {"w": eager}, max_update=bound)["within_tol"]
    gone = ts.compare_params({}, {"w": eager}, max_update=bound)
    assert gone["missing"] == ["w"] and not gone["within_tol"]


def test_fresh_kernel_busy_releases_the_build_and_records_failures(ts, monkeypatch):
    import _checks

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    from cudagraphs.timing import KernelActivity

    monkeypatch.setattr(
        _checks,
        "kernel_activity",
        lambda step, iters, warmup: KernelActivity(
            1.23456, 291.98, (("gemm_" * 40, 0.81234, 8.0),)
        ),
    )
    released = []

    class Built:
        step = staticmethod(lambda: None)

    ok = _checks.fresh_kernel_busy(Built, released.append, iters=2, warmup=1)
    assert ok == {
        "kernel_busy_ms": 1.2346,
        "kernels_per_step": 292.0,
        "heaviest_kernels": [{"name": ("gemm_" * 40)[:120], "ms": 0.8123, "launches": 8.0}],
    }
    assert len(released) == 1

    def failing_build():
        raise RuntimeError("no build")

    out = _checks.fresh_kernel_busy(failing_build, released.append, iters=2, warmup=1)
    assert "no build" in out["kernel_busy_error"]["error"] and len(released) == 1

    def failing_profile(step, iters, warmup):
        raise RuntimeError("profiler died")

    monkeypatch.setattr(_checks, "kernel_activity", failing_profile)
    out = _checks.fresh_kernel_busy(Built, released.append, iters=2, warmup=1)
    assert "profiler died" in out["kernel_busy_error"]["error"] and len(released) == 2


@pytest.mark.parametrize("model", ["llama", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_each_partial_train_model_builds_and_trains_a_step_on_the_cpu(pt, model):
    # The benchmark's own configs, at the launch-bound widths with 2 layers: a config
    # that transformers refuses, or one whose shapes disagree, fails here, not on a GPU.
    transformers = pytest.importorskip("transformers")
    shape = pt.replace(pt.CONFIGS["launch_bound"], layers=2, seq=16)
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(pt.hf_config(model, shape))
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq))
    loss = pt.train_step(net.train(), ids)
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
    # With a padded mask transformers passes SDPA a full mask, as it does under a graph
    # capture (the model scope); DeepSeek-V3 with grouped KV heads failed there.
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    assert torch.isfinite(net(input_ids=ids, attention_mask=mask, use_cache=False).logits).all()


def test_a_reference_row_beyond_tolerance_is_recorded_not_failed(pt):
    res = {
        "variants": {"eager": {}, "eager_experts_loop": {}},
        "check": {
            "eager_experts_loop": {"within_tol": False},
            "partial": {"within_tol": False},
        },
    }
    report = {"configs": {"launch_bound": {"models": {"qwen3_moe": res}}}}
    assert pt.failures(report) == ["launch_bound/qwen3_moe/partial: check beyond tolerance"]


def test_partial_layers_and_widest_rows_name_their_scopes_and_count_in_the_targets(pt):
    # partial_widest adds the whole-model scope to every per-layer scope; partial_layers
    # is the per-layer row it is compared with, and a fallback there fails the target.
    from cudagraphs.partial import MODEL_SCOPE, SCOPES

    assert (*SCOPES, MODEL_SCOPE) == pt.WIDEST_SCOPES
    assert pt.BUILDERS["partial_layers"].keywords == {"scopes": SCOPES}
    assert pt.BUILDERS["partial_widest"].keywords == {"scopes": pt.WIDEST_SCOPES}
    assert pt.settings(["llama"], ["eager"])["scopes"] == {
        "partial": ["attention", "moe_router"],
        "partial_layers": list(SCOPES),
        "partial_widest": [*SCOPES, "model"],
        "partial_widest_compiled": f"{[*SCOPES, 'model']}, compile_options={{}}",
    }
    assert pt.BUILDERS[pt.COMPILED].keywords == {
        "scopes": pt.WIDEST_SCOPES,
        "compile_options": {},
    }

    def row(median, fallbacks=0):
        stats = {"fallbacks": fallbacks, "replayed": 10}
        return {"ms": {"median": median, "min": median, "max": median, "rounds": 7}, "stats": stats}

    result = {
        "variants": {"eager": row(30.0), "partial_layers": row(6.0, 1), "partial_widest": row(3.0)},
        "check": {},
    }
    pt.summarize_model(result, pt.CONFIGS["launch_bound"], "llama")
    assert result["ratios"]["eager/partial_layers"] == 5.0
    assert result["ratios"]["partial_layers/partial_widest"] == 2.0
    assert result["targets"]["llama_launch_bound_ge_5x_eager"] is True  # 10x, the widest
    assert result["targets"]["zero_fallbacks"] is False  # partial_layers fell back once


def test_the_compiled_row_counts_for_fallbacks_but_not_for_bitwise_losses(pt):
    def row(median, fallbacks=0):
        stats = {"fallbacks": fallbacks, "replayed": 10}
        return {"ms": {"median": median, "min": median, "max": median, "rounds": 7}, "stats": stats}

    result = {
        "variants": {"eager": row(30.0), "partial_widest": row(3.0), pt.COMPILED: row(2.0)},
        "check": {
            "partial_widest": {"loss_equal": True, "within_tol": True},
            pt.COMPILED: {"loss_equal": False, "within_tol": True},
        },
    }
    pt.summarize_model(result, pt.CONFIGS["launch_bound"], "llama")
    assert result["targets"]["eager_equal_losses"] is True  # the compiled row rounds otherwise
    assert result["targets"]["zero_fallbacks"] is True
    assert result["ratios"][f"{pt.COMPILED}/partial_widest"] == round(2.0 / 3.0, 4)
    assert result["ratios"][f"eager/{pt.COMPILED}"] == 15.0
    result["variants"][pt.COMPILED] = row(2.0, fallbacks=1)
    pt.summarize_model(result, pt.CONFIGS["launch_bound"], "llama")
    assert result["targets"]["zero_fallbacks"] is False
