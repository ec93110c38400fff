"""Trainer benchmark: ``transformers.Trainer`` training HF Llama and Qwen3-MoE with and
without ``PartialGraphsCallback`` (the one-line use), in the launch-bound regime of
``partial_train.py`` (8 layers, hidden 512, batch 1, seq 128; SDPA).

Regime ``trainer``: what a user's run does. Weights in fp32 with ``bf16=True``
(autocast, as Trainer's mixed precision runs), the model's own causal-LM loss on
``labels``, Trainer's default optimizer (recorded in the report), gradient
accumulation ``--accumulation`` (1 by default), ``zero_grad`` by Trainer after each
optimizer step. Variants:

* ``eager``: the Trainer as built.
* ``callback``: the same Trainer with ``callbacks=[PartialGraphsCallback()]``: it
  records optimizer step 1, captures at its end and replays from step 2 on.

Method. Both variants' Trainers are built first, from models with the same weights
and the same data order. A round runs ``trainer.train()`` of ``--steps`` optimizer
steps for each variant, in a seeded shuffled order; a step's time is the wall time
from ``on_step_begin`` to ``on_step_end`` with the device synchronized at both (so
one step's work is not counted in the next). A round's sample is the median step
time over the steps after the first ``SKIP_STEPS`` (the recorded step, the capture
and the first replays); ``summarize`` gives median, min and max over rounds. The run's
wall time (``train_s``: capture included) is reported per round too. Check: the
first round's logged losses of ``callback`` against ``eager``'s (same weights, data
and kernels: expected equal; a relative difference above ``LOSS_REL_TOL`` fails the
run). Last, after all wall-clock timing, one more run per variant under the profiler
gives each variant's own kernel-busy time per steady-state step.

Prints one JSON object; ``--out`` also writes it. Without a CUDA device it says so on
stderr and exits 0 (2 with ``--require-gpu``). Exits 1 after printing when a variant
failed or the check did not hold.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch  # noqa: E402

from _report import (  # noqa: E402
    add_common_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    write_report,
)
from cudagraphs.timing import profile_busy_ms, quiet_gc, summarize  # noqa: E402
from partial_train import CONFIGS, MODELS, Shape, hf_config  # noqa: E402

try:  # Trainer calls every event on a callback: derive from its base class
    from transformers import TrainerCallback
except ImportError:  # main() says what is missing; the helpers below still import
    TrainerCallback = object

NAME = "trainer_callback"
VARIANTS = ("eager", "callback")
MODEL_SEED, DATA_SEED, SHUFFLE_SEED = 0, 1234, 0
STEPS, ROUNDS, SKIP_STEPS, PROFILE_STEPS = 40, 5, 5, 10
LOSS_REL_TOL = 1e-3


@dataclass
class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, the device synchronized at its start and end."""

    synchronize: Any = None
    ms: list[float] = field(default_factory=list)
    _start: float = 0.0

    def _sync(self) -> None:
        (self.synchronize or torch.cuda.synchronize)()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self.ms.append((time.perf_counter() - self._start) * 1e3)


@dataclass
class StepProfiler(TrainerCallback):
    """The profiler around steps ``first`` to ``first + count - 1`` (1-based) of a run;
    ``busy_ms`` is the kernel-busy time per profiled step."""

    first: int
    count: int
    busy_ms: float | None = None
    _prof: Any = None
    _step: int = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step += 1
        if self._step == self.first:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._prof is not None and self._step == self.first + self.count - 1:
            torch.cuda.synchronize()
            self._prof.stop()
            self.busy_ms = profile_busy_ms(self._prof) / self.count
            self._prof = None


@dataclass
class Built:
    """One variant: its Trainer, its step timer, and the callback (``callback`` only)."""

    trainer: Any
    timer: StepTimer
    callback: Any = None


