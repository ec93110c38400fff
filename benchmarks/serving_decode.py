"""Serving decode benchmark: one decode step of a Llama-like decoder through
``GraphRunner``, against eager and hand-captured CUDA graphs, in two regimes and two
ways of driving the steps.

Configs (``cudagraphs.models.TinyDecoder`` in bf16, eval mode, under
``torch.no_grad()``, a static KV cache of 64 slots x 256 positions; every row decodes
random tokens at position 128):

* ``launch_bound``: vocab 4096 (small on purpose: the head matmul stays tiny), hidden
  256, 4 heads, 2 KV heads, FFN 704, 2 layers. A step is a few dozen tiny kernels, so
  the host work around the replay is what differs between variants.
* ``default``: vocab 32000, hidden 2048, 16 heads, 4 KV heads, FFN 5632, 16 layers.

Modes:

* ``throughput``: ``iters`` steps back to back, one sync at the end (host work can
  hide behind the GPU queue).
* ``latency``: every step reads its result back, ``logits.argmax(-1).cpu()``, as a
  decode loop does before the next step: nothing hides the host work. Every variant
  does the same read-back.

Batch sizes 1, 8, 32 and the padded sizes 5 and 20 (the runner's buckets 8 and 32).
Variants per batch size ``b`` (all built first, then timed in shuffled interleaved
rounds per mode, :func:`cudagraphs.timing.interleaved_samples_ms`, no GC inside a round):

* ``eager``: ``model(tokens, positions)``.
* ``raw_cuda_graph``: a hand-captured ``torch.cuda.CUDAGraph`` at exactly ``b`` rows
  (side-stream warmup, own pool); a step is two ``copy_`` and ``replay()``.
* ``raw_cuda_graph_at_bucket`` (padded sizes only): a hand-captured graph at the
  runner's bucket; a step copies the ``b`` rows, zeroes the padding rows (one
  ``_foreach_zero_``), replays and slices the logits: the runner's GPU work without
  the runner.
* ``runner``: ``GraphRunner.run({"tokens": t, "positions": p})``, default buckets 1, 2,
  4, ..., 64 captured once per config into one pool.
* ``torch_compile_reduce_overhead`` (``--with-compile``, batch 1 only).

Also recorded, after the wall-clock rounds: host time per call (µs, median over
``--host-calls`` latency-mode calls, variants interleaved per call; ``perf_counter``
around ``runner.run()`` or the raw step alone, the read-back outside it); and, after
everything else (CUPTI may stay attached and slow later launches,
pytorch/pytorch#144455), each variant's own kernel-busy time per latency-mode step
(:func:`cudagraphs.timing.kernel_busy_ms`; the runner at 20 rows runs the bucket-32
graph, so its floor is not raw-at-20's).

Targets (``None`` when not measured; a failing target stays false):

* ``runner_latency_overhead_le_15us`` (``_bs1``, ``_bs8``): launch_bound, latency mode:
  runner median minus raw graph median at the same batch size <= 15 µs. 15 µs is
  what a step's validation, staging, padding, bucket choice and output views may cost
  on the host (single digits) plus the one fused copy launch.
* ``runner_padded_{5,20}_le_1.10x_raw_{5,20}``: default config, latency mode: the
  runner at the padded size (it replays bucket 8 or 32) over the raw graph at exactly
  that size. At 16 layers x hidden 2048 a step streams ~1.7 GB of weights; GEMMs of 20
  and 32 rows are both weight-bandwidth bound, so the bigger bucket costs a few percent
  of GPU time at most, and the runner's host work (<= 15 µs) is ~1% of a step. 10%
  leaves room for that, for a different GEMM tile choice, and for the padding fill.
* ``launch_bound_runner_padded_{5,20}_overhead_le_15us_raw_at_bucket``: launch_bound,
  latency mode: the runner at the padded size minus the raw graph at its bucket
  serving the same rows (same GPU program, same copies) <= 15 µs, the host budget of
  the first target. Against raw at the exact size the launch-bound step's GPU work
  changes too, so that ratio is reported, not targeted.
* ``pool_all_buckets_le_1.3x_largest_alone``: default config: the 7-bucket pool over
  the pool of a runner of bucket 64 alone.
* ``all_buckets_capture_le_2x_largest``: default config: ``capture()`` seconds of the
  7 buckets over those of bucket 64 alone, both in this process after one eager step
  at every bucket's batch size (the same warm state: the first step at a new size
  pays CUDA's first launch of that shape's kernels, reported in
  ``first_eager_step_s``); per-bucket warmup and capture seconds are in
  ``capture_seconds``. A fresh process's startup is ``serving_hf``'s target.

Correctness, before timing, per config and batch size, each from a zeroed KV cache:
the runner's, the raw graph's and the raw-at-bucket graph's logits against eager's
(``within_tol``: max abs diff <= 5e-2 x eager's max |logit|); padded sizes also against
eager on the batch padded as the runner pads it.

Defaults: 7 rounds; 200 steps per round in launch_bound, 50 in default; 10 warmup steps
per variant and mode; 100 host-time calls per variant. About 100 s on an H200.

Prints one JSON object; ``--out`` also writes it (once more before the profiler runs).
Without a CUDA device it says so on stderr and exits 0 (2 with ``--require-gpu``).
Exits 1 after printing when a variant other than torch.compile failed, or a check was
outside the tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
from cudagraphs.timing import (  # noqa: E402
    interleaved_samples_ms,
    kernel_busy_ms,
    quiet_gc,
    summarize,
)

NAME = "serving_decode"
DEVICE = "cuda"
DTYPE = torch.bfloat16
MODEL_SEED = 0
INPUT_SEED = 1234
MAX_BATCH = 64
MAX_SEQ = 256
POSITION = 128
BATCH_SIZES = (1, 8, 32)
PADDED = (5, 20)
CONFIGS = {
    "launch_bound": DecoderConfig(
        vocab=4096, hidden=256, heads=4, kv_heads=2, ffn=704, layers=2, max_seq=MAX_SEQ
    ),
    "default": DecoderConfig(
        vocab=32000, hidden=2048, heads=16, kv_heads=4, ffn=5632, layers=16, max_seq=MAX_SEQ
    ),
}
ITERS = {"launch_bound": 200, "default": 50}
ROUNDS, WARMUP_STEPS, HOST_CALLS = 7, 10, 100
RAW_WARMUP = 3  # side-stream warmup runs before a raw capture
CHECK_REL_TOL = 5e-2  # of eager's max |logit|: other kernels at another shape (padding)
LATENCY_OVERHEAD_US = 15.0
PADDED_RATIO = 1.10
POOL_RATIO = 1.3
CAPTURE_RATIO = 2.0  # all buckets' capture seconds over the largest alone's

EAGER, RAW, RAW_BUCKET, RUNNER = "eager", "raw_cuda_graph", "raw_cuda_graph_at_bucket", "runner"
COMPILE = "torch_compile_reduce_overhead"
MODES = ("throughput", "latency")
HOST_TIMED = (RAW, RAW_BUCKET, RUNNER)


def log(msg: str) -> None:
    print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


# ---- model and inputs ----------------------------------------------------------------


def build_model(cfg: DecoderConfig) -> TinyDecoder:
    """Random weights from ``MODEL_SEED``, made on the GPU, cast to bf16 (KV cache too)."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.manual_seed(MODEL_SEED)
        with torch.device(DEVICE):
            model = TinyDecoder(cfg)
    return model.to(dtype=DTYPE).eval()


