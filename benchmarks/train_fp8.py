"""FP8 training inside our graphs: torchao's float8 (``convert_to_float8_training``,
dynamic tensorwise and rowwise scaling) against bf16, every variant a whole
``graph_train_step`` (forward, backward, fused AdamW in one graph), on a compute-bound
stack where FP8 tensor cores pay: 4 blocks of hidden 4096, 4 sequences of 2048 tokens a
step (``--batch`` sets the sequences).

Variants, built first, then timed in interleaved shuffled rounds, profiled last:

* ``eager_bf16``: the eager step with the same fused AdamW (the reference);
* ``graphed_bf16`` / ``graphed_bf16_compiled``: the bf16 step graphed, with eager
  kernels / over the ``torch.compile``d stack (``mode="default"``);
* ``graphed_fp8_<recipe>`` / ``graphed_fp8_<recipe>_compiled``: the stack converted
  by torchao, graphed, with torchao's eager kernels / compiled (torchao's own advice:
  compile fuses its scaling and casting kernels);
* ``eager_fp8_<recipe>_compiled``: torchao's recommended path without a graph.

Targets (``targets``):

* ``fp8_step_le_0.8x_bf16_step``: the faster graphed, compiled FP8 recipe against the
  graphed, compiled bf16 step (like for like: both graphed, both compiled);
  ``fp8_<recipe>_step_le_0.8x_bf16_step`` per recipe;
* ``fp8_<recipe>_loss_200_steps_sqnr_ge_25db``: the loss curve of 200 graphed,
  compiled FP8 steps against bf16's from the same weights and data, at ``LOSS_LR``
  (``--loss-lr``; a tenth of the timed steps' rate, where bf16 repeats itself), as a
  signal-to-quantization-noise ratio in dB (the bound torchao's tests hold float8
  e4m3 layers' outputs to against high precision is 25 dB). ``loss_sqnr_db`` also
  holds ``bf16_repeat``: bf16 against a second bf16 run, the floor that run-to-run
  variation sets (a trajectory with loss spikes does not repeat; no recipe's SQNR
  can be read above it).

Bit-for-bit equality of each graphed FP8 step with torchao's eager one is a GPU test
(``tests/train/test_cuda_train_fp8.py``), not repeated here. torchao is an optional
extra (``pip install 'cudagraphs[torchao]'``); without it the benchmark says so and
exits.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

import _report  # noqa: F401  (first: puts this checkout's src on sys.path)
import cudagraphs
from _checks import fresh_kernel_busy, launch_gaps_us, ratio
from _report import (
    add_common_arguments,
    add_round_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    kernel_busy_method,
    step_time_method,
    timed_setup,
    write_report,
)
from cudagraphs.models import BlockConfig, make_block_stack
from cudagraphs.timing import interleaved_samples_ms, summarize
from cudagraphs.train import prepare_optimizer

NAME = "train_fp8"
DEVICE, DTYPE = "cuda", torch.bfloat16
LAYERS, BATCH, SEQ = 4, 4, 2048
# BATCH: 8192 tokens a step, so that the step is compute-bound as a whole. At one
# sequence (2048 tokens) the fused AdamW step over the stack's 805M parameters (5.1 to
# 5.3 ms, memory-bound, which float8 does not touch) is a quarter of the bf16 step and
# caps what float8 can gain: 0.86x to 0.89x there on the H200 (docs/train-step.md).
BLOCK = BlockConfig(4096, 32, 16384)  # every GEMM dimension a multiple of 16 (FP8)
LR = 1e-4  # the timed steps
# The loss check's learning rate. At LR the trajectory is chaotic: two bf16 runs of the
# same code agree to only 28.7 dB, so no recipe can be read against 25 dB there. At a
# tenth of it they agree to 115 dB, and the SQNR measures the recipe
# (probe-fp8_loss_regime).
LOSS_LR = 1e-5
ITERS, REPEATS, WARMUP = 5, 7, 3
KERNEL_BUSY_ITERS, KERNEL_BUSY_WARMUP = 5, 2
SHUFFLE_SEED = 0
LOSS_STEPS, DATA_BATCHES = 200, 8
SQNR_TARGET_DB = 25.0
RATIO_TARGET = 0.8
RECIPES = ("tensorwise", "rowwise")
BF16 = "graphed_bf16_compiled"
REPEAT = "bf16_repeat"  # the bf16 loss curve run twice: the SQNR's run-to-run floor
EAGER = "eager_bf16"


@dataclass(frozen=True)
class Variant:
    """One way to run the step: FP8 recipe (``None``: bf16), compiled, graphed."""

    name: str
    recipe: str | None
    compiled: bool
    graphed: bool


def variants(recipes: Sequence[str] = RECIPES) -> list[Variant]:
    """Every variant, references first."""
    out = [
        Variant(EAGER, None, False, False),
        Variant("graphed_bf16", None, False, True),
        Variant(BF16, None, True, True),
    ]
    for r in recipes:
        out += [
            Variant(f"graphed_fp8_{r}", r, False, True),
            Variant(f"graphed_fp8_{r}_compiled", r, True, True),
            Variant(f"eager_fp8_{r}_compiled", r, True, False),
        ]
    return out


# ---- pure logic (tested on the CPU) --------------------------------------------------


def sqnr_db(reference: Sequence[float], got: Sequence[float]) -> float | None:
    """``20 log10(||reference|| / ||reference - got||)`` in dB; ``inf`` when equal,
    ``None`` when the lengths differ, either is empty, or a value is not finite."""
    if not reference or len(reference) != len(got):
        return None
    if not all(math.isfinite(v) for v in (*reference, *got)):
        return None
    signal = math.sqrt(sum(r * r for r in reference))
    noise = math.sqrt(sum((r - g) ** 2 for r, g in zip(reference, got)))
    if noise == 0:
        return math.inf
    return round(20 * math.log10(signal / noise), 3) if signal else None


def compute_targets(
    ms: dict[str, float], sqnr: dict[str, float | None], recipes: Sequence[str] = RECIPES
) -> dict[str, bool | None]:
    """The targets from median step times and loss-curve SQNRs; ``None`` where a
    number is missing."""
    targets: dict[str, bool | None] = {}
    per_recipe = {}
    for r in recipes:
        rel = ratio(ms.get(f"graphed_fp8_{r}_compiled"), ms.get(BF16))
        per_recipe[r] = rel
        targets[f"fp8_{r}_step_le_0.8x_bf16_step"] = None if rel is None else rel <= RATIO_TARGET
        db = sqnr.get(r)
        targets[f"fp8_{r}_loss_200_steps_sqnr_ge_25db"] = (
            None if db is None else db >= SQNR_TARGET_DB
        )
    known = [v for v in per_recipe.values() if v is not None]
    targets["fp8_step_le_0.8x_bf16_step"] = min(known) <= RATIO_TARGET if known else None
    return targets


# ---- building the variants -----------------------------------------------------------


@dataclass
class Built:
    step: Callable[[], object]
    setup_s: float
    notes: dict = field(default_factory=dict)
    release: Callable[[], None] = field(default=lambda: None)


def make_model(recipe: str | None, seed: int = 0) -> nn.Module:
    blocks = make_block_stack(LAYERS, BLOCK, device=DEVICE, dtype=DTYPE, seed=seed)
    model = nn.Sequential(*blocks).train()
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model


def make_data(
    n: int = DATA_BATCHES, batch: int = BATCH, device: str = DEVICE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed batches of ``batch`` sequences and their targets: each target the
    input rolled by one feature, a mapping the stack can learn."""
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (batch, SEQ, BLOCK.hidden)
    xs = [torch.randn(shape, generator=gen, device=device, dtype=DTYPE) for _ in range(n)]
    return [(x, x.roll(1, dims=-1)) for x in xs]


