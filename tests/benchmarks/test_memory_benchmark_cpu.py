"""CPU tests of ``benchmarks/memory.py``'s pure logic: the largest-batch search against
a brute-force reference, the ratios to each variant's eager reference, and the
targets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import script


def _mem():
    return script("memory")


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(0, 600), start=st.integers(1, 64), limit=st.integers(1, 512))
def test_largest_finds_the_brute_force_answer_of_a_monotone_probe(threshold, start, limit):
    mem = _mem()
    best, probes = mem.largest(lambda b: b <= threshold, start, limit)
    want = max((b for b in range(1, limit + 1) if b <= threshold), default=0)
    assert best == want
    # Every probe's answer is the probe's, and no batch is probed twice.
    assert all(ok == (b <= threshold) for b, ok in probes)
    assert len({b for b, _ in probes}) == len(probes)
    assert len(probes) <= 2 * limit.bit_length() + 2


def _run(reserved, allocated=1, ok=True):
    return {
        "ok": ok,
        "reserved": reserved,
        "allocated": allocated,
        "steady_reserved": reserved,
        "steady_allocated": allocated,
    }


def test_ratios_are_to_each_variants_own_eager_reference():
    mem = _mem()
    got = mem.ratios(
        {
            "eager": _run(100, 10),
            "graph_train_step": _run(105, 12),
            "trainer_eager": _run(200),
            "trainer_callback": _run(230),
            "partial_model": _run(300, ok=False),
        }
    )
    assert got["graph_train_step"]["reserved"] == 1.05
    assert got["graph_train_step"]["allocated"] == 1.2
    assert got["trainer_callback"]["reserved"] == 1.15
    assert "partial_model" not in got  # it did not run: no ratio, no target


def test_targets_take_the_worst_shape_and_need_an_eager_batch():
    mem = _mem()
    shape_ratios = {
        "small": {"graph_train_step": {"reserved": 1.02}, "graph_stack": {"reserved": 1.2}},
        "mid": {"graph_train_step": {"reserved": 1.12}},
    }
    searched = {
        "graph_train_step": {"eager": {"largest_batch": 9}, "graphed": {"largest_batch": 9}},
        "partial_default": {"eager": {"largest_batch": 9}, "graphed": {"largest_batch": 8}},
        "graphed_generator": {"hf_static": {"largest_batch": 0}, "graphed": {"largest_batch": 0}},
    }
    got = mem.targets(shape_ratios, searched)
    assert got == {
        "graph_train_step_peak_reserved_le_1.10x_eager": False,
        "graph_stack_peak_reserved_le_1.10x_eager": False,
        "graph_train_step_largest_batch_ge_eager": True,
        "partial_default_largest_batch_ge_eager": False,
        "graphed_generator_largest_batch_ge_eager": False,
    }


def test_every_searched_variant_is_searched_once_and_each_layer_gets_its_reference(
    monkeypatch,
):
    mem = _mem()
    calls = []

    def fake_search(variant, shape, cap, start, limit):
        calls.append((variant, shape, cap, start, limit))
        return {"largest_batch": len(variant), "probes": []}

    monkeypatch.setattr(mem, "search", fake_search)
    got = mem.search_all(6.0, 3.5, jobs=3)
    assert sorted(calls) == sorted(
        [
            ("eager", "small", 6.0, 16, 512),
            ("graph_train_step", "small", 6.0, 16, 512),
            ("partial_default", "small", 6.0, 16, 512),
            ("hf_static", "mid", 3.5, 32, 512),
            ("graphed_generator", "mid", 3.5, 32, 512),
        ]
    )
    assert got == {
        layer: {
            ref: {"largest_batch": len(ref), "probes": []},
            "graphed": {"largest_batch": len(layer), "probes": []},
        }
        for layer, ref in mem.SEARCHED.items()
    }
