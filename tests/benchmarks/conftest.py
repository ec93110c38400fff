"""Fixtures of the benchmarks' CPU tests: the benchmark scripts loaded as modules
(``ts``: ``benchmarks/train_step.py``, ``pt``: ``benchmarks/partial_train.py``,
``serving_decode`` and ``serving_hf``) and ``cpu``, the training scripts' CUDA calls
made harmless on the CPU."""

import sys

import pytest
import torch

from helpers.train_bench import BENCH, _load


def script(name: str):
    """``benchmarks/<name>.py`` loaded as the module ``name`` (once per session)."""
    # The scripts import their siblings (_report, train_step) by name.
    sys.path.insert(0, str(BENCH))
    try:
        return _load(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def ts():
    return script("train_step")


@pytest.fixture(scope="module")
def pt(ts):
    return script("partial_train")


@pytest.fixture(scope="module")
def serving_decode():
    return script("serving_decode")


@pytest.fixture(scope="module")
def serving_hf():
    return script("serving_hf")


@pytest.fixture
def cpu(ts, monkeypatch):
    """The benchmark's CUDA calls made harmless on the CPU: device ``cpu``, no-op
    synchronize (the timing helper and ``free_memory`` call it)."""
    monkeypatch.setattr(ts, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return ts