def reset_cache(model: TinyDecoder) -> None:
    model.k_cache.zero_()
    model.v_cache.zero_()


def make_inputs(cfg: DecoderConfig, batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch,), generator=gen, device=DEVICE)
    positions = torch.full((batch,), POSITION, dtype=torch.long, device=DEVICE)
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


def logits_from_zero_cache(model: TinyDecoder, step: Callable[[], torch.Tensor]) -> torch.Tensor:
    reset_cache(model)
    out = step().clone()
    torch.cuda.synchronize()
    return out


def read_back(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The latency-mode step: the next tokens reach the host before the step returns."""
    return lambda: step().argmax(-1).cpu()


# ---- variants ------------------------------------------------------------------------


def capture_runner(model: TinyDecoder, cfg: DecoderConfig, config: BucketConfig) -> tuple:
    """A captured runner over the model, with its capture time and pool bytes."""

    def forward(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(tokens, positions)

    rows = config.largest.rows
    specs = [
        InputSpec("tokens", (rows,), torch.long),
        # Padding rows decode token 0 at position 0 in their own cache slots.
        InputSpec("positions", (rows,), torch.long, pad_value=0),
    ]
    runner = GraphRunner(forward, specs, config, device=DEVICE)
    free_memory()
    reserved0 = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    runner.capture(lambda b: make_inputs(cfg, b.rows, INPUT_SEED + b.rows))
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    free_memory()
    stats = runner.stats()
    return runner, {
        "buckets": [b.batch_size for b in config.buckets()],
        "capture_s": round(capture_s, 3),
        "pool_bytes": torch.cuda.memory_reserved() - reserved0,
        "captured": stats["captured"],
        "dropped": stats["dropped"],
        "capture_seconds": stats["capture_seconds"],
    }


def capture_raw(model: TinyDecoder, static: dict) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The PyTorch notes' recipe: warm up on a side stream, then capture (own pool)."""
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
    return graph, logits


def raw_exact(model: TinyDecoder, inputs: dict) -> tuple[Callable[[], torch.Tensor], Callable]:
    """A graph of exactly the batch's rows; the step copies the inputs and replays."""
    static = {k: v.clone() for k, v in inputs.items()}
    graph, logits = capture_raw(model, static)
    pairs = [(static[k], v) for k, v in inputs.items()]

    def step() -> torch.Tensor:
        for dst, src in pairs:
            dst.copy_(src)
        graph.replay()
        return logits

    return step, graph.reset


def raw_at_bucket(
    model: TinyDecoder, inputs: dict, bucket_rows: int
) -> tuple[Callable[[], torch.Tensor], Callable]:
    """A graph at the runner's bucket serving the batch's rows: copy them, zero the
    padding rows (token 0 at position 0, as the runner pads), replay, slice."""
    rows = next(iter(inputs.values())).shape[0]
    static = {k: torch.zeros(bucket_rows, dtype=v.dtype, device=DEVICE) for k, v in inputs.items()}
    for k, v in inputs.items():
        static[k][:rows].copy_(v)
    graph, logits = capture_raw(model, static)
    pairs = [(static[k][:rows], v) for k, v in inputs.items()]
    pads = [s[rows:] for s in static.values()]

    def step() -> torch.Tensor:
        for dst, src in pairs:
            dst.copy_(src)
        torch._foreach_zero_(pads)
        graph.replay()
        return logits[:rows]

    return step, graph.reset


def compiled_step(model: TinyDecoder, inputs: dict) -> Callable[[], torch.Tensor]:
    compiled = torch.compile(model, mode="reduce-overhead")

    def step() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(inputs["tokens"], inputs["positions"])

    for _ in range(3):  # compile, cudagraph-tree warmup, recording
        step()
    torch.cuda.synchronize()
    return step


# ---- one batch size ------------------------------------------------------------------


@dataclass
class Batch:
    """Every variant of one (config, batch size), built before any timing."""

    size: int
    inputs: dict
    bucket_rows: int | None
    steps: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    releases: list[Callable[[], None]] = field(default_factory=list)
    result: dict = field(default_factory=dict)


def build_batch(
    model: TinyDecoder, cfg: DecoderConfig, runner: GraphRunner, b: int, with_compile: bool
) -> Batch:
    inputs = make_inputs(cfg, b, INPUT_SEED + 1000 + b)
    bucket = runner.select(b)
    built = Batch(b, inputs, None if bucket is None else bucket.rows)
    built.result = {"bucket": built.bucket_rows, "setup_s": {}, "errors": {}}
    built.steps[EAGER] = lambda: model(inputs["tokens"], inputs["positions"])
    built.steps[RUNNER] = lambda: runner.run(inputs)
    makers: dict[str, Callable[[], object]] = {RAW: lambda: raw_exact(model, inputs)}
    if built.bucket_rows is not None and built.bucket_rows > b:
        makers[RAW_BUCKET] = lambda: raw_at_bucket(model, inputs, built.bucket_rows)
    if with_compile and b == 1:
        makers[COMPILE] = lambda: (compiled_step(model, inputs), None)
    for name, make in makers.items():
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step, release = make()
            built.result["setup_s"][name] = round(time.perf_counter() - t0, 3)
            built.steps[name] = step
            if release is not None:
                built.releases.append(release)
        except Exception as exc:
            built.result["errors"][name] = describe_error(exc)
    return built


def check_batch(model: TinyDecoder, built: Batch) -> dict:
    """Every graphed variant's logits against eager's, each from a zeroed KV cache."""
    tokens, positions = built.inputs["tokens"], built.inputs["positions"]
    want = logits_from_zero_cache(model, lambda: model(tokens, positions))
    out = {}
    for name, step in built.steps.items():
        if name != EAGER:
            out[f"{name}_vs_eager"] = compare(logits_from_zero_cache(model, step), want)
    if built.bucket_rows is not None and built.bucket_rows > built.size:
        pad = built.bucket_rows - built.size
        padded_t = torch.cat([tokens, tokens.new_zeros(pad)])
        padded_p = torch.cat([positions, positions.new_zeros(pad)])
        want_padded = logits_from_zero_cache(model, lambda: model(padded_t, padded_p)[: built.size])
        got = logits_from_zero_cache(model, built.steps[RUNNER])
        out["runner_vs_eager_padded_to_bucket"] = compare(got, want_padded)
    reset_cache(model)
    return out


def time_batch(built: Batch, iters: int, rounds: int) -> None:
    """Wall-clock time of every variant, per mode, in shuffled interleaved rounds."""
    built.result["modes"] = {}
    for mode in MODES:
        steps = (
            built.steps
            if mode == "throughput"
            else {name: read_back(step) for name, step in built.steps.items()}
        )
        try:
            samples = interleaved_samples_ms(
                steps,
                iters=iters,
                warmup=WARMUP_STEPS,
                repeats=rounds,
                shuffle_seed=built.size * 10 + len(mode),
            )
            built.result["modes"][mode] = {n: summarize(s, digits=5) for n, s in samples.items()}
        except Exception as exc:
            built.result["errors"][f"timing_{mode}"] = describe_error(exc)


def host_times(built: Batch, calls: int) -> None:
    """Host µs per call of the runner and the raw steps, latency mode: the GPU is idle
    when each call starts, the read-back (a sync) follows outside the timed span."""
    names = [n for n in HOST_TIMED if n in built.steps]
    samples: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(built.size)
    with quiet_gc():
        for _ in range(calls):
            rng.shuffle(names)
            for name in names:
                step = built.steps[name]
                t0 = time.perf_counter_ns()
                out = step()
                t1 = time.perf_counter_ns()
                out.argmax(-1).cpu()
                samples[name].append((t1 - t0) / 1e3)
    built.result["host_us_per_call"] = {
        n: {
            "median": round(statistics.median(s), 2),
            "min": round(min(s), 2),
            "max": round(max(s), 2),
            "calls": len(s),
        }
        for n, s in samples.items()
        if s
    }


def kernel_busy(built: Batch) -> None:
    """Each variant's own kernel-busy time per latency-mode step (the profiler, last)."""
    busy: dict[str, float | dict] = {}
    for name, step in built.steps.items():
        try:
            busy[name] = round(kernel_busy_ms(read_back(step)), 5)
        except Exception as exc:
            busy[name] = describe_error(exc)
    built.result["kernel_busy_ms"] = busy


# ---- one config ----------------------------------------------------------------------


@dataclass
class Config:
    """A config's model, runner and batches, kept alive until the profiler is done."""

    name: str
    model: TinyDecoder
    runner: GraphRunner | None
    batches: list[Batch]
    result: dict

    def release(self) -> None:
        for built in self.batches:
            for release in built.releases:
                release()
        if self.runner is not None:
            self.runner.close()


def setup_config(name: str, args: argparse.Namespace, sizes: list[int]) -> Config:
    """Model, runner (and, for ``default``, a runner of the largest bucket alone for
    the pool comparison), then every variant of every batch size, checked."""
    cfg = CONFIGS[name]
    log(f"{name}: build")
    t0 = time.perf_counter()
    model = build_model(cfg)
    build_s = time.perf_counter() - t0
    # One eager step at every bucket's batch size first, largest first: one-time costs
    # of each shape (cuBLAS handles and workspace, kernels CUDA loads at their first
    # launch, lazy inits) then fall on no capture, so both runners below are captured
    # in the same warm state and their capture times compare the runners' own work.
    # Each first step's host seconds are reported (``first_eager_step_s``).
    first_steps = {}
    for rows in sorted({b.rows for b in BucketConfig().buckets()} | {MAX_BATCH}, reverse=True):
        start = time.perf_counter()
        model(**make_inputs(cfg, rows, INPUT_SEED))
        torch.cuda.synchronize()
        first_steps[rows] = round(time.perf_counter() - start, 4)
        reset_cache(model)
    result: dict = {
        "model": {
            **dataclasses.asdict(cfg),
            "build_s": round(build_s, 3),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        },
        "first_eager_step_s": first_steps,
        "iters": args.iters or ITERS[name],
        "batches": {},
    }
    config = Config(name, model, None, [], result)
    try:
        config.runner, result["runner"] = capture_runner(model, cfg, BucketConfig())
    except Exception as exc:
        result["runner"] = describe_error(exc)
        return config
    if name == "default":
        try:
            alone, result["runner_largest_alone"] = capture_runner(
                model, cfg, BucketConfig(batch_sizes=(MAX_BATCH,))
            )
            alone.close()
        except Exception as exc:
            result["runner_largest_alone"] = describe_error(exc)
        free_memory()
    for b in sizes:
        log(f"{name}: batch {b}: build and check")
        built = build_batch(model, cfg, config.runner, b, args.with_compile)
        try:
            built.result["check"] = check_batch(model, built)
        except Exception as exc:
            built.result["check"] = describe_error(exc)
        result["batches"][str(b)] = built.result
        config.batches.append(built)
    return config


def time_config(config: Config, args: argparse.Namespace) -> None:
    for built in config.batches:
        log(f"{config.name}: batch {built.size}: timing")
        time_batch(built, config.result["iters"], args.rounds)
        try:
            host_times(built, args.host_calls)
        except Exception as exc:
            built.result["errors"]["host_times"] = describe_error(exc)
        reset_cache(config.model)
    if config.runner is not None:
        config.result["runner"]["stats_after_timing"] = config.runner.stats()


# ---- ratios and targets (pure: tested on the CPU) ------------------------------------


def _median(batch: dict, mode: str, variant: str) -> float | None:
    return batch.get("modes", {}).get(mode, {}).get(variant, {}).get("median")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _minus_us(a: float | None, b: float | None) -> float | None:
    return round((a - b) * 1e3, 2) if a is not None and b is not None else None


def batch_ratios(batch: dict) -> dict:
    """Per mode: the runner against each baseline (same batch size, same mode, timed in
    the same interleaved rounds), and each variant over its own kernel-busy floor."""
    busy = batch.get("kernel_busy_ms", {})
    out: dict = {}
    for mode in MODES:
        runner, raw = _median(batch, mode, RUNNER), _median(batch, mode, RAW)
        at_bucket, eager = _median(batch, mode, RAW_BUCKET), _median(batch, mode, EAGER)
        r = {
            "runner_minus_raw_us": _minus_us(runner, raw),
            f"{RUNNER}/{RAW}": _ratio(runner, raw),
            f"{RUNNER}/{EAGER}": _ratio(runner, eager),
            f"{RAW}/{EAGER}": _ratio(raw, eager),
        }
        if at_bucket is not None:
            r["runner_minus_raw_at_bucket_us"] = _minus_us(runner, at_bucket)
            r[f"{RUNNER}/{RAW_BUCKET}"] = _ratio(runner, at_bucket)
            r[f"{RAW_BUCKET}/{RAW}"] = _ratio(at_bucket, raw)
        for variant in batch.get("modes", {}).get(mode, {}):
            floor = busy.get(variant)
            if isinstance(floor, (int, float)):
                r[f"{variant}/kernel_busy({variant})"] = _ratio(
                    _median(batch, mode, variant), floor
                )
        out[mode] = r
    return out


def compute_targets(configs: dict, latency_batches=(1, 8), padded=PADDED) -> dict:
    """The targets from the configs' results (``None``: not measured)."""

    def batch(config: str, b: int) -> dict:
        return configs.get(config, {}).get("batches", {}).get(str(b), {})

    def at_most(value: float | None, limit: float) -> bool | None:
        return None if value is None else value <= limit

    targets: dict[str, bool | None] = {}
    name = f"runner_latency_overhead_le_{LATENCY_OVERHEAD_US:g}us"
    for b in latency_batches:
        bb = batch("launch_bound", b)
        over = _minus_us(_median(bb, "latency", RUNNER), _median(bb, "latency", RAW))
        targets[f"{name}_bs{b}"] = at_most(over, LATENCY_OVERHEAD_US)
    each = [targets[f"{name}_bs{b}"] for b in latency_batches]
    targets[name] = None if None in each else all(each)
    for p in padded:
        bb = batch("default", p)
        r = _ratio(_median(bb, "latency", RUNNER), _median(bb, "latency", RAW))
        targets[f"runner_padded_{p}_le_{PADDED_RATIO:.2f}x_raw_{p}"] = at_most(r, PADDED_RATIO)
        bb = batch("launch_bound", p)
        over = _minus_us(_median(bb, "latency", RUNNER), _median(bb, "latency", RAW_BUCKET))
        key = f"launch_bound_runner_padded_{p}_overhead_le_{LATENCY_OVERHEAD_US:g}us_raw_at_bucket"
        targets[key] = at_most(over, LATENCY_OVERHEAD_US)
    default = configs.get("default", {})
    pool = _ratio(
        default.get("runner", {}).get("pool_bytes"),
        default.get("runner_largest_alone", {}).get("pool_bytes"),
    )
    targets[f"pool_all_buckets_le_{POOL_RATIO}x_largest_alone"] = at_most(pool, POOL_RATIO)
    took = _ratio(
        default.get("runner", {}).get("capture_s"),
        default.get("runner_largest_alone", {}).get("capture_s"),
    )
    targets["all_buckets_capture_le_2x_largest"] = at_most(took, CAPTURE_RATIO)
    return targets


def derive(report: dict, padded=PADDED) -> None:
    """``ratios`` (config -> batch size -> mode -> name -> value) and ``targets``."""
    configs = report.get("configs", {})
    report["ratios"] = {
        name: {b: batch_ratios(r) for b, r in config.get("batches", {}).items()}
        for name, config in configs.items()
    }
    default = configs.get("default", {})
    report["ratios"]["pool_all_buckets/pool_largest_alone"] = _ratio(
        default.get("runner", {}).get("pool_bytes"),
        default.get("runner_largest_alone", {}).get("pool_bytes"),
    )
    report["targets"] = compute_targets(configs, padded=padded)


def failures(report: dict) -> list[str]:
    """What makes the script exit 1: a failed setup, variant, timing or check (the
    optional torch.compile variant excepted)."""
    failed = []
    for name, config in report.get("configs", {}).items():
        failed += [
            f"{name}/{k}"
            for k in ("runner", "runner_largest_alone")
            if "error" in config.get(k, {})
        ]
        for b, r in config.get("batches", {}).items():
            failed += [f"{name}/bs{b}/{k}" for k in r.get("errors", {}) if k != COMPILE]
            check = r.get("check", {})
            if "error" in check:
                failed.append(f"{name}/bs{b}/check")
                continue
            for k, v in check.items():
                if not k.startswith(COMPILE) and not v.get("within_tol", True):
                    failed.append(f"{name}/bs{b}: {k} beyond tolerance")
    return failed


# ---- CLI -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=list(BATCH_SIZES))
    p.add_argument(
        "--padded", nargs="+", type=int, default=list(PADDED), help="sizes that pad a bucket"
    )
    p.add_argument(
        "--iters", type=int, default=None, help=f"steps per round (default per config: {ITERS})"
    )
    p.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds per mode")
    p.add_argument("--host-calls", type=int, default=HOST_CALLS, help="host-timed calls")
    p.add_argument("--with-compile", action="store_true", help=f"also time {COMPILE} at batch 1")
    p.add_argument("--skip-kernel-busy", action="store_true")
    add_common_arguments(p)
    args = p.parse_args(argv)
    sizes = [*args.batch_sizes, *args.padded]
    if any(not 1 <= b <= MAX_BATCH for b in sizes):
        p.error(f"batch sizes must be in 1..{MAX_BATCH}, got {sizes}")
    if min(args.rounds, args.host_calls, args.iters or 1) < 1:
        p.error("--iters, --rounds and --host-calls must be >= 1")
    return args


def settings(args: argparse.Namespace) -> dict:
    return {
        "configs": args.configs,
        "dtype": str(DTYPE).removeprefix("torch."),
        "position": POSITION,
        "batch_sizes": args.batch_sizes,
        "padded": args.padded,
        "runner_buckets": list(BucketConfig().batch_sizes),
        "iters": {name: args.iters or ITERS[name] for name in args.configs},
        "rounds": args.rounds,
        "warmup": WARMUP_STEPS,
        "host_calls": args.host_calls,
        "modes": {
            "throughput": "iters steps back to back, one sync at the end",
            "latency": "every step ends with logits.argmax(-1).cpu() (all variants)",
        },
        "step_time": "ms per step; per mode, median and min-max over rounds of "
        "interleaved_samples_ms (each round: every variant once, shuffled order, "
        "iters steps, GC off)",
        "host_us_per_call": "perf_counter_ns around runner.run() or the raw step alone, "
        "latency mode (GPU idle at the call), variants interleaved per call",
        "kernel_busy": "kernel_busy_ms (iters=20, warmup=5) of each variant's own "
        "latency-mode step, after all wall-clock timing; ratios 'X/kernel_busy(X)' use "
        "X's own floor",
        "pool_bytes": "torch.cuda.memory_reserved delta across runner.capture, "
        "empty_cache before and after (default config: all buckets first, then 64 alone)",
        "check_rel_tol": CHECK_REL_TOL,
        "with_compile": args.with_compile,
    }


def run_all(report: dict, args: argparse.Namespace) -> None:
    sizes = sorted(set(args.batch_sizes) | set(args.padded))
    report["configs"] = {}
    configs: list[Config] = []
    try:
        with torch.no_grad():
            for name in args.configs:
                config = setup_config(name, args, sizes)
                report["configs"][name] = config.result
                configs.append(config)
            for config in configs:
                time_config(config, args)
            # Written once before the profiler too, so a crash there keeps the timings.
            derive(report, args.padded)
            write_report(NAME, report, args.out, final=False)
            if not args.skip_kernel_busy:
                for config in configs:
                    for built in config.batches:
                        log(f"{config.name}: batch {built.size}: kernel busy")
                        kernel_busy(built)
    finally:
        for config in configs:
            config.release()
        torch.compiler.reset()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = exit_code_without_gpu(NAME, args.require_gpu)
    if code is not None:
        return code
    started = time.perf_counter()
    report = environment(NAME, args.commit, args.run_label)
    report["settings"] = settings(args)
    run_all(report, args)
    derive(report, args.padded)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(NAME, report, args.out, final=True)
    failed = failures(report)
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
