"""The manager on hybrid and metadata-declared stacks (CPU, eager capture backend):
Jamba (Mamba and attention layers), Qwen3-Next (linear and full attention), GPT-2
(Conv1D attention): targets from the model's own metadata, skipped blocks counted in
stats() and said once at WARNING, and training steps equal to eager."""

import copy
import logging

import pytest
import torch

from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny_arch

NARROW = ("attention", "moe_router")  # the first release's scopes


def backend(callables, sample_args, sample_kwargs):
    return list(callables)


def loss_of(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


@pytest.mark.parametrize(
    "family, targets, skipped",
    [
        # Jamba: routers in the Mamba layers 0 and 2, attention in layer 1; layer 3 is
        # a dense Mamba layer with nothing graph-safe.
        ("jamba", ["model.layers.0", "model.layers.1", "model.layers.2"], ["model.layers.3"]),
        # Qwen3-Next: full attention in 1 and 3, routers in 0, 1, 3; layer 2 is linear
        # attention with a dense MLP: skipped, its linear attention never "attention".
        (
            "qwen3_next",
            ["model.layers.0", "model.layers.1", "model.layers.3"],
            ["model.layers.2"],
        ),
        ("gpt2", ["transformer.h.0", "transformer.h.1"], []),
    ],
)
def test_hybrid_stacks_train_equal_to_eager_with_skipped_blocks_counted(
    family, targets, skipped, caplog
):
    # No dropout: the reference must draw the same (no) random numbers.
    no_dropout = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}
    model = tiny_arch(family, **no_dropout.get(family, {}))
    model.train()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        mgr = PartialCudaGraphManager.from_model_parts(
            model, capture_backend=backend, scopes=NARROW
        )
    assert sorted({e.target.block for e in mgr.recordings}) == targets
    assert [b.name for b in mgr.skipped] == skipped
    assert all(b.reason == "no_graph_safe_scope" for b in mgr.skipped)
    said = [r for r in caplog.records if "hold nothing graph-safe" in r.getMessage()]
    assert len(said) == (1 if skipped else 0)
    if skipped:
        assert all(name in said[0].getMessage() for name in skipped)
        assert "include=" in said[0].getMessage()
    assert not any("linear_attn" in e.name for e in mgr.recordings)
    train_equal(model, ref, mgr)
    stats = mgr.stats()
    assert stats.get("skipped_no_graph_safe_scope", 0) == len(skipped), stats
    mgr.close()


def train_equal(model, ref, mgr):
    """Record step 0, capture, two more steps: every loss and gradient equals eager's,
    every target replays each step, nothing falls back."""
    gen = torch.Generator().manual_seed(0)
    mgr.start_recording()
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        loss, ref_loss = loss_of(model, ids), loss_of(ref, ids)
        loss.backward()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), f"step {step}"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if step == 0:
            mgr.capture()
    stats = mgr.stats()
    assert stats["replayed"] == 2 * len(mgr.recordings) and stats["fallbacks"] == 0, stats


@pytest.mark.parametrize(
    "family, kinds, narrowed",
    [
        # Mamba layers keep state: never whole. Their MoE or dense MLP is graphed.
        (
            "jamba",
            {"model.layers.0.feed_forward": "moe", "model.layers.1": "layer"}
            | {"model.layers.2.feed_forward": "moe", "model.layers.3.feed_forward": "mlp"},
            ["model.layers.0", "model.layers.2", "model.layers.3"],
        ),
        # Linear-attention layers likewise; the full-attention ones are graphed whole.
        (
            "qwen3_next",
            {"model.layers.0.mlp": "moe", "model.layers.1": "layer"}
            | {"model.layers.2.mlp": "mlp", "model.layers.3": "layer"},
            ["model.layers.0", "model.layers.2"],
        ),
        ("gpt2", {"transformer.h.0": "layer", "transformer.h.1": "layer"}, []),
    ],
)
def test_by_default_each_layer_is_graphed_as_widely_as_is_safe(family, kinds, narrowed, caplog):
    no_dropout = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}
    model = tiny_arch(family, **no_dropout.get(family, {}))
    model.train()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="cudagraphs.partial.manager"):
        mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend)
    assert {e.name: e.target.kind for e in mgr.recordings} == kinds
    assert not mgr.skipped
    assert [(b.name, b.reason) for b in mgr.narrowed] == [(n, "no_attention") for n in narrowed]
    # Not asked for: a narrowing by default is news (INFO), not a WARNING.
    said = [r for r in caplog.records if "narrower scopes" in r.getMessage()]
    assert [r.levelno for r in said] == ([logging.INFO] if narrowed else [])
    train_equal(model, ref, mgr)
    assert mgr.stats().get("narrowed_no_attention", 0) == len(narrowed)
    mgr.close()