def build(v: Variant, data: list[tuple[torch.Tensor, torch.Tensor]], lr: float = LR) -> Built:
    """The variant's step on ``data[0]`` (a fresh model, AdamW at ``lr``), ready to time."""
    model = make_model(v.recipe)
    forward = torch.compile(model) if v.compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y = data[0]

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inp, target = batch
        loss = (forward(inp).float() - target.float()).pow(2).mean()
        loss.backward()
        return loss

    def release() -> None:
        if v.compiled:
            torch.compiler.reset()

    if v.graphed:
        graphed, setup_s = timed_setup(
            # "fused" also for the compiled variants ("auto" would compile their
            # optimizer step): the eager variants run the same fused AdamW.
            lambda: cudagraphs.graph_train_step(
                step_fn, (x, y), optimizer=opt, optimizer_impl="fused"
            )
        )
        notes = {"optimizer": "; ".join(graphed.stats.optimizer_changes)}
        if v.compiled:
            notes["compile_seconds"] = round(graphed.stats.compile_seconds, 2)

        def run_graphed(inp: torch.Tensor = x, target: torch.Tensor = y) -> torch.Tensor:
            return graphed((inp, target))

        return Built(run_graphed, setup_s, notes, lambda: (graphed.reset(), release()))
    prepare_optimizer(opt, "fused")  # the fused AdamW the graphed steps get

    def run_eager(inp: torch.Tensor = x, target: torch.Tensor = y) -> torch.Tensor:
        loss = step_fn((inp, target))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def warm() -> None:
        for _ in range(WARMUP):
            run_eager()

    _, setup_s = timed_setup(warm)
    return Built(run_eager, setup_s, {"optimizer": "fused AdamW, eager"}, release)


