"""Serving decode benchmark: one decode step of a 16-layer Llama-like decoder, eager vs
a raw CUDA graph per batch size vs ``GraphRunner`` (one graph per bucket, shared pool).

The model is ``cudagraphs.models.TinyDecoder`` (vocab 32000, hidden 2048, 16 heads, 4
KV heads, FFN 5632, 16 layers, static KV cache of 64 slots x ``max_seq`` positions) in
bf16, eval mode, everything under ``torch.no_grad()``. A decode step is one forward
of random tokens with every row at the same position (128 by default):
``model(tokens[b], positions[b]) -> logits[b, 32000]``.

For every batch size (1, 8, 32, and the padded sizes 5 and 20, which replay on the
runner's buckets 8 and 32), in one process:

* ``eager``: ``model(tokens, positions)``.
* ``raw_cuda_graph``: a hand-captured ``torch.cuda.CUDAGraph`` over static
  tokens/positions of exactly that batch size (warmup on a side stream, capture in its
  own pool); a step is two ``copy_`` and ``graph.replay()``. The launch-free reference.
* ``runner``: ``GraphRunner`` with the default buckets (1, 2, 4, 8, 16, 32, 64),
  captured once; a step is ``runner.run({"tokens": t, "positions": p})`` (validation,
  one fused copy, padding fill, replay, borrowed views of the real rows).
* ``kernel_busy``: profiler kernel-busy time of the eager step (the physical floor),
  measured after every wall-clock timing, because CUPTI can stay attached after
  profiling and slow later launches (pytorch/pytorch#144455).
* ``torch_compile_reduce_overhead`` (``--with-compile`` only, batch 1):
  ``torch.compile(model, mode="reduce-overhead")``.

Eager, raw graph and runner of one batch size are timed in alternating rounds, so a
drift of the GPU clock hits them alike. The runner's capture time (all 7 buckets) and
pool (``torch.cuda.memory_reserved`` delta across ``capture``, with ``empty_cache``
before and after) are compared with a runner of the largest bucket (64) alone.

Before timing, each batch size is checked once: with the KV cache zeroed before each
run, the runner's logits rows (and the raw graph's) are compared with eager's.

Prints one JSON object; ``--out`` also writes it. Without a CUDA device it says so on
stderr and exits 0 (2 with ``--require-gpu``). Exits 1 after printing when eager, the
raw graph or the runner failed, or when the runner's logits were off by more than the
tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO / "src") not in sys.path:
    # Run against this checkout's sources, also without PYTHONPATH=src.
    sys.path.insert(0, str(_REPO / "src"))

import torch  # noqa: E402

from _report import (  # noqa: E402
    add_common_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    write_report,
)
from cudagraphs.models import DecoderConfig, TinyDecoder  # noqa: E402
from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec  # noqa: E402
from cudagraphs.timing import kernel_busy_ms, step_time_ms  # noqa: E402

NAME = "serving_decode"
DEVICE = "cuda"
DTYPE = torch.bfloat16
MODEL_SEED = 0
INPUT_SEED = 1234
MAX_BATCH = 64
BATCH_SIZES = (1, 8, 32)
PADDED = (5, 20)
POSITION = 128
MAX_SEQ = 256
LAYERS = 16
ITERS, REPEATS, ROUNDS = 100, 5, 3
WARMUP_STEPS = 10  # per step_time_ms call
RAW_WARMUP = 3  # side-stream warmup runs before the raw capture
CHECK_REL_TOL = 5e-2  # of eager's max |logit|: other kernels at another shape (padding)
TARGET_RATIO = 1.05  # runner <= 1.05 x raw graph; padded <= 1.05 x its bucket
TARGET_POOL_RATIO = 1.3  # all-bucket pool <= 1.3 x the largest bucket's alone

EAGER, RAW, RUNNER = "eager", "raw_cuda_graph", "runner"
COMPILE_VARIANT = "torch_compile_reduce_overhead"
TIMED = (EAGER, RAW, RUNNER)


def model_config(args: argparse.Namespace) -> DecoderConfig:
    return DecoderConfig(
        vocab=32000,
        hidden=2048,
        heads=16,
        kv_heads=4,
        ffn=5632,
        layers=args.layers,
        max_seq=args.max_seq,
        max_batch=MAX_BATCH,
    )


# ---- helpers -----------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def build_model(cfg: DecoderConfig) -> TinyDecoder:
    """Random weights from ``MODEL_SEED``, made on the GPU (a CPU init of ~850M
    parameters takes long), then cast to bf16 (KV cache included)."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.manual_seed(MODEL_SEED)
        with torch.device(DEVICE):
            model = TinyDecoder(cfg)
    return model.to(dtype=DTYPE).eval()


