"""The pure parts of ``benchmarks/serving_decode.py`` on the CPU: ratios, targets and
failures from synthetic results, the argument checks, and the exit without a GPU."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def bench(serving_decode):
    return serving_decode


def timed(**ms):
    """A batch result whose latency and throughput medians are ``ms`` (variant -> ms)."""
    per_mode = {v: {"median": t, "min": t, "max": t, "rounds": 3} for v, t in ms.items()}
    return {"modes": {"throughput": per_mode, "latency": per_mode}}


def configs(launch_bound=None, default=None):
    return {
        "launch_bound": {"batches": launch_bound or {}},
        "default": {"batches": default or {}},
    }


def test_the_latency_overhead_target_is_runner_minus_raw_at_the_same_batch(bench):
    results = configs(
        launch_bound={
            "1": timed(runner=0.110, raw_cuda_graph=0.100),  # 10 us over
            "8": timed(runner=0.125, raw_cuda_graph=0.100),  # 25 us over
        }
    )
    targets = bench.compute_targets(results)
    assert targets["runner_latency_overhead_le_15us_bs1"] is True
    assert targets["runner_latency_overhead_le_15us_bs8"] is False
    assert targets["runner_latency_overhead_le_15us"] is False
    results["launch_bound"]["batches"]["8"] = timed(runner=0.1149, raw_cuda_graph=0.100)
    assert bench.compute_targets(results)["runner_latency_overhead_le_15us"] is True


def test_targets_use_the_latency_mode_only(bench):
    batch = timed(runner=0.110, raw_cuda_graph=0.100)
    batch["modes"]["latency"]["runner"]["median"] = 0.200  # throughput stays 10 us over
    targets = bench.compute_targets(configs(launch_bound={"1": batch, "8": batch}))
    assert targets["runner_latency_overhead_le_15us_bs1"] is False


def test_unmeasured_targets_are_none_not_true(bench):
    targets = bench.compute_targets(configs(launch_bound={"1": timed(runner=0.1)}))
    assert targets["runner_latency_overhead_le_15us_bs1"] is None
    assert targets["runner_latency_overhead_le_15us"] is None
    assert targets["runner_padded_20_le_1.10x_raw_20"] is None
    assert targets["pool_all_buckets_le_1.3x_largest_alone"] is None


def test_padded_targets_compare_the_runner_with_raw_at_the_padded_size(bench):
    results = configs(
        default={
            "5": timed(runner=1.05, raw_cuda_graph=1.0, raw_cuda_graph_at_bucket=1.04),
            "20": timed(runner=1.2, raw_cuda_graph=1.0, raw_cuda_graph_at_bucket=1.0),
        },
        launch_bound={
            "5": timed(runner=0.130, raw_cuda_graph=0.100, raw_cuda_graph_at_bucket=0.120),
            "20": timed(runner=0.140, raw_cuda_graph=0.100, raw_cuda_graph_at_bucket=0.120),
        },
    )
    targets = bench.compute_targets(results)
    assert targets["runner_padded_5_le_1.10x_raw_5"] is True
    assert targets["runner_padded_20_le_1.10x_raw_20"] is False
    # launch_bound: against the raw graph at the bucket, the same GPU program
    assert targets["launch_bound_runner_padded_5_overhead_le_15us_raw_at_bucket"] is True
    assert targets["launch_bound_runner_padded_20_overhead_le_15us_raw_at_bucket"] is False


def test_the_pool_target(bench):
    results = configs()
    results["default"]["runner"] = {"pool_bytes": 125}
    results["default"]["runner_largest_alone"] = {"pool_bytes": 100}
    assert bench.compute_targets(results)["pool_all_buckets_le_1.3x_largest_alone"] is True
    results["default"]["runner"] = {"pool_bytes": 131}
    assert bench.compute_targets(results)["pool_all_buckets_le_1.3x_largest_alone"] is False


def test_the_capture_time_target(bench):
    results = configs()
    assert bench.compute_targets(results)["all_buckets_capture_le_2x_largest"] is None
    results["default"]["runner"] = {"capture_s": 0.6}
    results["default"]["runner_largest_alone"] = {"capture_s": 0.3}
    assert bench.compute_targets(results)["all_buckets_capture_le_2x_largest"] is True
    results["default"]["runner"] = {"capture_s": 0.61}
    assert bench.compute_targets(results)["all_buckets_capture_le_2x_largest"] is False


def test_ratios_use_each_variants_own_floor(bench):
    batch = timed(runner=0.2, raw_cuda_graph=0.1, raw_cuda_graph_at_bucket=0.15, eager=0.4)
    batch["kernel_busy_ms"] = {
        "runner": 0.1,
        "raw_cuda_graph": 0.05,
        "raw_cuda_graph_at_bucket": 0.1,
        "eager": {"error": "profiler failed"},
    }
    r = bench.batch_ratios(batch)["latency"]
    assert r["runner_minus_raw_us"] == 100.0
    assert r["runner_minus_raw_at_bucket_us"] == 50.0
    assert r["runner/raw_cuda_graph"] == 2.0
    assert r["runner/raw_cuda_graph_at_bucket"] == pytest.approx(1.3333)
    assert r["runner/kernel_busy(runner)"] == 2.0
    assert r["raw_cuda_graph/kernel_busy(raw_cuda_graph)"] == 2.0
    assert "eager/kernel_busy(eager)" not in r


def test_derive_writes_ratios_and_targets(bench):
    report = {"configs": configs(launch_bound={"1": timed(runner=0.11, raw_cuda_graph=0.1)})}
    bench.derive(report)
    assert report["ratios"]["launch_bound"]["1"]["latency"]["runner_minus_raw_us"] == 10.0
    assert report["targets"]["runner_latency_overhead_le_15us_bs1"] is True


def test_failures_name_bad_checks_and_errors_but_not_compile(bench):
    good = {"within_tol": True}
    report = {
        "configs": {
            "launch_bound": {
                "runner": {},
                "batches": {
                    "1": {
                        "errors": {"torch_compile_reduce_overhead": {"error": "x"}},
                        "check": {
                            "runner_vs_eager": good,
                            "torch_compile_reduce_overhead_vs_eager": {"within_tol": False},
                        },
                    },
                    "5": {
                        "errors": {"raw_cuda_graph": {"error": "x"}},
                        "check": {"raw_cuda_graph_at_bucket_vs_eager": {"within_tol": False}},
                    },
                },
            },
            "default": {"runner": {"error": "oom"}, "batches": {}},
        }
    }
    assert bench.failures(report) == [
        "launch_bound/bs5/raw_cuda_graph",
        "launch_bound/bs5: raw_cuda_graph_at_bucket_vs_eager beyond tolerance",
        "default/runner",
    ]


def test_arguments_are_checked(bench):
    args = bench.parse_args([])
    assert args.batch_sizes == [1, 8, 32] and args.padded == [5, 20]
    assert args.configs == ["launch_bound", "default"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch-sizes", "65"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_without_a_gpu_it_says_so_and_exits_0(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().err
    assert bench.main(["--require-gpu"]) == 2