def loss_curve(
    v: Variant, data: list[tuple[torch.Tensor, torch.Tensor]], lr: float = LOSS_LR
) -> list[float]:
    """The losses of ``LOSS_STEPS`` steps of ``v`` from the seed's weights at ``lr``,
    cycling through ``data``."""
    built = build(v, data, lr)
    try:
        # float() each step: a graphed step's loss is a static output, overwritten by
        # the next replay.
        return [float(built.step(*data[i % len(data)])) for i in range(LOSS_STEPS)]
    finally:
        built.release()
        free_memory()


# ---- the run -------------------------------------------------------------------------


def run(names: Sequence[Variant], args: argparse.Namespace, report: dict) -> None:
    data = make_data(batch=args.batch)
    results: dict[str, dict] = {}
    built: dict[str, Built] = {}
    for v in names:
        print(f"{NAME}: build {v.name}", file=sys.stderr)
        try:
            b = build(v, data)
        except Exception as exc:
            results[v.name] = describe_error(exc)
            continue
        built[v.name] = b
        results[v.name] = {"setup_s": round(b.setup_s, 3), **b.notes}
    samples = interleaved_samples_ms(
        {n: b.step for n, b in built.items()},
        iters=args.iters or ITERS,
        repeats=args.repeats or REPEATS,
        warmup=WARMUP,
        shuffle_seed=SHUFFLE_SEED,
    )
    for n, s in samples.items():
        results[n]["ms"] = summarize(s)
    for b in built.values():
        b.release()
    built.clear()
    free_memory()
    report["variants"] = results
    ms = {n: r["ms"]["median"] for n, r in results.items() if "ms" in r}
    report["ms"] = ms
    # The step times before the loss check's compiles and 200-step runs: a call cut
    # short by its time limit still returns them.
    write_report(NAME, report, args.out, final=False)
    curves: dict[str, list[float]] = {}
    sqnr: dict[str, float | None] = {}
    for v in [x for x in names if x.compiled and x.graphed]:
        try:
            curves[v.recipe or "bf16"] = loss_curve(v, data, args.loss_lr)
        except Exception as exc:
            results[v.name]["loss_curve_error"] = describe_error(exc)["error"]
    for r in {v.recipe for v in names if v.recipe}:
        sqnr[r] = sqnr_db(curves.get("bf16", []), curves.get(r, []))
    # The run-to-run floor: bf16 against a second bf16 run of the same code. Where the
    # trajectory does not repeat (spikes; kernels whose rounding varies by run), a
    # recipe's SQNR cannot exceed it (probe-fp8_rowwise_curves).
    bf16 = next((v for v in names if v.name == BF16), None)
    if bf16 is not None and "bf16" in curves:
        try:
            curves[REPEAT] = loss_curve(bf16, data, args.loss_lr)
            sqnr[REPEAT] = sqnr_db(curves["bf16"], curves[REPEAT])
        except Exception as exc:
            results[BF16]["loss_curve_repeat_error"] = describe_error(exc)["error"]
    report["loss_curves"] = {
        k: {"first": c[:3], "last": c[-3:], "steps": len(c)} for k, c in curves.items()
    }
    report["loss_sqnr_db"] = sqnr
    recipes = sorted({v.recipe for v in names if v.recipe})
    report["targets"] = compute_targets(ms, sqnr, recipes)
    write_report(NAME, report, args.out, final=False)
    if args.skip_kernel_busy:
        return
    busy, launches = {}, {}
    for v in names:
        if v.name not in ms:
            continue
        got = fresh_kernel_busy(
            lambda v=v: build(v, data),
            lambda b: b.release(),
            iters=KERNEL_BUSY_ITERS,
            warmup=KERNEL_BUSY_WARMUP,
        )
        results[v.name].update(got)
        if "kernel_busy_ms" in got:
            busy[v.name], launches[v.name] = got["kernel_busy_ms"], got["kernels_per_step"]
    report["kernel_busy_ms"], report["kernels_per_step"] = busy, launches
    report["launch_gap_us"] = launch_gaps_us(ms, busy, launches)
    report["ratios"] = {
        **{f"{n}/{EAGER}": ratio(ms.get(n), ms.get(EAGER)) for n in ms if n != EAGER},
        **{f"{n}/{BF16}": ratio(ms.get(n), ms.get(BF16)) for n in ms if n != BF16},
        **{f"{n}/kernel_busy_own": ratio(ms.get(n), busy.get(n)) for n in ms},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    p.add_argument("--loss-lr", type=float, default=LOSS_LR, help="the loss check's learning rate")
    p.add_argument(
        "--batch",
        type=int,
        default=BATCH,
        help="sequences per step (tokens per step: batch x 2048); the optimizer step's "
        "share of the step shrinks as it grows",
    )
    add_round_arguments(p)
    add_common_arguments(p)
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch takes a positive number of sequences; got {args.batch}")
    code = exit_code_without_gpu(NAME, args.require_gpu)
    if code is not None:
        return code
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        print(f"{NAME}: torchao is not installed (pip install 'cudagraphs[torchao]')")
        return 2 if args.require_gpu else 0
    if torch.cuda.get_device_capability() < (8, 9):
        print(f"{NAME}: FP8 tensor cores need compute capability 8.9 or newer")
        return 2 if args.require_gpu else 0
    started = time.perf_counter()
    report = environment(NAME, args.commit, args.run_label)
    report["settings"] = {
        "model": f"{LAYERS} PreNormBlocks, hidden {BLOCK.hidden}, heads {BLOCK.heads}, "
        f"ffn {BLOCK.ffn}, batch {args.batch}, seq {SEQ}, bf16 weights",
        "loss": "mean squared error against the input rolled by one feature",
        "optimizer": f"AdamW(lr={LR}), fused (graph_train_step's; the eager ones alike)",
        "step_time": step_time_method(SHUFFLE_SEED),
        "kernel_busy": kernel_busy_method(KERNEL_BUSY_ITERS, KERNEL_BUSY_WARMUP),
        "loss_check": f"{LOSS_STEPS} graphed compiled steps per recipe and bf16 from the "
        f"same weights over {DATA_BATCHES} fixed batches, AdamW(lr={args.loss_lr}); SQNR "
        "of the loss curves in dB",
    }
    run(variants(args.recipes), args, report)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(NAME, report, args.out, final=True)
    failed = [n for n, r in report["variants"].items() if "error" in r]
    if failed:
        print(f"{NAME}: failed variants: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
