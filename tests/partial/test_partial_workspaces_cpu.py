"""What a partial capture does to memory around its captures: after the first release
the optimizers that stepped while recording have their state packed
(``optimizer_state``), again after the captures and the second release, and then the
eager cuBLAS workspaces are placed
(``memory.place_cublas_workspaces`` runs a matmul forward and backward: the two
threads' workspaces) right after the last release, only where eager model code
remains beside the graphs (not under the ``"model"`` scope graphed whole). Neither
under ``CUDAGRAPHS_KEEP_CACHE=1`` or ``CUDAGRAPHS_DISABLE=1``; no packing under
``CUDAGRAPHS_COMPACT_STATE=0``. CUDA is stood in for."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from cudagraphs import memory, optimizer_state
from cudagraphs.partial import MODEL_SCOPE, PartialCudaGraphManager, graphing
from cudagraphs.partial.vocabulary import MODEL_KIND
from cudagraphs.settings import COMPACT_STATE_ENV, DISABLE_ENV
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
    """The release, the packing, the workspaces' drop and their placement stood in
    for, each recorded in order."""
    events: list[str] = []
    monkeypatch.setattr(
        graphing, "release_unused_cache", lambda device, why: events.append("release") or 0
    )
    monkeypatch.setattr(
        graphing, "place_cublas_workspaces", lambda device: events.append(f"place:{device}")
    )
    monkeypatch.setattr(graphing, "clear_cublas_workspaces", lambda: events.append("drop"))
    monkeypatch.setattr(
        optimizer_state,
        "compact_fragmented",
        lambda optimizers, device, what, in_no_graph=False: (
            events.append(f"compact:{len(list(optimizers))}") or (4096, 1024)
        ),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(memory.KEEP_CACHE_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(COMPACT_STATE_ENV, raising=False)
    return events


def _captured(scopes, optimizer_steps: tuple[str, ...] = ()) -> PartialCudaGraphManager:
    """A manager recorded on one step and captured; ``optimizer_steps`` says when an
    optimizer steps: ``"before"`` recording, ``"inside"`` it, ``"after"`` capture."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # Another model's optimizer, stepping inside the recording too: never packed.
    other = torch.nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.0)
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=scopes, speed_check=False
    )
    ids = torch.randint(0, 128, (1, 8))
    if "before" in optimizer_steps:
        step(model, ids)
        opt.step()
    mgr.start_recording()
    step(model, ids)
    if "inside" in optimizer_steps:
        opt.step()
    other(torch.ones(1, 2)).sum().backward()
    other_opt.step()
    mgr.capture()
    if "after" in optimizer_steps:
        step(model, ids)
        opt.step()
    return mgr


def test_default_scopes_place_the_workspaces_once_after_the_last_release(placed):
    assert _captured(NARROW).stats()["captured"] == 2
    assert placed == ["drop", "release", "release", "place:0"]


def test_an_optimizer_that_stepped_while_recording_is_packed_then_released(placed):
    mgr = _captured(NARROW, ("before", "inside", "after"))
    assert placed == ["drop", "release", "compact:1", "release", "compact:1", "place:0"]
    stats = mgr.stats()
    assert stats["compacted_state_bytes"] == 2 * 4096 and stats["released_bytes"] == 2 * 1024


def test_optimizers_that_stepped_only_outside_the_recording_are_not_packed(placed):
    mgr = _captured(NARROW, ("before", "after"))
    assert placed == ["drop", "release", "release", "place:0"]
    assert "compacted_state_bytes" not in mgr.stats()


def test_packing_is_off_under_its_variable(placed, monkeypatch):
    monkeypatch.setenv(COMPACT_STATE_ENV, "0")
    _captured(NARROW, ("inside",))
    assert placed == ["drop", "release", "release", "place:0"]


def test_the_model_scope_packs_the_state_too(placed):
    _captured((MODEL_SCOPE,), ("inside",))
    assert placed == ["drop", "release", "compact:1", "release", "compact:1"]


def test_the_model_scope_graphed_whole_places_none(placed):
    # One graph, the whole model's: the eager code left is the optimizer's.
    assert _captured((MODEL_SCOPE,)).stats()["captured"] == 1
    assert placed == ["drop", "release", "release"]


@pytest.mark.parametrize("env", [memory.KEEP_CACHE_ENV, DISABLE_ENV])
def test_nothing_is_placed_when_the_cache_is_kept_or_graphs_are_off(placed, monkeypatch, env):
    monkeypatch.setenv(env, "1")
    _captured(NARROW, ("inside",))
    assert not [e for e in placed if e.startswith(("place", "compact", "drop"))]


def test_no_cuda_places_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(graphing, "place_cublas_workspaces", lambda device: calls.append(device))
    assert graphing.place_workspaces(True, []) is False and calls == []


def test_no_cuda_packs_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(
        optimizer_state,
        "compact_fragmented",
        lambda o, d, w, in_no_graph=False: calls.append(d) or (1, 1),
    )
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert graphing.compact_stepped(True, [opt], []) == (0, 0) and calls == []
