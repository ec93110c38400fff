"""make_graphed_callables over a compiled callable whose frame dynamo gives up on first
inside the captures (its recompile limit, after a Python value it reads changed): the
frame ran eagerly there, so the graphs hold its eager kernels and stay; it is said at
WARNING, and the callable is returned graphed. Driven on the CPU with the device calls
stood in (``helpers.stand_in_capture``), through dynamo's real records."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo

from cudagraphs.core import api
from helpers.stand_in_capture import StandInCapture
from helpers.stand_in_train_step import CpuMeter, CpuPool


class _Meter(CpuMeter):
    def finish(self, *args, **kwargs):
        return SimpleNamespace(summary=lambda: "stood in")


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_frame_given_up_inside_the_captures_is_said_and_its_graphs_kept(monkeypatch, caplog):
    monkeypatch.setattr(api, "require_cuda", lambda *a, **k: None)
    monkeypatch.setattr(api, "check_devices", lambda plan: torch.device("cpu", 0))
    monkeypatch.setattr(api, "MemoryMeter", _Meter)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    stand_in = StandInCapture().install(monkeypatch)

    state = {"offset": 0.0}

    def f(x):
        return x * 2 + state["offset"]

    compiled = torch.compile(f, backend="eager")
    x = torch.randn(8, requires_grad=True)

    def after_warmup():  # the captures see a value the warmup's code was not compiled for
        state["offset"] = 1.0

    caplog.set_level(logging.WARNING, logger="cudagraphs.core.api")
    with torch._dynamo.config.patch(recompile_limit=1):
        graphed = api.make_graphed_callables(
            compiled, (x,), post_warmup_hook=after_warmup, pool=CpuPool()
        )
    said = [r.getMessage() for r in caplog.records if "gave up compiling" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("make_graphed_callables: dynamo gave up")
    # Forward and backward captured, neither released (the stand-in's graphs cannot
    # replay: the GPU tests replay compiled captures).
    assert len(stand_in.graphs) == 2 and not any(g.resets for g in stand_in.graphs)
    assert callable(graphed)
