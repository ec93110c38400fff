"""Main job: ``python -m cudagraphs``.

Graphs an embedded stack of pre-norm transformer blocks with
:func:`cudagraphs.make_graphed_callables` and prints the eager and graphed training
step times next to the GPU's kernel-busy time (the floor). Without a CUDA device it
says so and exits 0, or 2 with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import make_graphed_callables
from .models import BlockConfig, make_block_stack
from .timing import kernel_busy_ms, step_time_ms


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cudagraphs", description=__doc__.split("\n\n")[1])
    p.add_argument(
        "--require-gpu", action="store_true", help="exit 2 when no CUDA device is present"
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p.parse_args(argv)


def _training_step(layers, x):  # noqa: ANN001 - list of callables, tensor
    def step() -> None:
        h = x
        for layer in layers:
            h = layer(h)
        h.float().pow(2).mean().backward()

    return step


def run_demo(args: argparse.Namespace) -> dict:
    cfg = BlockConfig(hidden=args.hidden, heads=args.heads, ffn=4 * args.hidden)
    shape = (args.batch, args.seq, args.hidden)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    eager = make_block_stack(args.layers, cfg)
    eager_step = _training_step(list(eager), x)
    eager_ms = step_time_ms(eager_step, iters=args.iters)
    busy_ms = kernel_busy_ms(eager_step)

    graphed = make_block_stack(args.layers, cfg)
    samples = tuple(
        (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=i > 0),)
        for i in range(args.layers)
    )
    layers = make_graphed_callables(tuple(graphed), samples)
    graphed_ms = step_time_ms(_training_step(list(layers), x), iters=args.iters)
    return {
        "device": torch.cuda.get_device_name(),
        "model": f"{args.layers} pre-norm blocks, hidden {args.hidden}, batch {args.batch}, seq {args.seq}, bf16",
        "eager_ms": round(eager_ms, 3),
        "graphed_ms": round(graphed_ms, 3),
        "kernel_busy_ms": round(busy_ms, 3),
        "speedup_vs_eager": round(eager_ms / graphed_ms, 2),
        "graphed_over_kernel_busy": round(graphed_ms / busy_ms, 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print(
            "cudagraphs: no CUDA device is present, so there is nothing to graph here. "
            "Run this on a machine with an NVIDIA GPU (the tests run anywhere: see README).",
            file=sys.stderr,
        )
        return 2 if args.require_gpu else 0
    result = run_demo(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['model']} on {result['device']}, forward+backward per step")
        print(f"  eager            {result['eager_ms']:8.3f} ms")
        print(
            f"  cudagraphs       {result['graphed_ms']:8.3f} ms  ({result['speedup_vs_eager']}x eager)"
        )
        print(f"  kernel-busy time {result['kernel_busy_ms']:8.3f} ms  (the floor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
