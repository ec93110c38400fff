"""CPU test of ``benchmarks/probes/compile_phases.py``'s child: each mode captures the
benchmark's generator (here a tiny Llama through ``aot_eager``) with the measures it
names off, and records the capture's seconds, the memo's counts and dynamo's phases."""

import functools
import sys

import pytest

from helpers.train_bench import load_probe

transformers = pytest.importorskip("transformers")

import cudagraphs.serving.hf as serving_hf_package  # noqa: E402
from cudagraphs import torch_private  # noqa: E402
from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import generator as generator_module  # noqa: E402
from helpers.hf_models import tiny  # noqa: E402


@pytest.fixture
def probe(monkeypatch, serving_hf, fresh_dynamo):
    module = load_probe("compile_phases")
    monkeypatch.setitem(sys.modules, "serving_hf", serving_hf)
    monkeypatch.setattr(serving_hf, "build_model", lambda family: tiny("llama").eval())
    monkeypatch.setattr(serving_hf, "BUCKETS", (1, 2))
    monkeypatch.setattr(serving_hf, "MAX_CACHE_LEN", 24)
    monkeypatch.setattr(serving_hf, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    on_cpu = functools.partial(serving_hf_package.GraphedGenerator, capture_backend=eager_backend)
    monkeypatch.setattr(serving_hf_package, "GraphedGenerator", on_cpu)
    # The child turns measures off for its whole (child) process: put them back here.
    monkeypatch.setattr(generator_module, "start_compile_workers", lambda: True)
    monkeypatch.setattr(
        torch_private, "upstream_caches_subgraph_schemas", lambda: False, raising=True
    )
    return module


@pytest.mark.parametrize("mode", ["both", "neither"])
def test_a_mode_captures_with_its_measures_and_records_the_phases(probe, mode):
    run = probe.child(mode)
    assert run["mode"] == mode and run["capture_s"] > 0
    assert run["subgraph_schemas"]["active"] is (mode == "both")
    assert (run["subgraph_schemas"]["built"] >= 1) is (mode == "both")
    assert run["compile_phases_s"], "dynamo's phases of the compile"
    assert run["torch"] and run["transformers"]
