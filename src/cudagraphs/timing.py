"""Timing helpers for the main job and the benchmarks (never for unit tests).

* :func:`step_time_ms`: host wall time per call of a step, synchronized at both ends,
  so launch overhead (the thing CUDA graphs remove) is counted.
* :func:`interleaved_step_times_ms`: the same for several steps, timed in turns, so
  that a host that slows down or speeds up part way affects every variant alike.
* :func:`kernel_busy_ms`: the union of the GPU's kernel/copy intervals per step, from
  the profiler: the physical floor a perfectly launched step could reach.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["interleaved_step_times_ms", "kernel_busy_ms", "step_time_ms"]


def step_time_ms(
    step: Callable[[], object], *, iters: int = 50, warmup: int = 10, repeats: int = 5
) -> float:
    """Median over ``repeats`` of the mean wall time of ``iters`` back-to-back steps."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def interleaved_step_times_ms(
    steps: dict[str, Callable[[], object]],
    *,
    iters: int = 50,
    warmup: int = 10,
    repeats: int = 5,
    synchronize: Callable[[], None] | None = None,
    shuffle_seed: int | None = None,
) -> dict[str, float]:
    """Median over ``repeats`` rounds of the mean wall time of ``iters`` back-to-back
    calls of each step; each round times every step once, in turn.

    Host speed on shared machines drifts by tens of percent over a minute; timing
    variants one after another turns that drift into false differences between them.
    With ``shuffle_seed`` each round takes the steps in a new order (seeded), so that
    no step always follows the same neighbour (a step that leaves the GPU queue or
    the caches in some state would otherwise bias the one after it every round).
    """
    sync = torch.cuda.synchronize if synchronize is None else synchronize
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    rng = random.Random(shuffle_seed)
    for _ in range(repeats):
        if shuffle_seed is not None:
            rng.shuffle(names)
        for name in names:
            step = steps[name]
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            sync()
            samples[name].append((time.perf_counter() - t0) * 1e3 / iters)
    return {name: statistics.median(times) for name, times in samples.items()}


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def kernel_busy_ms(step: Callable[[], object], *, iters: int = 20, warmup: int = 5) -> float:
    """Milliseconds per step during which at least one kernel, copy or memset ran."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    intervals = []
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.time_range.elapsed_us() > 0:
            intervals.append((evt.time_range.start, evt.time_range.end))
    return _union_length(intervals) / 1e3 / iters
