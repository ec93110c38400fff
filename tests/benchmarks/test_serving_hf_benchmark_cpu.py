"""The pure parts of ``benchmarks/serving_hf.py`` on the CPU: its targets from synthetic
results (the compiled generator's own target beside the eager one's), the shared-prefix
count of two token outputs, and the exit without a GPU."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def bench(serving_hf):
    return serving_hf


def batch(bench, equal=True, **ms):
    return {
        "tokens": {bench.OURS: {"equal_hf_static_eager": equal}},
        "ms_per_token": {k: {"median": v, "min": v, "max": v} for k, v in ms.items()},
    }


GRAPHS_ONLY = {"dropped": {}, "eager_runs": {}, "replays": {"bucket(bs=1)": 3}}


def report(bench, *batches, startup=None, stats=GRAPHS_ONLY, compiled_stats=GRAPHS_ONLY):
    model = {"batches": dict(enumerate(batches)), "stats": stats, "compiled_stats": compiled_stats}
    return {"models": {"llama": model}, "startup": startup or {}}


def test_a_generator_that_ran_eagerly_meets_no_per_token_target(bench):
    fast = batch(
        bench, hf_static_eager=9.0, hf_static_compiled=2.4, cudagraphs=2.5, cudagraphs_compiled=1.5
    )
    # Every compiled capture failed: buckets dropped, the decode steps eager.
    dropped = {"dropped": {"bucket(bs=1)": "error"}, "eager_runs": {}, "replays": {}}
    targets = bench.compute_targets(report(bench, fast, compiled_stats=dropped))
    assert targets["compiled_per_token_le_0.65x_hf_compiled"] is False
    assert targets["per_token_le_hf_static_eager"] is True
    eager = {"dropped": {}, "eager_runs": {"bucket(bs=1)": 4}, "replays": {"bucket(bs=1)": 9}}
    targets = bench.compute_targets(report(bench, fast, stats=eager))
    assert targets["per_token_le_hf_static_eager"] is False
    never = {"dropped": {}, "eager_runs": {}, "replays": {"bucket(bs=1)": 0}}
    assert (
        bench.compute_targets(report(bench, fast, stats=never))["per_token_le_hf_static_eager"]
        is False
    )
    unknown = bench.compute_targets(report(bench, fast, stats=None, compiled_stats=None))
    assert unknown["per_token_le_hf_static_eager"] is None
    assert unknown["compiled_per_token_le_0.65x_hf_compiled"] is None


def test_graphs_only_reads_dropped_buckets_eager_runs_and_replays(bench):
    assert bench.graphs_only(GRAPHS_ONLY) is True
    assert bench.graphs_only(None) is None
    assert bench.graphs_only({}) is False
    assert bench.graphs_only({**GRAPHS_ONLY, "dropped": {"b": "x"}}) is False
    assert bench.graphs_only({**GRAPHS_ONLY, "eager_runs": {"b": 1}}) is False


def test_each_generator_has_its_own_like_for_like_per_token_target(bench):
    # Eager kernels against HF's static-cache eager generate; compiled against 0.65x HF's
    # compiled generate.
    fast = batch(
        bench, hf_static_eager=9.0, hf_static_compiled=2.4, cudagraphs=2.5, cudagraphs_compiled=1.5
    )
    targets = bench.compute_targets(report(bench, fast))
    assert targets["per_token_le_hf_static_eager"] is True
    assert targets["compiled_per_token_le_0.65x_hf_compiled"] is True  # 1.5 <= 0.65 * 2.4
    assert "per_token_le_hf_compiled" not in targets  # retired
    over = batch(
        bench,
        hf_static_eager=2.4,
        hf_static_compiled=2.4,
        cudagraphs=2.41,
        cudagraphs_compiled=1.57,
    )
    targets = bench.compute_targets(report(bench, fast, over))
    assert targets["per_token_le_hf_static_eager"] is False  # one batch over is enough
    assert targets["compiled_per_token_le_0.65x_hf_compiled"] is False  # 1.57 > 1.56
    tie = batch(
        bench, hf_static_eager=2.5, hf_static_compiled=2.0, cudagraphs=2.5, cudagraphs_compiled=1.3
    )
    targets = bench.compute_targets(report(bench, tie))
    assert targets["per_token_le_hf_static_eager"] is True
    assert targets["compiled_per_token_le_0.65x_hf_compiled"] is True  # 1.3 == 0.65 * 2.0


def test_unmeasured_targets_are_none_not_true(bench):
    without_compiled = batch(bench, hf_static_eager=2.4, hf_static_compiled=2.4, cudagraphs=2.3)
    targets = bench.compute_targets(report(bench, without_compiled))
    assert targets["per_token_le_hf_static_eager"] is True
    assert targets["compiled_per_token_le_0.65x_hf_compiled"] is None
    assert targets["startup_le_2s"] is None
    assert targets["all_buckets_capture_le_2x_largest"] is None
    assert bench.compute_targets({"models": {}})["tokens_equal"] is None
    unequal = batch(bench, equal=False, hf_static_compiled=2.4, cudagraphs=2.3)
    assert bench.compute_targets(report(bench, unequal))["tokens_equal"] is False


def test_startup_targets(bench):
    start = {
        "all_buckets": {"startup_s": 1.9, "capture_s": 0.8},
        "largest_alone": {"capture_s": 0.4},
    }
    targets = bench.compute_targets(report(bench, startup=start))
    assert targets["startup_le_2s"] is True and targets["all_buckets_capture_le_2x_largest"] is True
    start["all_buckets"] = {"startup_s": 2.1, "capture_s": 0.81}
    targets = bench.compute_targets(report(bench, startup=start))
    assert (
        targets["startup_le_2s"] is False and targets["all_buckets_capture_le_2x_largest"] is False
    )


def test_equal_prefix_counts_leading_new_tokens_equal_in_every_row(bench):
    p = bench.PROMPT_LEN
    a = torch.zeros(2, p + 5, dtype=torch.long)
    assert bench.equal_prefix(a, a.clone()) == 5
    b = a.clone()
    b[1, p + 3] = 7  # row 1 differs at the fourth new token
    assert bench.equal_prefix(a, b) == 3
    b[0, p] = 7
    assert bench.equal_prefix(a, b) == 0
    assert bench.equal_prefix(a, a[:, : p + 2]) == 2  # the shorter output bounds it
    assert bench.equal_prefix(a, None) is None
    assert bench.equal_prefix(a, a[:1]) is None


def test_without_a_gpu_it_says_so_and_exits_0(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert bench.main(["--require-gpu"]) == 2


def test_startups_and_models_are_chosen_apart(bench):
    args = bench.parse_args(["--models", "--skip-startup"])
    assert args.models == [] and args.skip_startup and not args.skip_compiled_startup
    args = bench.parse_args(["--models", "llama", "--skip-compiled-startup"])
    assert args.models == ["llama"] and args.skip_compiled_startup and not args.skip_startup
    assert bench.parse_args([]).models == list(bench.DEFAULT_MODELS)


def test_the_sliding_window_model_runs_only_when_asked_and_slides_within_a_request(bench):
    assert bench.parse_args([]).models == ["llama", "qwen3_moe"]
    assert bench.parse_args(["--models", "mistral"]).models == ["mistral"]
    config = bench.MODELS["mistral"]
    assert config["sliding_window"] < bench.PROMPT_LEN + bench.NEW_TOKENS
    assert {k: v for k, v in config.items() if k != "sliding_window"} == bench.MODELS["llama"]


def test_tokens_equal_leaves_out_a_sliding_window_model(bench):
    rep = report(bench, batch(bench, equal=True, hf_static_eager=2.0, cudagraphs=1.9))
    rep["models"]["mistral"] = {
        "config": bench.MODELS["mistral"],
        "batches": {"1": batch(bench, equal=False, hf_static_eager=2.0, cudagraphs=1.9)},
        "stats": GRAPHS_ONLY,
    }
    targets = bench.compute_targets(rep)
    assert targets["tokens_equal"] is True  # mistral's unequal tokens are not counted
    assert targets["per_token_le_hf_static_eager"] is True
    rep["models"]["llama"]["batches"][0]["tokens"][bench.OURS]["equal_hf_static_eager"] = False
    assert bench.compute_targets(rep)["tokens_equal"] is False


def test_the_compiled_capture_target_reads_the_cold_start(bench):
    def with_cold(capture_s):
        rep = report(bench)
        rep["compiled_startup"] = {
            "empty_inductor_cache": {"capture_s": capture_s},
            "warm_inductor_cache": {"capture_s": 1.0},
        }
        return bench.compute_targets(rep)["compiled_capture_le_20s"]

    assert with_cold(19.9) is True and with_cold(20.0) is True
    assert with_cold(20.1) is False  # the warm restart does not count
    assert bench.compute_targets(report(bench))["compiled_capture_le_20s"] is None
    failed = report(bench)
    failed["compiled_startup"] = {"empty_inductor_cache": {"error": "boom"}}
    assert bench.compute_targets(failed)["compiled_capture_le_20s"] is None


def test_per_token_activity_spreads_a_request_over_its_new_tokens(bench):
    from cudagraphs.timing import KernelActivity

    n = bench.NEW_TOKENS
    activity = KernelActivity(2.0 * n, 800.0 * n, (("gemv", 1.25 * n, 64.0 * n),))
    assert bench.per_token_activity(activity, "compiled_") == {
        "compiled_kernel_busy_ms_per_token": 2.0,
        "compiled_kernels_per_token": 800.0,
        "compiled_heaviest_kernels_per_token": [{"name": "gemv", "ms": 1.25, "launches": 64.0}],
    }
    assert set(bench.per_token_activity(activity)) == {
        "kernel_busy_ms_per_token",
        "kernels_per_token",
        "heaviest_kernels_per_token",
    }


class _Generates:
    """A stand-in with ``generate``: records the ``max_new_tokens`` it was asked for."""

    def __init__(self):
        self.asked = []

    def generate(self, ids, **kwargs):
        self.asked.append(kwargs["max_new_tokens"])
        return ids


def test_the_prefill_split_times_one_token_requests_and_spreads_the_rest(bench, monkeypatch):
    n = bench.NEW_TOKENS
    prefill = {bench.OURS: 10.0, bench.OURS_COMPILED: 8.0, bench.HF_COMPILED: 12.0}

    def fake_samples(steps, **kwargs):
        for step in steps.values():
            step()
        return {k: [prefill[k]] * 3 for k in steps}

    monkeypatch.setattr(bench, "interleaved_samples_ms", fake_samples)
    ours, compiled, model = _Generates(), _Generates(), _Generates()
    request = {k: {"median": v + 2.0 * (n - 1)} for k, v in prefill.items()}
    got = bench.prefill_split(model, torch.zeros(1, 4), ours, compiled, {"request_ms": request})
    assert got["prefill_ms"] == prefill
    assert got["decode_ms_per_token"] == {k: 2.0 for k in prefill}
    # Every prefill is a request of one new token, HF's compiled generate's too.
    assert ours.asked == compiled.asked == model.asked == [1]


def test_the_prefill_split_leaves_out_a_variant_that_was_not_timed(bench, monkeypatch):
    monkeypatch.setattr(
        bench, "interleaved_samples_ms", lambda steps, **kw: {k: [1.0] for k in steps}
    )
    request = {bench.OURS: {"median": 64.0}}
    got = bench.prefill_split(
        _Generates(), torch.zeros(1, 4), _Generates(), None, {"request_ms": request}
    )
    assert set(got["prefill_ms"]) == set(got["decode_ms_per_token"]) == {bench.OURS}
