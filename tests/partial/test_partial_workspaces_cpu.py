"""Eager cuBLAS workspaces placed after a partial capture: ``memory.place_cublas_workspaces``
runs a matmul forward and backward (the two threads' workspaces), and the manager
makes them right after its last release, only where eager model code remains beside
the graphs (not under the ``"model"`` scope graphed whole), never under
``CUDAGRAPHS_KEEP_CACHE=1`` or ``CUDAGRAPHS_DISABLE=1``. CUDA is stood in for."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from cudagraphs import memory
from cudagraphs.partial import MODEL_SCOPE, PartialCudaGraphManager, graphing
from cudagraphs.partial.vocabulary import MODEL_KIND
from cudagraphs.settings import DISABLE_ENV
from helpers.hf_models import tiny
from helpers.partial_manager import NARROW, eager_backend, step


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.mm:
            self.mm += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_matmul_runs_forward_and_backward_and_the_callers_mode_is_kept(mode):
    with mode(), _CountMatmuls() as counted:
        assert memory.place_cublas_workspaces("cpu") is None
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() is (mode is torch.inference_mode)
    # One forward matmul, and the backward's (the gradient of a @ a takes two).
    assert counted.mm == 3


@dataclass
class _Rec:
    kind: str
    off_reason: str | None
    graphed: bool

    @property
    def target(self):
        return self

    def graphs(self):
        return [object()] if self.graphed else []


_RECS = st.lists(
    st.builds(
        _Rec,
        kind=st.sampled_from([MODEL_KIND, "layer", "attention"]),
        off_reason=st.sampled_from([None, "slower", "in_model_graph"]),
        graphed=st.booleans(),
    ),
    max_size=5,
)


@given(_RECS)
def test_eager_code_remains_unless_every_whole_part_is_graphed_and_on(recs):
    # The rule as a plain loop: no eager model code only where at least one whole
    # part was recorded and each of them is on with a graph.
    wholes_all_graphed, saw_whole = True, False
    for r in recs:
        if r.kind == MODEL_KIND:
            saw_whole = True
            if r.off_reason is not None or not r.graphed:
                wholes_all_graphed = False
    assert graphing.eager_code_remains(recs) is (not (saw_whole and wholes_all_graphed))


@pytest.fixture
def placed(monkeypatch):
    """The release and the placement stood in for: each placement records what the
    releases were at that moment."""
    events: list[str] = []
    monkeypatch.setattr(
        graphing, "release_unused_cache", lambda device, why: events.append("release") or 0
    )
    monkeypatch.setattr(
        graphing, "place_cublas_workspaces", lambda device: events.append(f"place:{device}")
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(memory.KEEP_CACHE_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return events


def _captured(scopes) -> PartialCudaGraphManager:
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=scopes, speed_check=False
    )
    mgr.start_recording()
    step(model, torch.randint(0, 128, (1, 8)))
    mgr.capture()
    return mgr


def test_default_scopes_place_the_workspaces_once_after_the_last_release(placed):
    assert _captured(NARROW).stats()["captured"] == 2
    assert placed == ["release", "release", "place:0"]


def test_the_model_scope_graphed_whole_places_none(placed):
    # One graph, the whole model's: the eager code left is the optimizer's.
    assert _captured((MODEL_SCOPE,)).stats()["captured"] == 1
    assert placed == ["release", "release"]


@pytest.mark.parametrize("env", [memory.KEEP_CACHE_ENV, DISABLE_ENV])
def test_nothing_is_placed_when_the_cache_is_kept_or_graphs_are_off(placed, monkeypatch, env):
    monkeypatch.setenv(env, "1")
    _captured(NARROW)
    assert not [e for e in placed if e.startswith("place")]


def test_no_cuda_places_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(graphing, "place_cublas_workspaces", lambda device: calls.append(device))
    assert graphing.place_workspaces(True, []) is False and calls == []
