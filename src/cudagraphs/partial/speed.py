"""Never slower than eager: time a captured target's replay against its eager run and
turn off the targets whose graphs lose.

Why measure: a graph saves host time per kernel launch, so it wins big on launch-bound
pieces (a small attention, a router) and by nothing on compute-bound ones, where it
can even lose (static-input copies, a worse memory layout in the pool). Only a
measurement on the user's own shapes says which; a rule of thumb would be wrong for
some model or GPU.

How: right after capture, on the recorded sample inputs, forward and backward of the
graphed callable and of the function it graphs run eagerly, ``iters`` calls per sample, rounds
alternating which goes first (host speed drifts; a fixed order would bias one side),
compared by their medians. Backward runs through ``torch.autograd.grad`` on the
inputs, so no ``.grad`` of the model changes, and the random-number state is restored
afterwards, so a measured step draws the same numbers as an unmeasured one.

Vocabulary:

* verdict: one target variant's :class:`SpeedVerdict` (median ms of graph and eager);
* turned off: a target whose graph lost for any of its variants runs its eager forward
  from then on (its graphs released), counted in ``stats()`` and logged once.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..checks import check_int
from ..errors import CudaGraphsTypeError

__all__ = [
    "SpeedCheck",
    "SpeedVerdict",
    "chained_call",
    "forward_backward",
    "measure_group",
    "speed_check_of",
    "turn_off_slower",
]


@dataclass(frozen=True)
class SpeedVerdict:
    """Median milliseconds per forward+backward call of a target variant."""

    graph_ms: float
    eager_ms: float

    @property
    def slower(self) -> bool:
        """Whether the graph lost (ties keep the graph: it is never worse)."""
        return self.graph_ms > self.eager_ms


def forward_backward(
    fn: Callable[..., Any], args: tuple, kwargs: dict, unreached: frozenset[int] = frozenset()
) -> Callable[[], None]:
    """A call of ``fn(*args, **kwargs)`` followed by the gradients of its outputs with
    respect to every input that requires grad (``torch.autograd.grad``: no ``.grad``
    is written). Outputs that do not require grad are left out, and so are the tensor
    outputs at the positions ``unreached`` names (those no recorded backward reached:
    the graph was captured without them, and a real step's backward does not reach
    them either); with none left, only the forward runs (an inference variant)."""
    inputs = [
        t
        for t in pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]

    def run() -> None:
        out = fn(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        outs = [t for i, t in enumerate(tensors) if t.requires_grad and i not in unreached]
        if outs and inputs:
            torch.autograd.grad(
                outs, inputs, grad_outputs=[torch.ones_like(t) for t in outs], allow_unused=True
            )

    return run


@dataclass(frozen=True)
class SpeedCheck:
    """How a target's graph is timed against its eager run (see the module docs).

    Args:
        rounds: samples per side; each sample is the mean of ``iters`` calls.
        iters: calls per sample.
        warmup: untimed calls per side before the first round.
        clock: seconds, monotonic (injectable for tests).
        synchronize: waits for the device before each clock reading (the current
            CUDA device's by default; tests pass a no-op).
    """

    rounds: int = 5
    iters: int = 5
    warmup: int = 2
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False)
    synchronize: Callable[[], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_int("rounds", self.rounds, minimum=1)
        check_int("iters", self.iters, minimum=1)
        check_int("warmup", self.warmup, minimum=0)

    def measure(self, graph: Callable[[], None], eager: Callable[[], None]) -> SpeedVerdict:
        """Time both, interleaved; the random-number state is restored afterwards."""
        sync = self.synchronize or _device_synchronize
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            for _ in range(self.warmup):
                graph()
                eager()
            samples: dict[str, list[float]] = {"graph": [], "eager": []}
            sides = [("graph", graph), ("eager", eager)]
            for r in range(self.rounds):
                for name, fn in sides if r % 2 == 0 else sides[::-1]:
                    sync()
                    start = self.clock()
                    for _ in range(self.iters):
                        fn()
                    sync()
                    samples[name].append((self.clock() - start) * 1e3 / self.iters)
        return SpeedVerdict(
            graph_ms=statistics.median(samples["graph"]),
            eager_ms=statistics.median(samples["eager"]),
        )


def speed_check_of(value: Any) -> SpeedCheck | bool:
    """The manager's ``speed_check`` argument: ``True`` (a default :class:`SpeedCheck`
    for targets on a CUDA device), ``False`` (never), or a :class:`SpeedCheck` (always,
    whatever the device: tests and tuning).

    Raises:
        CudaGraphsTypeError: anything else, naming ``speed_check``.
    """
    if isinstance(value, (bool, SpeedCheck)):
        return value
    raise CudaGraphsTypeError(
        f"speed_check must be a bool or a SpeedCheck, got {type(value).__name__} {value!r}"
    )


def measure_group(setting: SpeedCheck | bool, group: list, graphed: list, functions: list) -> list:
    """``[(recording, verdict)]`` for the training variants of one captured group
    (``(recording, variant index)`` pairs, their graphs and the functions graphed,
    run eagerly for the other side), under the recorded modes and before the samples
    are dropped. ``setting`` as :func:`speed_check_of` returns it: inference variants
    are never measured, CPU targets only with an explicit :class:`SpeedCheck`."""
    if setting is False:
        return []
    check = setting if isinstance(setting, SpeedCheck) else SpeedCheck()
    verdicts = []
    for (rec, i), graph, eager in zip(group, graphed, functions):
        variant, contract = rec.variants[i], rec.contracts.variants[i]
        on_cuda = any(p.is_cuda for p in rec.capture_params(i))
        if not contract.grad_enabled or (setting is True and not on_cuda):
            continue
        call = ((tuple(rec.capture_params(i)), *variant.args), variant.kwargs)
        # The same backward on both sides: the one the graph was captured for.
        unreached = variant.unreached_outputs()
        verdict = check.measure(
            forward_backward(graph, *chained_call(graph, *call), unreached),
            forward_backward(eager, *call, unreached),
        )
        verdicts.append((rec, verdict))
    return verdicts


def chained_call(graph: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call to time ``graph`` with: the sample call, where the graph reads an input
    in place from another graph's output (``core.sharing``), with that very output
    (what a real step passes; the sample would be refused)."""
    graphs = getattr(graph, "graphs", None)
    chained = getattr(graphs, "chained", ())
    if not chained:
        return args, kwargs
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    tensors = [n for n, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for index, _ in chained:
        sample = leaves[tensors[index]]
        leaves[tensors[index]] = (
            graphs.static_inputs[index].detach().requires_grad_(sample.requires_grad)
        )
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return args, kwargs


def turn_off_slower(verdicts: list, logger: logging.Logger) -> None:
    """Turn off every target (its :class:`~.recording.TargetRecording`) whose graph
    lost for any variant, so that it runs its eager forward from now on, and say
    which, with the times, in one WARNING."""
    slower = {}
    for rec, verdict in verdicts:
        if verdict.slower and rec.off_reason is None:
            slower.setdefault(id(rec), (rec, verdict))
    for rec, _ in slower.values():
        rec.turn_off("slower_than_eager")
    if slower:
        logger.warning(
            "partial graphs: %d target(s) ran slower graphed than eager on their recorded "
            "inputs and run eagerly from now on (stats()['off_slower_than_eager']; pass "
            "speed_check=False to keep them): %s",
            len(slower),
            ", ".join(
                f"{e.name} ({v.graph_ms:.3f} ms graphed vs {v.eager_ms:.3f} ms eager)"
                for e, v in slower.values()
            ),
        )


def _device_synchronize() -> None:
    """Wait for the GPU where there is one; on a torch without CUDA there is nothing
    queued to wait for (timing eager stand-ins, a CPU-only test machine)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
