"""Fixtures of the training benchmarks' CPU tests: the benchmark scripts loaded as
modules (``ts``: ``benchmarks/train_step.py``, ``pt``: ``benchmarks/partial_train.py``)
and ``cpu``, their CUDA calls made harmless on the CPU."""

import sys

import pytest
import torch

from _train_bench import BENCH, _load


@pytest.fixture(scope="module")
def ts():
    # The scripts import their siblings (_report, train_step) by name.
    sys.path.insert(0, str(BENCH))
    try:
        return _load("train_step")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def pt(ts):
    sys.path.insert(0, str(BENCH))
    try:
        return _load("partial_train")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture
def cpu(ts, monkeypatch):
    """The benchmark's CUDA calls made harmless on the CPU: device ``cpu``, no-op
    synchronize (the timing helper and ``free_memory`` call it)."""
    monkeypatch.setattr(ts, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return ts
