"""Main job: ``python -m cudagraphs``.

Graphs an embedded stack of pre-norm transformer blocks with
:func:`cudagraphs.make_graphed_callables` and prints the eager and graphed training
step times next to the GPU's kernel-busy time (the floor); then a
:class:`CudaGraphProgram` over a nested tree, and greedy decoding of an embedded
Llama-like decoder through the bucketed :class:`~cudagraphs.serving.GraphRunner`
(tokens compared with eager); and, when ``transformers`` is installed (the ``hf``
extra), partial graphs (attention) inside eager training steps of a Hugging Face
Llama built from config, and greedy generation of one through the graphed generator
(tokens per second against HF's eager ``generate``, and its startup). Without a CUDA
device it says so and exits 0, or 2 with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .demos import (
    run_demo,
    run_generate_demo,
    run_partial_demo,
    run_program_demo,
    run_serving_demo,
)
from .envinfo import collect, format_report
from .memory import MemoryAccount


def _print_memory(account: dict | None) -> None:
    """The capture's memory account (cudagraphs.memory.MemoryAccount), one line."""
    if account:
        print(f"  memory           {MemoryAccount(**account).summary()}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_DESCRIPTION = """\
Graphs an embedded stack of transformer blocks (training step), a graph program over
a nested tree, greedy decoding of an embedded decoder through the bucketed runner
and, with transformers installed, partial graphs in a Hugging Face Llama and greedy
generation of one through the graphed generator; prints each against eager and the
GPU's kernel-busy time. Without a CUDA device it says so and exits 0 (2 with
--require-gpu).
"""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cudagraphs",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "command",
        nargs="?",
        choices=["demo", "env"],
        default="demo",
        help="demo: the measurements below; env: print what a bug report needs "
        "(versions, GPU, driver, optional packages, settings) and exit",
    )
    p.add_argument(
        "--require-gpu", action="store_true", help="exit 2 when no CUDA device is present"
    )
    p.add_argument(
        "--layers", type=_positive_int, default=8, help="transformer blocks in the stack"
    )
    p.add_argument("--hidden", type=_positive_int, default=512, help="hidden size")
    p.add_argument("--heads", type=_positive_int, default=8, help="attention heads")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences per step")
    p.add_argument("--seq", type=_positive_int, default=64, help="tokens per sequence")
    p.add_argument("--iters", type=_positive_int, default=50, help="timed steps per variant")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command == "env":
        report = collect()
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return 0
    if not torch.cuda.is_available():
        why = (
            "no CUDA device is present, so there is nothing to graph here. Run this on a "
            "machine with an NVIDIA GPU (the tests run anywhere: see README)."
        )
        print(f"cudagraphs: {why}", file=sys.stderr)
        if args.json:
            # Whatever parses --json gets an object that says why, not an empty stdout.
            print(json.dumps({"ran": False, "reason": why, "require_gpu": args.require_gpu}))
        return 2 if args.require_gpu else 0
    result = run_demo(args)
    result.update(run_program_demo(args.iters))
    result.update(run_serving_demo())
    result.update(run_partial_demo(args.iters))
    result.update(run_generate_demo())
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['model']} on {result['device']}, forward+backward per step")
        print(f"  eager            {result['eager_ms']:8.3f} ms")
        print(
            f"  cudagraphs       {result['graphed_ms']:8.3f} ms  "
            f"({result['speedup_vs_eager']}x eager, same gradients: {result['training_grads_equal']})"
        )
        print(f"  kernel-busy time {result['kernel_busy_ms']:8.3f} ms  (the floor)")
        _print_memory(result.get("graphed_memory"))
        print(f"{result['program']}, per call")
        print(f"  eager            {result['program_eager_ms']:8.3f} ms")
        print(
            f"  CudaGraphProgram {result['program_replay_ms']:8.3f} ms  "
            f"({result['program_speedup_vs_eager']}x eager, equal: {result['program_equal_to_eager']})"
        )
        print(f"{result['decoder']}, greedy decoding per token")
        print(f"  eager            {result['decode_eager_ms_per_token']:8.3f} ms")
        print(
            f"  GraphRunner      {result['decode_runner_ms_per_token']:8.3f} ms  "
            f"({result['decode_speedup_vs_eager']}x eager, same tokens: "
            f"{result['decode_tokens_equal']})"
        )
        _print_memory(result.get("decode_runner_memory"))
        print(result["partial"] + ("" if "partial_loss_equal" not in result else ", per step"))
        if "partial_loss_equal" in result:
            print(f"  eager            {result['partial_eager_ms']:8.3f} ms")
            print(
                f"  partial graphs   {result['partial_graphed_ms']:8.3f} ms  "
                f"({result['partial_speedup_vs_eager']}x eager, same loss: "
                f"{result['partial_loss_equal']}, fallbacks: {result['partial_fallbacks']})"
            )
            _print_memory(result.get("partial_memory"))
        print(result["generate"])
        if "generate_tokens_equal" in result:
            print(f"  HF eager generate {result['generate_eager_tokens_per_s']:9.1f} tokens/s")
            print(
                f"  GraphedGenerator  {result['generate_graphed_tokens_per_s']:9.1f} tokens/s  "
                f"({result['generate_speedup_vs_eager']}x eager, same tokens as HF's static "
                f"cache: {result['generate_tokens_equal']}; capture + first request "
                f"{result['generate_startup_s']} s)"
            )
            _print_memory(result.get("generate_memory"))
    ok = (
        result["training_grads_equal"]
        and result["program_equal_to_eager"]
        and result["decode_tokens_equal"]
        and result.get("partial_loss_equal", True)
        and result.get("generate_tokens_equal", True)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
