"""``partial.graphing.release_cached``: around a manager's captures on CUDA, the
allocator's unused cache goes back to the driver, on the current device, said as the
partial graphs' capture; elsewhere (CPU, CUDA never initialized, or not asked)
nothing is released. The CUDA state is stood in for."""

from __future__ import annotations

import pytest
import torch

from cudagraphs.partial import graphing


@pytest.fixture
def released(monkeypatch):
    calls = []

    def release(device, why):
        calls.append((device, why))
        return 4096

    monkeypatch.setattr(graphing, "release_unused_cache", release)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    return calls


@pytest.mark.parametrize(
    ("active", "available", "initialized", "releases"),
    [
        (True, True, True, True),
        (False, True, True, False),  # not asked (CPU module, or disabled)
        (True, False, False, False),  # no CUDA
        (True, True, False, False),  # CUDA never used: nothing cached to give back
        (False, False, True, False),
    ],
)
def test_the_cache_is_released_only_when_asked_on_an_initialized_cuda(
    released, monkeypatch, active, available, initialized, releases
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    got = graphing.release_cached(active)
    assert released == ([(3, "partial graphs capture")] if releases else [])
    assert got == (4096 if releases else 0)


@pytest.mark.parametrize("keep", [False, True])
def test_the_workspaces_are_dropped_before_the_release_unless_the_cache_is_kept(
    released, monkeypatch, keep
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    if keep:
        monkeypatch.setenv(graphing.KEEP_CACHE_ENV, "1")
    else:
        monkeypatch.delenv(graphing.KEEP_CACHE_ENV, raising=False)
    monkeypatch.setattr(graphing, "clear_cublas_workspaces", lambda: released.append("drop"))
    graphing.release_cached(True, drop_workspaces=True)
    # The release itself is stood in for, so it runs under either setting here.
    assert released == ([] if keep else ["drop"]) + [(3, "partial graphs capture")]
    released.clear()
    graphing.release_cached(True)
    assert released == [(3, "partial graphs capture")]
