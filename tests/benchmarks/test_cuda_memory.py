"""On the GPU: every graphed layer holds at most 1.10x the device memory its eager run
of the same work reserves at its peak, on the benchmark's ``small`` shape (HF Llama, 8
layers, hidden 512, batch 4, seq 512, bf16), each variant in its own process as
``benchmarks/memory.py`` runs them. The benchmark carries the numbers of every shape;
this test asserts the contract, and that the graphs replayed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import script

pytestmark = pytest.mark.cuda

pytest.importorskip("transformers")

TRAIN_LAYERS = (
    "graph_train_step",
    "graph_stack",
    "make_graphed_callables",
    "partial_default",
    "partial_model",
    "trainer_callback",
    # Captured after two eager steps, the optimizer's state made (and packed).
    "graph_train_step_late",
    "graph_stack_late",
    "make_graphed_callables_late",
)
SERVING_LAYERS = ("graphed_generator", "graph_runner")
LAYERS = (*TRAIN_LAYERS, *SERVING_LAYERS)


@pytest.fixture(scope="module")
def measured():
    mem = script("memory")
    runs = [
        (v, "small", mem.SHAPES["small"].batch) for v in ("eager", "trainer_eager", *TRAIN_LAYERS)
    ]
    # Serving on the benchmark's decode config (the mid model): on the small one the
    # fixed cost of a capture stream's cuBLAS workspace alone is a tenth of eager's.
    runs += [
        (v, "mid", mem.DECODE["batch"]) for v in ("hf_static", "runner_eager", *SERVING_LAYERS)
    ]
    with ThreadPoolExecutor(4) as pool:
        futures = {v: pool.submit(mem._spawn, v, shape, batch) for v, shape, batch in runs}
        results = {v: f.result() for v, f in futures.items()}
    return mem, results


@pytest.mark.parametrize("layer", LAYERS)
def test_graphed_peak_reserved_is_within_1_10x_of_eager(measured, layer):
    mem, results = measured
    got, base = results[layer], results[mem.REFERENCE[layer]]
    assert got.get("ok") and base.get("ok"), (got.get("error"), base.get("error"))
    ratio = got["reserved"] / base["reserved"]
    assert ratio <= mem.RATIO_TARGET, (layer, ratio, got, base)
    info = got["info"]
    stats = info.get("stats")
    if stats is not None:  # partial graphs and the callback: they replayed, never fell back
        assert stats["captured"] > 0 and stats["replayed"] > 0 and stats["fallbacks"] == 0, stats
    account = info.get("account")
    if layer not in ("trainer_callback", "partial_default", "partial_model"):
        assert account is not None and account["pool_reserved_bytes"] > 0, info


@pytest.mark.parametrize("layer", TRAIN_LAYERS)
def test_graphed_peak_allocated_is_within_1_05x_of_eager_beyond_the_static_buffers(measured, layer):
    mem, results = measured
    got, base = results[layer], results[mem.REFERENCE[layer]]
    assert got.get("ok") and base.get("ok"), (got.get("error"), base.get("error"))
    static = mem.static_bytes(got)
    assert static > 0, got["info"]  # every layer's graphs own some
    ratio = (got["allocated"] - static) / base["allocated"]
    assert ratio <= mem.ALLOCATED_TARGET, (
        layer,
        ratio,
        static,
        got["allocated"],
        base["allocated"],
    )
