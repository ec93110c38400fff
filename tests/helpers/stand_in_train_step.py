"""CPU stand-ins for the device-only calls of ``GraphedTrainStep.capture``, and a
capture whose graphs replay, for CPU tests of the train step's replay path.

:class:`CpuPool` and :class:`CpuMeter` replace the pool's streams and warmup scope and
the memory meter. :class:`ReplayingCapture` replaces ``capture_into_graph`` in
``cudagraphs.train.step_capture``: it runs the function once, as a capture records it,
then puts the parameters and the optimizer's state back (a capture computes nothing:
its kernels only run at replay), and returns a :class:`ReplayingGraph` whose
``replay()`` runs it again eagerly and
writes what a replay of the real graph writes, where the capture left it: the outputs
into the captured output tensors, and the gradients into the gradient tensors the
capture created (a graph captured with no ``.grad`` creates them and each replay
overwrites them; one captured with them present adds into them). The warmup, the
optimizer snapshot, the guards and the whole of ``__call__`` run as written.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch.utils import _pytree as pytree

from cudagraphs.capture import GraphMemoryPool


class CpuPool(GraphMemoryPool):
    """A pool whose streams and warmup scope do nothing; ``asked`` records each call
    with the device it named, and ``stream`` is the one stream it hands out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[str, object]] = []
        self.stream = SimpleNamespace(device=torch.device("cpu"))

    def capture_stream(self, device=None):
        self.asked.append(("capture_stream", device))
        return self.stream

    @contextlib.contextmanager
    def warmup_scope(self, device=None):
        self.asked.append(("warmup_scope", device))
        yield None

    def handles(self):
        return ("cpu-pool-handle",)


class CpuMeter:
    """The memory meter: its account says which device, handles and caller it got."""

    released_before = 0
    #: Set to a list, it records the packing hook each start was given (``None``
    #: where none), in start order.
    packs: list | None = None

    def __init__(self, device, release=None):
        self.device, self.release = device, release

    @classmethod
    def start(cls, device, *, release=None, eager_workspaces=True, pack=None):
        if cls.packs is not None:
            cls.packs.append(pack)
        return cls(device, release)

    def finish(self, handles, what="", static_bytes=0):
        return SimpleNamespace(
            device=self.device,
            handles=handles,
            what=what,
            released_before=self.release,
            static_bytes=static_bytes,
        )


class ReplayingGraph:
    def __init__(self, what, run, output, params, creates_grads):
        self.what = what
        self.run = run
        self.output = output
        self.params = params
        self.creates_grads = creates_grads
        self.replays = 0

    def replay(self):
        self.replays += 1
        static = [p.grad for p in self.params]
        if self.creates_grads:
            for p in self.params:
                p.grad = None
        new = self.run()
        for old, fresh in zip(pytree.tree_leaves(self.output), pytree.tree_leaves(new)):
            if isinstance(old, torch.Tensor):
                old.copy_(fresh)
        for p, g in zip(self.params, static):
            if g is not None and p.grad is not None and p.grad is not g:
                g.copy_(p.grad)
            if g is not None:
                p.grad = g

    def reset(self):
        pass


class ReplayingCapture:
    """Installed as ``capture_into_graph`` for ``optimizer``'s parameters; ``graphs``
    in capture order."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.graphs: list[ReplayingGraph] = []
        self.places: list[tuple[object, object]] = []  # (pool, stream) of each capture

    def _values(self):
        state = [
            v
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        return [*self.params, *state]

    def __call__(self, run, pool, *, stream=None, what="callable", **_):
        self.places.append((pool, stream))
        creates = all(p.grad is None for p in self.params)
        before = [(t, t.detach().clone()) for t in self._values()]
        output = run()
        with torch.no_grad():
            for t, value in before:
                t.copy_(value)
        graph = ReplayingGraph(what, run, output, self.params, creates)
        self.graphs.append(graph)
        return graph, output

    def replays(self):
        return {g.what: g.replays for g in self.graphs}


def run_capture_on_cpu(monkeypatch):
    """Let ``GraphedTrainStep.capture`` run on the CPU: no device check, the CPU as the
    device, :class:`CpuMeter`, no synchronize (the capture itself is left as it is)."""
    from cudagraphs.train import step as step_module
    from cudagraphs.train.step import GraphedTrainStep

    monkeypatch.setattr(step_module, "require_cuda", lambda *a, **k: None)
    monkeypatch.setattr(GraphedTrainStep, "_device", lambda self: torch.device("cpu"))
    monkeypatch.setattr(step_module, "MemoryMeter", CpuMeter)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def install_replaying(monkeypatch):
    """:func:`run_capture_on_cpu`, and return ``make(optimizer)``, which installs a
    :class:`ReplayingCapture` for ``optimizer`` and returns it."""
    from cudagraphs.train import step_capture

    run_capture_on_cpu(monkeypatch)

    def make(optimizer):
        capture = ReplayingCapture(optimizer)
        monkeypatch.setattr(step_capture, "capture_into_graph", capture)
        return capture

    return make
