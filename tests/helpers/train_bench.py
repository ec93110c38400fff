"""Helpers of the training benchmarks' CPU tests (tests/benchmarks/test_*_benchmark*_cpu.py):
the benchmark scripts loaded as modules, and a tiny benchmark config."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_probe(name: str):
    """``benchmarks/probes/<name>.py`` loaded afresh as a module (not registered in
    ``sys.modules``: each test module gets its own copy to patch)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / "probes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny(ts, **kw):
    cfg = ts.BenchConfig("tiny", ts.BlockConfig(32, 2, 64), 1, 8, iters=2, repeats=3)
    return ts.replace(cfg, **kw)
