"""Timing helpers for the main job and the benchmarks (never for unit tests).

* :func:`step_time_ms`: host wall time per call of a step, synchronized at both ends,
  so launch overhead (the thing CUDA graphs remove) is counted.
* :func:`interleaved_step_times_ms`: the same for several steps, timed in turns, so
  that a host that slows down or speeds up part way affects every variant alike.
* :func:`interleaved_samples_ms`: the per-round samples behind that, for reports that
  give a range (:func:`summarize`: median, min, max over rounds).
* :func:`kernel_busy_ms`: the union of the GPU's kernel/copy intervals per step, from
  the profiler: the physical floor a perfectly launched step could reach;
  :func:`kernel_activity` adds the launches per step.
* :func:`quiet_gc`: no garbage collection inside a timed window.
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CudaGraphsValueError

__all__ = [
    "KernelActivity",
    "interleaved_samples_ms",
    "interleaved_step_times_ms",
    "kernel_activity",
    "kernel_busy_ms",
    "profile_activity",
    "profile_busy_ms",
    "quiet_gc",
    "step_time_ms",
    "summarize",
]


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect once, then keep the cyclic garbage collector out of the window.

    A collection in the middle of a timed loop costs milliseconds on a process that
    holds a model, and lands on whichever variant happens to be running. Everything
    alive at entry is frozen (moved out of the collector's generations, so a later
    collection does not walk it), and collection is off until exit.
    """
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def step_time_ms(
    step: Callable[[], object], *, iters: int = 50, warmup: int = 10, repeats: int = 5
) -> float:
    """Median over ``repeats`` of the mean wall time of ``iters`` back-to-back steps."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    samples = []
    with quiet_gc():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def interleaved_samples_ms(
    steps: dict[str, Callable[[], object]],
    *,
    iters: int = 50,
    warmup: int = 10,
    repeats: int = 5,
    synchronize: Callable[[], None] | None = None,
    shuffle_seed: int | None = None,
) -> dict[str, list[float]]:
    """Per step, ``repeats`` samples (one per round) of the mean wall time of ``iters``
    back-to-back calls; each round times every step once, in turn.

    Host speed on shared machines drifts by tens of percent over a minute; timing
    variants one after another turns that drift into false differences between them.
    With ``shuffle_seed`` each round takes the steps in a new order (seeded), so that
    no step always follows the same neighbour (a step that leaves the GPU queue or
    the caches in some state would otherwise bias the one after it every round).
    The garbage collector is kept out of the timed rounds (:func:`quiet_gc`).
    """
    sync = torch.cuda.synchronize if synchronize is None else synchronize
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    rng = random.Random(shuffle_seed)
    with quiet_gc():
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
    return samples


def interleaved_step_times_ms(
    steps: dict[str, Callable[[], object]],
    *,
    iters: int = 50,
    warmup: int = 10,
    repeats: int = 5,
    synchronize: Callable[[], None] | None = None,
    shuffle_seed: int | None = None,
) -> dict[str, float]:
    """The median over rounds of :func:`interleaved_samples_ms`, per step."""
    samples = interleaved_samples_ms(
        steps,
        iters=iters,
        warmup=warmup,
        repeats=repeats,
        synchronize=synchronize,
        shuffle_seed=shuffle_seed,
    )
    return {name: statistics.median(times) for name, times in samples.items()}


def summarize(samples: list[float], digits: int = 4) -> dict[str, float | int]:
    """``{"median", "min", "max", "rounds"}`` of one step's samples, rounded."""
    if not samples:
        raise CudaGraphsValueError("summarize() needs at least one sample")
    return {
        "median": round(statistics.median(samples), digits),
        "min": round(min(samples), digits),
        "max": round(max(samples), digits),
        "rounds": len(samples),
    }


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


@dataclass(frozen=True)
class KernelActivity:
    """What the GPU ran per step over a profiled window.

    ``launches`` is the number of kernels, copies and memsets per step. With a step's
    wall time it gives the GPU's idle time per launch, ``(step - busy) / launches``:
    inside a CUDA graph that is the device's own gap between dependent nodes, which
    no host work can shorten, so ``busy + launches * gap`` is the floor of a graph of
    those kernels (see ``docs/torch-graph-facts.md``).
    """

    busy_ms: float  # at least one kernel, copy or memset running
    launches: float
    # The kernels that took longest, summed by name: (name, ms per step, launches per
    # step), longest first; what to look at when two steps' busy times differ.
    heaviest: tuple[tuple[str, float, float], ...] = ()


def kernel_activity(
    step: Callable[[], object], *, iters: int = 20, warmup: int = 5
) -> KernelActivity:
    """Kernel-busy milliseconds and launches per step of ``step``, over ``iters``
    profiled steps after ``warmup`` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return profile_activity(prof, steps=iters)


def kernel_busy_ms(step: Callable[[], object], *, iters: int = 20, warmup: int = 5) -> float:
    """Milliseconds per step during which at least one kernel, copy or memset ran."""
    return kernel_activity(step, iters=iters, warmup=warmup).busy_ms


HEAVIEST_KERNELS = 8


def profile_activity(prof: Any, steps: int = 1) -> KernelActivity:
    """:class:`KernelActivity` per step of a finished ``torch.profiler.profile`` that
    covered ``steps`` steps. Activities the profiler gave no usable interval (see
    :func:`_usable_intervals`) are neither busy time nor launches."""
    if steps < 1:
        raise CudaGraphsValueError(f"profile_activity() needs steps >= 1, got {steps}")
    named = [
        (evt.time_range.start, evt.time_range.end, str(getattr(evt, "name", "")))
        for evt in prof.events()
        if evt.device_type == torch.autograd.DeviceType.CUDA
    ]
    kept = [(a, b, name) for a, b, name in named if _usable(a, b)]
    by_name: dict[str, list[float]] = {}  # name: [microseconds, launches]
    for a, b, name in kept:
        total = by_name.setdefault(name, [0.0, 0.0])
        total[0] += b - a
        total[1] += 1
    heaviest = sorted(by_name.items(), key=lambda kv: (-kv[1][0], kv[0]))[:HEAVIEST_KERNELS]
    return KernelActivity(
        _union_length([(a, b) for a, b, _ in kept]) / 1e3 / steps,
        len(kept) / steps,
        tuple((name, us / 1e3 / steps, n / steps) for name, (us, n) in heaviest),
    )


def profile_busy_ms(prof: Any) -> float:
    """Milliseconds during which at least one kernel, copy or memset ran, over a
    finished ``torch.profiler.profile`` (for windows a step function cannot frame,
    such as steps inside a ``Trainer`` run)."""
    return profile_activity(prof).busy_ms


def _usable_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Drop intervals that cannot be real: empty or reversed ones, and those starting
    at timestamp 0, which the CUDA 13.0 profiler reports for some activities whose
    start it did not record. Merged with the others, such an interval would count
    everything from the epoch to its end as busy."""
    return [(a, b) for a, b in intervals if _usable(a, b)]


def _usable(start: float, end: float) -> bool:
    return start > 0 and end > start
