"""A stand-in for ``capture_into_graph`` in the core's capture phase, for CPU tests of
the capture path (``core/capture_phase.py``) and of the warmup (``core/warmup.py``).

``capture_into_graph(run, pool, stream=..., what=...)`` calls ``run()`` once and
returns ``(graph, output)``; the stand-in does the same eagerly on the CPU, so the
schedule, the hooks, the buffers and the error handling run as written, with a graph
object that records its releases. It can fail at a chosen capture, as a capture that
hits an illegal call would. Graphs it makes are never replayed.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cudagraphs.capture import GraphMemoryPool
from cudagraphs.core import capture_phase
from cudagraphs.core.capture_phase import CaptureOptions


class StandInGraph:
    def __init__(self, what: str) -> None:
        self.what = what
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def replay(self) -> None:
        raise AssertionError(f"stand-in graph of {self.what} replayed")


class PlantedCaptureError(RuntimeError):
    pass


class StandInCapture:
    """Installed with :meth:`install`; ``fail_at=k`` makes the k-th capture (0-based)
    raise :class:`PlantedCaptureError` before running anything."""

    #: What the stand-in's ``torch.cuda.memory_reserved`` grows by per call: each
    #: capture (read before and after) then grew the pool by exactly this much.
    GROWTH = 512

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.graphs: list[StandInGraph] = []
        self.whats: list[str] = []
        self.places: list[tuple] = []  # (pool, stream) of each capture
        self.reserved = 0
        self.devices: list = []  # what memory_reserved was asked about

    def memory_reserved(self, device=None):
        self.devices.append(device)
        self.reserved += self.GROWTH
        return self.reserved

    def __call__(self, run, pool, *, stream=None, what="callable", **_):
        self.whats.append(what)
        self.places.append((pool, stream))
        if len(self.whats) - 1 == self.fail_at:
            raise PlantedCaptureError(f"planted failure in the capture of {what}")
        output = run()
        graph = StandInGraph(what)
        self.graphs.append(graph)
        return graph, output

    def install(self, monkeypatch) -> StandInCapture:
        monkeypatch.setattr(capture_phase, "capture_into_graph", self)
        monkeypatch.setattr(torch.cuda, "memory_reserved", self.memory_reserved)
        return self


def cpu_options(**fields) -> CaptureOptions:
    """CaptureOptions for a CPU capture: a fresh pool, a stream stand-in on the CPU."""
    base = dict(
        pool=GraphMemoryPool(),
        stream=SimpleNamespace(device=torch.device("cpu")),
        allow_unused_input=False,
        retain_graph_in_backward=False,
        clone_param_grads_on_return=True,
    )
    return CaptureOptions(**{**base, **fields})
