"""``memory.RecordingSegments`` and the manager around it: from ``start_recording`` to
``stop_recording`` / ``capture`` / ``close`` the caching allocator makes expandable
segments, once, on an initialized CUDA, unless ``CUDAGRAPHS_EXPANDABLE_RECORDING=0``.
The allocator scope and the CUDA state are stood in for."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cudagraphs import memory
from cudagraphs.errors import CudaGraphsStateError, CudaGraphsValueError
from cudagraphs.partial import PartialCudaGraphManager
from cudagraphs.settings import EXPANDABLE_RECORDING_ENV
from helpers.hf_models import tiny
from helpers.partial_manager import NARROW, eager_backend, step


@pytest.fixture
def scopes(monkeypatch):
    """Every entry (+1) and exit (-1) of the stood-in allocator scope, in order."""
    events: list[int] = []

    @contextlib.contextmanager
    def expandable():
        events.append(+1)
        try:
            yield
        finally:
            events.append(-1)

    monkeypatch.setattr(memory, "expandable_segments", expandable)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv(EXPANDABLE_RECORDING_ENV, raising=False)
    return events


def test_enter_and_leave_are_idempotent(scopes):
    seg = memory.RecordingSegments()
    seg.enter()
    seg.enter()
    assert scopes == [+1] and seg.active
    seg.leave()
    seg.leave()
    assert scopes == [+1, -1] and not seg.active
    seg.enter()  # a later recording enters again
    seg.leave()
    assert scopes == [+1, -1, +1, -1]


@pytest.mark.parametrize(
    ("env", "available", "initialized", "enters"),
    [
        (None, True, True, True),
        ("1", True, True, True),
        ("0", True, True, False),
        ("off", True, True, False),
        (None, False, False, False),  # no CUDA
        (None, True, False, False),  # CUDA never used: nothing to make segments for
    ],
)
def test_entered_only_on_initialized_cuda_unless_turned_off(
    scopes, monkeypatch, env, available, initialized, enters
):
    if env is not None:
        monkeypatch.setenv(EXPANDABLE_RECORDING_ENV, env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    seg = memory.RecordingSegments()
    seg.enter()
    assert seg.active is enters and scopes == ([+1] if enters else [])
    seg.leave()
    assert scopes == ([+1, -1] if enters else [])


def test_a_bad_value_names_the_variable_and_enters_nothing(scopes, monkeypatch):
    monkeypatch.setenv(EXPANDABLE_RECORDING_ENV, "maybe")
    seg = memory.RecordingSegments()
    with pytest.raises(CudaGraphsValueError, match=EXPANDABLE_RECORDING_ENV):
        seg.enter()
    assert scopes == [] and not seg.active


def _manager() -> PartialCudaGraphManager:
    return PartialCudaGraphManager.from_model_parts(
        [tiny()], capture_backend=eager_backend, scopes=NARROW
    )


@pytest.mark.parametrize("end", ["stop_recording", "close"])
def test_the_manager_scopes_the_recording_step(scopes, end):
    mgr = _manager()
    mgr.start_recording()
    assert scopes == [+1] and mgr.recording
    mgr.start_recording()  # again while recording: still one scope
    assert scopes == [+1]
    getattr(mgr, end)()
    assert scopes == [+1, -1] and not mgr.recording


def test_capture_leaves_the_scope_before_anything_else_also_when_it_raises(scopes):
    mgr = _manager()
    mgr.start_recording()
    with pytest.raises(CudaGraphsStateError, match="start_recording"):
        mgr.capture()  # nothing was recorded
    assert scopes == [+1, -1] and not mgr.recording
    mgr.start_recording()  # the next recording scopes again
    assert scopes == [+1, -1, +1]
    mgr.close()
    assert scopes == [+1, -1, +1, -1]


def test_a_recorded_step_and_its_capture_scope_once(scopes, monkeypatch):
    from cudagraphs.partial import graphing

    at_release = []
    monkeypatch.setattr(
        graphing, "release_unused_cache", lambda device, why: at_release.append(list(scopes)) or 0
    )
    monkeypatch.setattr(graphing, "place_cublas_workspaces", lambda device: None)
    monkeypatch.setattr(graphing, "clear_cublas_workspaces", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    step(model, torch.randint(0, 128, (1, 8)))
    assert scopes == [+1]
    mgr.capture()
    # Left before the release that gives the step's free pages back.
    assert at_release and at_release[0] == [+1, -1]
    assert scopes == [+1, -1] and mgr.stats()["captured"] > 0
