"""The compiled decode step's GEMMs alone: each projection of the serving benchmark's
Llama at one, two and eight rows, the kernel cuBLAS picks for it and the bandwidth it
reaches, under each BLAS library torch offers.

Run from the repository root on the GPU machine:

    PYTHONPATH=src python benchmarks/probes/decode_gemms.py --out benchmarks/results/ \
        --commit <short sha>

Why: the serving benchmark's profile of the compiled decode at batch 1 has the two
512-row projections (keys and values, four key-value heads of 128) on a kernel of
their own (``nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN``, 5.2 us for 2 MiB of weights),
while the wider projections run at about 1.9 TB/s. This measures each shape apart
from the model, so that a change of the rows, the library or the layout is judged on
the GEMM before the decode.

Each sample is one CUDA graph of ``GRAPHED_GEMMS`` calls, each over a weight of its own
(together larger than the L2 cache, as a decode step's weights are), timed with CUDA
events; the median of ``SAMPLES`` replays, per GEMM. The kernel is the profiler's name
for one eager call. ``three_vs_fused`` is the per-layer cost of the query, key and value
projections as three GEMMs against one GEMM over their rows stacked. Writes
``probe-decode_gemms-<device>-<commit>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = (1, 2, 8)
LIBRARIES = ("cublas", "cublaslt")
GRAPHED_GEMMS = 64
SAMPLES = 15
#: The weights a sample cycles through, in bytes: past the H100's and H200's 50 MiB L2.
WEIGHT_BYTES = 256 * 2**20


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Each projection's weight, ``(out_features, in_features)``, from a Llama config
    as ``serving_hf.MODELS`` holds it."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {
        "q": (q, hidden),
        "k_v": (kv, hidden),
        "qkv_stacked": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (inter, hidden),
        "gate_up_stacked": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def summary(records: dict[str, dict]) -> dict:
    """Per library and shape, each row count's microseconds a GEMM over one row's, and
    the one-row key-value projection's bandwidth over the query projection's (a
    kernel choice that costs the narrow shape shows as a ratio well below 1)."""
    out: dict = {}
    for lib, by_shape in records.items():
        lib_out: dict = {}
        for name, by_rows in by_shape.items():
            one = by_rows.get("1", {}).get("us")
            lib_out[name] = {
                rows: (round(r["us"] / one, 3) if one else None)
                for rows, r in by_rows.items()
                if rows != "1"
            }
        q1 = by_shape.get("q", {}).get("1", {}).get("gbps")
        kv1 = by_shape.get("k_v", {}).get("1", {}).get("gbps")
        lib_out["k_v_over_q_bandwidth_at_1_row"] = round(kv1 / q1, 3) if q1 and kv1 else None
        out[lib] = lib_out
    return out


def graphed_us(fn: Callable[[int], object], calls: int) -> float:
    """Median microseconds per call of ``fn(i)`` for ``i`` in ``range(calls)``,
    captured into one CUDA graph and replayed."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(SAMPLES):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def kernel_names(fn: Callable[[], object]) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def one_shape(n: int, k: int) -> dict[str, dict]:
    """One weight shape at each of :data:`ROWS`, under the current BLAS library."""
    import torch
    import torch.nn.functional as F

    count = max(2, WEIGHT_BYTES // (n * k * 2))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    out = {}
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        us = graphed_us(lambda i, x=x: F.linear(x, weights[i % count]), GRAPHED_GEMMS)
        out[str(rows)] = {
            "us": round(us, 3),
            "gbps": round(n * k * 2 / (us * 1e-6) / 1e9, 1),
            "kernels": kernel_names(lambda x=x: F.linear(x, weights[0])),
        }
    return out


def measure(config: dict) -> dict:
    """:func:`one_shape` for every projection, under each of :data:`LIBRARIES`; torch's
    preferred library is put back afterwards."""
    import torch

    records: dict = {}
    before = torch.backends.cuda.preferred_blas_library()
    try:
        for lib in LIBRARIES:
            torch.backends.cuda.preferred_blas_library(lib)
            records[lib] = {}
            for name, (n, k) in shapes(config).items():
                records[lib][name] = one_shape(n, k)
                print(lib, name, json.dumps(records[lib][name])[:300], flush=True)
                torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    return records


def three_vs_fused(config: dict) -> dict:
    """Per layer, microseconds of the query, key and value projections as three GEMMs
    over slices of one stacked weight, and as one GEMM over it, at each of :data:`ROWS`."""
    import torch
    import torch.nn.functional as F

    q, hidden = shapes(config)["q"]
    kv = shapes(config)["k_v"][0]
    layers = config["num_hidden_layers"]
    stacked = [
        torch.randn(q + 2 * kv, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(layers)
    ]
    out: dict = {}

    def three(x: torch.Tensor, i: int) -> None:
        w = stacked[i % layers]
        F.linear(x, w[:q])
        F.linear(x, w[q : q + kv])
        F.linear(x, w[q + kv :])

    def fused(x: torch.Tensor, i: int) -> None:
        F.linear(x, stacked[i % layers])

    for rows in ROWS:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        out[str(rows)] = {
            "three_us": round(graphed_us(partial(three, x), layers), 3),
            "fused_us": round(graphed_us(partial(fused, x), layers), 3),
        }
        print("qkv", rows, out[str(rows)], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    import torch

    import serving_hf

    config = serving_hf.MODELS["llama"]
    records = measure(config)
    record = {
        "probe": "decode_gemms",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": args.commit,
        "config": config,
        "graphed_gemms": GRAPHED_GEMMS,
        "samples": SAMPLES,
        "gemms": records,
        "three_vs_fused": three_vs_fused(config),
        "summary": summary(records),
    }
    device = torch.cuda.get_device_name().lower().replace(" ", "-")
    out = Path(args.out) / f"probe-decode_gemms-{device}-{args.commit}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"], indent=1))


if __name__ == "__main__":
    main()
