"""Host cost of ``GraphRunner.run()`` on the CPU: the runner's own Python work per step
(validation, bucket choice, staging, padding, output views) over a hand-written loop
doing the same copies, with a replay that does nothing.

Runs without a GPU. The runner gets a ``capture_backend`` whose "graph" has a no-op
``replay()`` (the output tree is the one forward returned at capture), on CPU tensors,
so what is timed is host work only. The inputs are a decode step's: ``tokens`` and
``positions`` (int64, ``[rows]``) at buckets 1, 2, 4, ..., 64; the output is
``[rows, VOCAB]`` float32.

Variants per batch size, timed in shuffled interleaved rounds
(:func:`cudagraphs.timing.interleaved_samples_ms`, no GC inside a round):

* ``raw``: static buffers of the bucket's rows; a step is ``copy_`` of each input into
  the leading rows, a zero fill of the padding rows when the batch is padded, the
  no-op replay, and a slice of the output to the real rows (the whole output when the
  batch fills the bucket).
* ``runner``: ``runner.run({"tokens": t, "positions": p})``.
* ``runner_copy``: the same with ``copy_output=True`` (clones the rows).

Prints one line per batch size (µs per call, median and min-max over rounds, and the
runner's overhead over ``raw``) and, with ``--json``, the whole result as JSON.
``--profile N`` runs ``runner.run`` N times under cProfile at the first batch size and
prints the top functions by own time.

Default: 2000 calls per round, 15 rounds, 200 warmup calls per variant: about 5 s.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from collections.abc import Callable

import torch  # noqa: E402

import _report  # noqa: E402,F401  (first: puts this checkout's src on sys.path)
from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec  # noqa: E402
from cudagraphs.timing import interleaved_samples_ms, summarize  # noqa: E402

MAX_BATCH = 64
VOCAB = 256
BATCH_SIZES = (1, 8, 5, 20, 32)
ITERS, ROUNDS, WARMUP = 2000, 15, 200


class NoopGraph:
    """A captured "graph" whose replay does nothing: the output stays as captured."""

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


def noop_backend(run: Callable[[], object], pool: object, what: str) -> tuple[NoopGraph, object]:
    del pool, what
    return NoopGraph(), run()


def forward(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (tokens + positions).unsqueeze(-1).float().expand(-1, VOCAB).contiguous()


def make_inputs(rows: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, VOCAB, (rows,), generator=gen),
        "positions": torch.full((rows,), 7, dtype=torch.long),
    }


def build_runner() -> GraphRunner:
    specs = [
        InputSpec("tokens", (MAX_BATCH,), torch.long),
        InputSpec("positions", (MAX_BATCH,), torch.long),
    ]
    runner = GraphRunner(forward, specs, BucketConfig(), device="cpu", capture_backend=noop_backend)
    runner.capture(lambda b: make_inputs(b.rows, b.rows), warmup=0)
    return runner


def raw_step(batch: int, bucket_rows: int, inputs: dict) -> Callable[[], torch.Tensor]:
    """The hand-written loop: same copies and padding as the runner, no checks."""
    static = {k: torch.zeros(bucket_rows, dtype=v.dtype) for k, v in inputs.items()}
    graph = NoopGraph()
    out = forward(**static)
    pairs = [(static[k][:batch], v) for k, v in inputs.items()]
    pads = [s[batch:] for s in static.values()] if batch < bucket_rows else []

    if pads:

        def step() -> torch.Tensor:
            for dst, src in pairs:
                dst.copy_(src)
            torch._foreach_zero_(pads)
            graph.replay()
            return out[:batch]

    else:

        def step() -> torch.Tensor:
            for dst, src in pairs:
                dst.copy_(src)
            graph.replay()
            return out

    return step


def measure(runner: GraphRunner, batch: int, args: argparse.Namespace) -> dict:
    inputs = make_inputs(batch, 1000 + batch)
    bucket = runner.select(batch)
    steps = {
        "raw": raw_step(batch, bucket.rows, inputs),
        "runner": lambda: runner.run(inputs),
        "runner_copy": lambda: runner.run(inputs, copy_output=True),
    }
    for name, step in steps.items():
        # The replay does nothing, so the check is on what a step leaves behind: the
        # batch staged into the runner's buffers, and an output of the batch's rows.
        out = step()
        staged = {k: runner.static.view(k, bucket.rows)[:batch] for k in inputs}
        if out.shape != (batch, VOCAB) or (
            name != "raw" and not all(torch.equal(staged[k], v) for k, v in inputs.items())
        ):
            raise AssertionError(f"{name} at batch {batch}: wrong output shape or staging")
    samples = interleaved_samples_ms(
        steps,
        iters=args.iters,
        warmup=WARMUP,
        repeats=args.rounds,
        synchronize=lambda: None,
        shuffle_seed=batch,
    )
    us = {name: summarize([s * 1e3 for s in v], digits=2) for name, v in samples.items()}
    overhead = [(r - w) * 1e3 for r, w in zip(samples["runner"], samples["raw"])]
    return {
        "bucket": bucket.batch_size,
        "us_per_call": us,
        "runner_minus_raw_us": summarize(overhead, digits=2),
    }


def profile(runner: GraphRunner, batch: int, calls: int) -> None:
    inputs = make_inputs(batch, 1000 + batch)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        runner.run(inputs)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=list(BATCH_SIZES))
    p.add_argument("--iters", type=int, default=ITERS, help="calls per round")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds")
    p.add_argument("--profile", type=int, default=0, help="cProfile N runner calls")
    p.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = p.parse_args(argv)
    if any(not 1 <= b <= MAX_BATCH for b in args.batch_sizes):
        p.error(f"batch sizes must be in 1..{MAX_BATCH}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # host work only: no intra-op pool wakeups in a copy
    runner = build_runner()
    result = {
        "settings": {
            "iters": args.iters,
            "rounds": args.rounds,
            "warmup": WARMUP,
            "torch": torch.__version__,
            "replay": "no-op",
            "inputs": "tokens, positions: int64 [rows]; output float32 [rows, 256]",
        },
        "batches": {},
    }
    with torch.inference_mode(False), torch.no_grad():
        for b in args.batch_sizes:
            r = measure(runner, b, args)
            result["batches"][str(b)] = r
            us = r["us_per_call"]
            print(
                f"batch {b:>2} (bucket {r['bucket']:>2}): raw {us['raw']['median']:6.2f} µs, "
                f"runner {us['runner']['median']:6.2f} µs "
                f"[{us['runner']['min']:.2f}-{us['runner']['max']:.2f}], "
                f"runner_copy {us['runner_copy']['median']:6.2f} µs; "
                f"runner - raw {r['runner_minus_raw_us']['median']:6.2f} µs"
            )
        if args.profile:
            profile(runner, args.batch_sizes[0], args.profile)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