def dataset(shape: Shape, rows: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(0, shape.vocab, (rows, shape.seq), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def build(
    variant: str,
    model: str,
    shape: Shape,
    *,
    steps: int,
    accumulation: int,
    out_dir: str,
    use_cpu: bool = False,
    capture_backend: Any = None,
    synchronize: Any = None,
) -> Built:
    """A Trainer for ``variant``; the same weights (``MODEL_SEED``) and data order
    (``DATA_SEED``) for every variant. ``use_cpu`` / ``capture_backend`` /
    ``synchronize`` let the CPU tests run this wiring without a GPU."""
    import transformers

    from cudagraphs.integrations.hf import PartialGraphsCallback

    torch.manual_seed(MODEL_SEED)
    net = transformers.AutoModelForCausalLM.from_config(
        hf_config(model, shape), attn_implementation="sdpa"
    )
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        use_cpu=use_cpu,
        bf16=not use_cpu,
        report_to=[],
        max_steps=steps,
        per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = StepTimer(synchronize)
    callback = None
    callbacks: list[Any] = [timer]
    if variant == "callback":
        callback = PartialGraphsCallback(capture_backend=capture_backend)
        callbacks.insert(0, callback)
    rows = steps * accumulation * shape.batch
    trainer = transformers.Trainer(
        model=net, args=args, train_dataset=dataset(shape, rows), callbacks=callbacks
    )
    return Built(trainer, timer, callback)


def run_once(built: Built) -> dict:
    """One ``train()``: per-step times, wall time, and the logged losses."""
    built.timer.ms = []
    history_from = len(built.trainer.state.log_history)
    t0 = time.perf_counter()
    built.trainer.train()
    train_s = time.perf_counter() - t0
    logged = built.trainer.state.log_history[history_from:]
    return {
        "step_ms": list(built.timer.ms),
        "train_s": train_s,
        "losses": [h["loss"] for h in logged if "loss" in h],
    }


def steady_median(step_ms: list[float], skip: int) -> float:
    """The median step time after the first ``skip`` steps (recording, capture, first
    replays); all steps when the run is not longer than ``skip``."""
    steady = step_ms[skip:] or step_ms
    return statistics.median(steady)


def compare_losses(got: list[float], want: list[float]) -> dict:
    if len(got) != len(want) or not want:
        return {"within_tol": False, "error": f"{len(got)} losses logged against {len(want)}"}
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    return {"equal": got == want, "max_rel_diff": worst, "within_tol": worst <= LOSS_REL_TOL}


def time_rounds(built: dict[str, Built], rounds: int, skip: int) -> tuple[dict, dict]:
    """Rounds of one run per variant in a seeded shuffled order; the samples per
    variant and the first round's losses."""
    samples = {v: {"step_ms": [], "train_s": []} for v in built}
    first_losses: dict[str, list[float]] = {}
    names, rng = list(built), random.Random(SHUFFLE_SEED)
    with quiet_gc():
        for _ in range(rounds):
            rng.shuffle(names)
            for name in names:
                run = run_once(built[name])
                first_losses.setdefault(name, run["losses"])
                samples[name]["step_ms"].append(steady_median(run["step_ms"], skip))
                samples[name]["train_s"].append(run["train_s"])
    return samples, first_losses


def run_model(model: str, shape: Shape, opts: argparse.Namespace, out_dir: str) -> dict:
    result: dict[str, Any] = {"variants": {}}
    built: dict[str, Built] = {}
    for variant in VARIANTS:
        try:
            built[variant] = build(
                variant,
                model,
                shape,
                steps=opts.steps,
                accumulation=opts.accumulation,
                out_dir=f"{out_dir}/{model}-{variant}",
            )
        except Exception as exc:
            result["variants"][variant] = describe_error(exc)
    if len(built) < len(VARIANTS):
        return result
    result["optimizer"] = built["eager"].trainer.args.optim
    try:
        samples, losses = time_rounds(built, opts.rounds, SKIP_STEPS)
    except Exception as exc:
        result["error"] = describe_error(exc)
        return result
    result["check"] = compare_losses(losses["callback"], losses["eager"])
    for variant, s in samples.items():
        result["variants"][variant] = {
            "step_ms": summarize(s["step_ms"]),
            "train_s": summarize(s["train_s"], 3),
        }
    stats = built["callback"].callback.stats()
    result["variants"]["callback"]["stats"] = stats
    for b in built.values():
        del b.trainer
    free_memory()
    return result


def profile_model(model: str, shape: Shape, opts: argparse.Namespace, out_dir: str) -> dict:
    """Each variant's own kernel-busy time per steady-state step, on a fresh run."""
    busy = {}
    for variant in VARIANTS:
        try:
            b = build(
                variant,
                model,
                shape,
                steps=SKIP_STEPS + PROFILE_STEPS,
                accumulation=opts.accumulation,
                out_dir=f"{out_dir}/{model}-{variant}-profile",
            )
            profiler = StepProfiler(SKIP_STEPS + 1, PROFILE_STEPS)
            b.trainer.add_callback(profiler)
            b.trainer.train()
            busy[variant] = None if profiler.busy_ms is None else round(profiler.busy_ms, 4)
        except Exception as exc:
            busy[variant] = describe_error(exc)
        free_memory()
    return busy


def finish(result: dict) -> None:
    """Ratios of medians and the targets of one model's result."""
    variants = result["variants"]
    ms = {v: r["step_ms"]["median"] for v, r in variants.items() if "step_ms" in r}
    busy = {
        v: b for v, b in result.get("kernel_busy_ms_per_step", {}).items() if isinstance(b, float)
    }
    ratios: dict[str, float | None] = {}
    if len(ms) == 2:
        ratios["eager/callback"] = round(ms["eager"] / ms["callback"], 4)
    for v, t in ms.items():
        ratios[f"{v}/kernel_busy_own"] = round(t / busy[v], 4) if v in busy else None
    result["ratios"] = ratios
    stats = variants.get("callback", {}).get("stats")
    result["targets"] = {
        "callback_losses_equal_eager_within_tol": result.get("check", {}).get("within_tol"),
        "callback_step_faster_than_eager": (ms["callback"] < ms["eager"] if len(ms) == 2 else None),
        "callback_zero_fallbacks": (
            None if stats is None else stats["fallbacks"] == 0 and stats["replayed"] > 0
        ),
    }


def failures(report: dict) -> list[str]:
    failed = []
    for model, res in report["models"].items():
        failed += [f"{model}/{v}" for v, r in res["variants"].items() if "error" in r]
        if "error" in res:
            failed.append(f"{model}: timing")
        if not res.get("check", {}).get("within_tol", False):
            failed.append(f"{model}: losses of callback vs eager")
    return failed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="runs per variant")
    p.add_argument("--accumulation", type=int, default=1, help="gradient accumulation")
    p.add_argument("--skip-kernel-busy", action="store_true")
    add_common_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    code = exit_code_without_gpu(NAME, opts.require_gpu)
    if code is not None:
        return code
    try:
        import accelerate  # noqa: F401
        import transformers
    except ImportError:
        print(
            f"{NAME}: needs transformers and accelerate (pip install -e '.[hf]').", file=sys.stderr
        )
        return 1
    import tempfile

    started = time.perf_counter()
    shape = replace(CONFIGS["launch_bound"])
    report = environment(NAME, opts.commit, opts.run_label)
    report["transformers"] = transformers.__version__
    report["settings"] = {
        "shape": asdict(shape),
        "regime": "trainer: fp32 weights, bf16=True (autocast), the model's causal-LM loss, "
        f"Trainer's default optimizer, gradient accumulation {opts.accumulation}",
        "steps_per_run": opts.steps,
        "rounds": opts.rounds,
        "skip_steps": SKIP_STEPS,
        "step_time": "on_step_begin to on_step_end, device synchronized at both; a round's "
        f"sample is the median over steps after the first {SKIP_STEPS}; rounds in a "
        f"shuffled order (seed {SHUFFLE_SEED}), GC off and frozen; summarize over rounds",
        "kernel_busy": f"each variant's own, over steps {SKIP_STEPS + 1}-"
        f"{SKIP_STEPS + PROFILE_STEPS} of a fresh run, after all wall-clock timing",
        "loss_rel_tol": LOSS_REL_TOL,
    }
    report["models"] = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for model in opts.models:
            report["models"][model] = run_model(model, shape, opts, out_dir)
            finish(report["models"][model])
        write_report(NAME, report, opts.out, final=False)
        if not opts.skip_kernel_busy:
            for model, res in report["models"].items():
                res["kernel_busy_ms_per_step"] = profile_model(model, shape, opts, out_dir)
                finish(res)
    report["targets"] = {
        f"{model}:{key}": value
        for model, res in report["models"].items()
        for key, value in res.get("targets", {}).items()
    }
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(NAME, report, opts.out, final=True)
    failed = failures(report)
    if failed:
        print(f"{NAME}: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