def reset_cache(model: TinyDecoder) -> None:
    model.k_cache.zero_()
    model.v_cache.zero_()


def make_inputs(cfg: DecoderConfig, batch: int, position: int, seed: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch,), generator=gen, device=DEVICE)
    positions = torch.full((batch,), position, dtype=torch.long, device=DEVICE)
    return {"tokens": tokens, "positions": positions}


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return {
        "equal": bool(torch.equal(got, want)),
        "max_abs_diff": diff,
        "ref_max_abs": scale,
        "within_tol": diff <= CHECK_REL_TOL * scale,
    }


def reference_logits(model: TinyDecoder, step: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``step()``'s logits from a zeroed KV cache (owned copy)."""
    reset_cache(model)
    out = step().clone()
    torch.cuda.synchronize()
    return out


# ---- variants ----------------------------------------------------------------------


def decode_runner(
    model: TinyDecoder, cfg: DecoderConfig, config: BucketConfig, position: int
) -> tuple[GraphRunner, dict]:
    """A captured ``GraphRunner`` over the model, and its capture time and pool bytes."""

    def forward(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(tokens, positions)

    largest = config.largest.rows
    specs = [
        InputSpec("tokens", (largest,), torch.long),
        # Padding rows decode token 0 at position 0 in their own cache slots.
        InputSpec("positions", (largest,), torch.long, pad_value=0),
    ]
    runner = GraphRunner(forward, specs, config, device=DEVICE)
    free_memory()
    reserved0 = torch.cuda.memory_reserved()
    allocated0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    runner.capture(lambda b: make_inputs(cfg, b.rows, position, INPUT_SEED + b.rows))
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    free_memory()
    info = {
        "buckets": [b.batch_size for b in config.buckets()],
        "capture_s": round(capture_s, 3),
        "pool_bytes": torch.cuda.memory_reserved() - reserved0,
        "allocated_delta_bytes": torch.cuda.memory_allocated() - allocated0,
        "static_input_bytes": runner.static.nbytes if runner.static is not None else None,
        "captured": runner.stats()["captured"],
        "dropped": runner.stats()["dropped"],
    }
    return runner, info


def raw_graph(model: TinyDecoder, inputs: dict) -> tuple[Callable[[], torch.Tensor], Callable]:
    """A hand-captured graph of exactly this batch size (the PyTorch notes' recipe):
    returns the step (copy inputs, replay, the static logits) and the release."""
    static = {k: v.clone() for k, v in inputs.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(RAW_WARMUP):
            model(static["tokens"], static["positions"])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model(static["tokens"], static["positions"])
    torch.cuda.synchronize()
    tokens, positions = inputs["tokens"], inputs["positions"]

    def step() -> torch.Tensor:
        static["tokens"].copy_(tokens)
        static["positions"].copy_(positions)
        graph.replay()
        return logits

    return step, graph.reset


# ---- per batch size ----------------------------------------------------------------


def check_batch(
    model: TinyDecoder,
    runner: GraphRunner,
    raw_step: Callable[[], torch.Tensor] | None,
    inputs: dict,
    batch: int,
    bucket_rows: int | None,
) -> dict:
    """Runner (and raw graph) logits vs eager's, each from a zeroed KV cache. A padded
    batch is also compared with eager on the batch padded as the runner pads it."""
    tokens, positions = inputs["tokens"], inputs["positions"]
    want = reference_logits(model, lambda: model(tokens, positions))
    got = reference_logits(model, lambda: runner.run(inputs))
    out = {"runner_vs_eager": compare(got, want)}
    if raw_step is not None:
        out["raw_vs_eager"] = compare(reference_logits(model, raw_step), want)
    if bucket_rows is not None and bucket_rows > batch:
        pad = bucket_rows - batch
        padded_t = torch.cat([tokens, tokens.new_zeros(pad)])
        padded_p = torch.cat([positions, positions.new_zeros(pad)])
        want_padded = reference_logits(model, lambda: model(padded_t, padded_p)[:batch])
        out["runner_vs_eager_padded_to_bucket"] = compare(got, want_padded)
    reset_cache(model)
    return out


def measure_batch(
    model: TinyDecoder,
    cfg: DecoderConfig,
    runner: GraphRunner,
    batch: int,
    args: argparse.Namespace,
) -> dict:
    """Check, then time eager / raw graph / runner of one batch size in rounds."""
    log(f"batch {batch}")
    inputs = make_inputs(cfg, batch, args.position, INPUT_SEED + 1000 + batch)
    bucket = runner.select(batch)
    result: dict = {"bucket": bucket.batch_size if bucket is not None else None}
    steps: dict[str, Callable[[], object]] = {
        EAGER: lambda: model(inputs["tokens"], inputs["positions"]),
        RUNNER: lambda: runner.run(inputs),
    }
    release = None
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        raw_step, release = raw_graph(model, inputs)
        result["raw_setup_s"] = round(time.perf_counter() - t0, 3)
        steps[RAW] = raw_step
    except Exception as exc:
        result[RAW] = describe_error(exc)
        raw_step = None
    try:
        result["check"] = check_batch(
            model, runner, raw_step, inputs, batch, bucket.rows if bucket else None
        )
    except Exception as exc:
        result["check"] = describe_error(exc)
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    errors: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name in TIMED:
            if name not in steps or name in errors:
                continue
            try:
                ms = step_time_ms(
                    steps[name], iters=args.iters, warmup=WARMUP_STEPS, repeats=args.repeats
                )
                rounds[name].append(ms)
            except Exception as exc:
                errors[name] = describe_error(exc)
    if release is not None:
        release()
    reset_cache(model)
    result["ms"] = {
        n: statistics.median(rounds[n]) for n in TIMED if rounds.get(n) and n not in errors
    }
    result["rounds_ms"] = {n: rounds[n] for n in TIMED if rounds.get(n)}
    result.update(errors)
    return result


# ---- optional torch.compile --------------------------------------------------------


def measure_compile(model: TinyDecoder, cfg: DecoderConfig, args: argparse.Namespace) -> dict:
    """``torch.compile(mode="reduce-overhead")`` at batch 1: setup, check, time."""
    log(f"{COMPILE_VARIANT} (batch 1)")
    inputs = make_inputs(cfg, 1, args.position, INPUT_SEED + 1000 + 1)
    compiled = torch.compile(model, mode="reduce-overhead")

    def step() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(inputs["tokens"], inputs["positions"])

    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):  # compile, cudagraph-tree warmup, recording
            step()
        torch.cuda.synchronize()
        out: dict = {"setup_s": round(time.perf_counter() - t0, 3)}
        want = reference_logits(model, lambda: model(inputs["tokens"], inputs["positions"]))
        out["check_vs_eager"] = compare(reference_logits(model, step), want)
        out["ms"] = step_time_ms(step, iters=args.iters, warmup=WARMUP_STEPS, repeats=args.repeats)
        return out
    except Exception as exc:
        return describe_error(exc)
    finally:
        reset_cache(model)
        torch.compiler.reset()


# ---- report ------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def summarize(report: dict, batch_sizes: list[int], padded: list[int]) -> None:
    batches = report.get("batches", {})

    def ms(variant: str, b: int | None) -> float | None:
        return batches.get(str(b), {}).get("ms", {}).get(variant)

    report["ms"] = {
        v: {b: r["ms"][v] for b, r in batches.items() if v in r.get("ms", {})} for v in TIMED
    }
    ratios: dict[str, dict] = {
        f"{RUNNER}/{RAW}": {},
        f"{RUNNER}/{EAGER}": {},
        f"{RAW}/{EAGER}": {},
        "padded_runner/bucket_runner": {},
    }
    for b in batches:
        bi = int(b)
        ratios[f"{RUNNER}/{RAW}"][b] = ratio(ms(RUNNER, bi), ms(RAW, bi))
        ratios[f"{RUNNER}/{EAGER}"][b] = ratio(ms(RUNNER, bi), ms(EAGER, bi))
        ratios[f"{RAW}/{EAGER}"][b] = ratio(ms(RAW, bi), ms(EAGER, bi))
    targets: dict[str, bool | None] = {}
    for b in batch_sizes:
        r = ratios[f"{RUNNER}/{RAW}"].get(str(b))
        targets[f"runner_le_{TARGET_RATIO}x_raw_bs{b}"] = None if r is None else r <= TARGET_RATIO
    for p in padded:
        bucket = batches.get(str(p), {}).get("bucket")
        r = ratio(ms(RUNNER, p), ms(RUNNER, bucket))
        ratios["padded_runner/bucket_runner"][f"{p}->{bucket}"] = r
        key = f"padded_bs{p}_le_{TARGET_RATIO}x_bucket_bs{bucket}"
        targets[key] = None if r is None else r <= TARGET_RATIO
    setup = report.get("setup", {})
    all_pool = setup.get("runner", {}).get("pool_bytes")
    alone_pool = setup.get("runner_largest_alone", {}).get("pool_bytes")
    pool_ratio = ratio(all_pool, alone_pool)
    ratios["pool_all_buckets/pool_largest_alone"] = pool_ratio
    ratios["capture_s_all_buckets/capture_s_largest_alone"] = ratio(
        setup.get("runner", {}).get("capture_s"),
        setup.get("runner_largest_alone", {}).get("capture_s"),
    )
    targets[f"pool_all_buckets_le_{TARGET_POOL_RATIO}x_largest_alone"] = (
        None if pool_ratio is None else pool_ratio <= TARGET_POOL_RATIO
    )
    busy = report.get("kernel_busy", {})
    for variant in TIMED:
        ratios[f"{variant}/kernel_busy"] = {
            b: ratio(ms(variant, int(b)), busy.get(b, {}).get("ms")) for b in batches
        }
    report["ratios"] = ratios
    report["targets"] = targets


def failures(report: dict) -> list[str]:
    failed = [f"setup/{k}" for k, v in report.get("setup", {}).items() if "error" in v]
    for b, r in report.get("batches", {}).items():
        failed += [f"bs{b}/{v}" for v in TIMED if v in r and "error" in r[v]]
        check = r.get("check", {})
        if "error" in check:
            failed.append(f"bs{b}/check")
        elif not check.get("runner_vs_eager", {}).get("within_tol", True):
            failed.append(f"bs{b}: runner logits differ from eager beyond tolerance")
    return failed


# ---- CLI ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=list(BATCH_SIZES))
    p.add_argument(
        "--padded",
        nargs="+",
        type=int,
        default=list(PADDED),
        help="batch sizes that replay on a larger bucket",
    )
    p.add_argument("--iters", type=int, default=ITERS, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=REPEATS, help="windows per round (median)")
    p.add_argument(
        "--rounds", type=int, default=ROUNDS, help="alternating rounds of eager/raw/runner (median)"
    )
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--max-seq", type=int, default=MAX_SEQ)
    p.add_argument("--position", type=int, default=POSITION, help="decode position of every row")
    p.add_argument(
        "--with-compile", action="store_true", help=f"also time {COMPILE_VARIANT} at batch 1 (slow)"
    )
    p.add_argument("--skip-kernel-busy", action="store_true")
    add_common_arguments(p)
    args = p.parse_args(argv)
    sizes = [*args.batch_sizes, *args.padded]
    if any(not 1 <= b <= MAX_BATCH for b in sizes):
        p.error(f"batch sizes must be in 1..{MAX_BATCH}, got {sizes}")
    if not 0 <= args.position < args.max_seq:
        p.error(f"--position {args.position} must be in [0, --max-seq {args.max_seq})")
    return args


def run_all(report: dict, args: argparse.Namespace) -> None:
    cfg = model_config(args)
    setup: dict = {}
    report["setup"] = setup
    t0 = time.perf_counter()
    model = build_model(cfg)
    with torch.no_grad():
        # One eager step at the largest batch first: one-time costs (cuBLAS handles
        # and workspace, lazy inits) then fall on neither runner's capture.
        model(**make_inputs(cfg, MAX_BATCH, args.position, INPUT_SEED))
        reset_cache(model)
        free_memory()
        setup["model"] = {
            "build_s": round(time.perf_counter() - t0, 3),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_cache_bytes": 2 * model.k_cache.numel() * model.k_cache.element_size(),
        }

        log("runner capture, default buckets")
        try:
            runner, setup["runner"] = decode_runner(model, cfg, BucketConfig(), args.position)
        except Exception as exc:
            setup["runner"] = describe_error(exc)
            return
        sizes = set(args.batch_sizes) | set(args.padded)
        for p in args.padded:  # the bucket a padded batch lands on is timed as well
            bucket = runner.select(p)
            if bucket is not None:
                sizes.add(bucket.batch_size)
        report["batches"] = {
            str(b): measure_batch(model, cfg, runner, b, args) for b in sorted(sizes)
        }
        setup["runner"]["stats_after_timing"] = runner.stats()
        runner.close()
        del runner
        free_memory()

        log("runner capture, largest bucket alone")
        try:
            alone, setup["runner_largest_alone"] = decode_runner(
                model, cfg, BucketConfig(batch_sizes=(MAX_BATCH,)), args.position
            )
            alone.close()
            del alone
        except Exception as exc:
            setup["runner_largest_alone"] = describe_error(exc)
        reset_cache(model)
        free_memory()

        if args.with_compile:
            report["compile"] = {"1": measure_compile(model, cfg, args)}
            free_memory()

        # Written once before the profiler too, so a crash there keeps the timings.
        summarize(report, args.batch_sizes, args.padded)
        write_report(NAME, report, args.out, final=False)

        if not args.skip_kernel_busy:
            busy: dict[str, dict] = {}
            for b in sorted(int(k) for k in report["batches"]):
                log(f"kernel_busy batch {b}")
                inputs = make_inputs(cfg, b, args.position, INPUT_SEED + 1000 + b)
                try:
                    busy[str(b)] = {
                        "ms": kernel_busy_ms(lambda i=inputs: model(i["tokens"], i["positions"]))
                    }
                except Exception as exc:
                    busy[str(b)] = describe_error(exc)
            report["kernel_busy"] = busy


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = exit_code_without_gpu(NAME, args.require_gpu)
    if code is not None:
        return code
    started = time.perf_counter()
    report = environment(NAME, args.commit, args.run_label)
    cfg = model_config(args)
    report["settings"] = {
        "model": dataclasses.asdict(cfg),
        "dtype": str(DTYPE).removeprefix("torch."),
        "position": args.position,
        "batch_sizes": args.batch_sizes,
        "padded": args.padded,
        "runner_buckets": list(BucketConfig().batch_sizes),
        "iters": args.iters,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "warmup": WARMUP_STEPS,
        "step_time": "median over rounds of step_time_ms (median over repeats of the mean "
        "wall time of iters back-to-back steps); eager, raw graph and runner alternate "
        "within each round",
        "kernel_busy": "cudagraphs.timing.kernel_busy_ms defaults (iters=20, warmup=5) of "
        "the eager step, after all wall-clock timings",
        "pool_bytes": "torch.cuda.memory_reserved delta across runner.capture, "
        "empty_cache before and after; the all-bucket runner is captured first",
        "check_rel_tol": CHECK_REL_TOL,
        "with_compile": args.with_compile,
    }
    run_all(report, args)
    summarize(report, args.batch_sizes, args.padded)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(NAME, report, args.out, final=True)
    failed = failures(report)
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
