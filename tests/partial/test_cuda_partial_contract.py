"""The partial-graph contract on a GPU (issue 13): CUDAGRAPHS_DISABLE=1 trains through
the same path with no graph and results equal to eager, and every quiet eager run of
the real (graphed) path is said once per cause at WARNING while all are counted."""

import copy
import logging

import pytest
import torch

import cudagraphs.core
from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import step_both_and_compare

pytestmark = pytest.mark.cuda

LOGGER = "cudagraphs.partial.manager"
TARGETS = {"llama": 2, "qwen3_moe": 4}  # attention (+ router) per layer, 2 layers
NARROW = ("attention", "moe_router")  # the scopes these tests count


def batches(seed, n, seq=16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 128, (2, seq), device="cuda", generator=gen) for _ in range(n)]


def fallback_warnings(caplog, reason):
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and f"ran eagerly (reason {reason!r})" in r.getMessage()
    ]


def ours(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


class RefusedGraph:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a CUDA graph was created under CUDAGRAPHS_DISABLE=1")


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_disabled_training_equals_eager_and_captures_no_graph(kind, monkeypatch, caplog):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError("make_graphed_callables ran under CUDAGRAPHS_DISABLE=1")

    monkeypatch.setattr(cudagraphs.core, "make_graphed_callables", refuse)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RefusedGraph)
    model = tiny(kind).cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    mgr = PartialCudaGraphManager.from_model_parts(model, speed_check=False, scopes=NARROW)
    steps = batches(7, 4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mgr.start_recording()
        try:
            for i, ids in enumerate(steps):
                step_both_and_compare(model, ref, ids, i)
                opt.step()
                ref_opt.step()
                opt.zero_grad()
                ref_opt.zero_grad()
                if i == 0:
                    mgr.capture()
            stats = mgr.stats()
        finally:
            mgr.close()
    assert stats["disabled"] == 1 and stats["captured"] == 0, stats
    # Every step after the recording one went through contract matching.
    assert stats["replayed"] == TARGETS[kind] * (len(steps) - 1), stats
    assert stats["fallbacks"] == 0, stats
    said = [r for r in caplog.records if "partial graphs are disabled" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_fallbacks_of_graphed_targets_are_said_once_per_cause(caplog):
    model = tiny("llama").cuda()
    ref = copy.deepcopy(model)
    mgr = PartialCudaGraphManager.from_model_parts(model, speed_check=False, scopes=NARROW)
    mgr.start_recording()
    try:
        (first, *same) = batches(3, 3)
        step_both_and_compare(model, ref, first, 0)
        model.zero_grad()
        ref.zero_grad()
        mgr.capture()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for i, ids in enumerate(same, start=1):
                step_both_and_compare(model, ref, ids, i)
                model.zero_grad()
                ref.zero_grad()
            assert mgr.stats()["replayed"] == 4 and mgr.stats()["fallbacks"] == 0
            assert ours(caplog) == [], "replays say nothing"

            for i, ids in enumerate(batches(4, 3, seq=24), start=10):
                step_both_and_compare(model, ref, ids, i)
                model.zero_grad()
                ref.zero_grad()
            model.eval()
            with torch.no_grad():
                for ids in batches(5, 2):
                    model(input_ids=ids, use_cache=False)
            model.train()
            # A re-allocated parameter (as .data assignment does): the graph would read
            # freed memory, so that target runs eagerly, with equal results.
            weight = model.model.layers[0].self_attn.q_proj.weight
            weight.data = weight.data.clone()
            for i, ids in enumerate(batches(6, 2), start=20):
                step_both_and_compare(model, ref, ids, i)
                model.zero_grad()
                ref.zero_grad()
        stats = mgr.stats()
    finally:
        mgr.close()
    # 2 targets: 3 steps at a new length; 2 no-grad eval forwards (hidden states no
    # longer require grad, which REASONS orders first); layer 0 alone for 2 steps.
    assert stats["fallback_shape"] == 6, stats
    assert stats["fallback_requires_grad"] == 4, stats
    assert stats["fallback_param_storage"] == 2, stats
    assert stats["replayed"] == 4 + 2, stats
    assert stats["captured"] == 2 and stats["disabled"] == 0, stats
    (shape,) = fallback_warnings(caplog, "shape")
    assert "model.layers.0.self_attn ran eagerly" in shape.getMessage()
    assert (
        "kwargs['hidden_states']: shape expected (2, 16, 64), received (2, 24, 64)"
        in shape.getMessage()
    )
    (no_grad,) = fallback_warnings(caplog, "requires_grad")
    assert "torch.is_grad_enabled(): grad_mode expected True, received False" in (
        no_grad.getMessage()
    )
    (storage,) = fallback_warnings(caplog, "param_storage")
    assert "model.layers.0.self_attn ran eagerly" in storage.getMessage()
    assert len(ours(caplog)) == 3, [r.getMessage() for r in ours(caplog)]
