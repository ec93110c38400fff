"""PartialGraphsCallback with the real capture backend: tiny HF Llama and Qwen3-MoE
trained for 10 optimizer steps through transformers.Trainer with gradient accumulation
2, losses and weights bitwise equal to the same Trainer run without the callback (the
graphs replay the kernels eager runs), replays counted in the logs."""

import copy

import pytest
import torch

from helpers.hf_models import tiny

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cudagraphs.integrations.hf import PartialGraphsCallback  # noqa: E402
from cudagraphs.moe_kernels import GroupedMMProbe  # noqa: E402
from helpers.trainer import losses, train  # noqa: E402


@pytest.mark.parametrize(
    "kind, precision",
    [("llama", {}), ("qwen3_moe", {}), ("llama", {"bf16": True})],
    ids=["llama", "qwen3_moe", "llama-bf16"],
)
def test_trainer_with_the_callback_equals_the_trainer_without_it(tmp_path, kind, precision):
    model = tiny(kind)
    ref = copy.deepcopy(model)
    callback = PartialGraphsCallback(speed_check=False)
    trainer = train(tmp_path, model, [callback], use_cpu=False, **precision)
    reference = train(tmp_path, ref, use_cpu=False, **precision)
    assert callback.off_reason is None
    assert losses(trainer) == losses(reference) and len(losses(trainer)) == 10
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: weights after training"
    # The default scopes: Llama's two layers whole. Qwen3-MoE's grouped_mm experts in
    # float32 are whole too only where torch runs them on the device; else attention
    # and router per layer.
    whole = kind == "llama" or GroupedMMProbe().on_device(torch.zeros(1, device="cuda"))
    targets = 2 if whole else 4
    stats = callback.stats()
    assert stats["captured"] == targets and stats["fallbacks"] == 0, stats
    assert stats["replayed"] == 9 * 2 * targets, stats
    logged = [h["cudagraphs/replayed"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [2 * targets * k for k in range(10)]


def test_evaluation_between_steps_leaves_the_training_graphs_intact(tmp_path):
    model = tiny()
    ref = copy.deepcopy(model)
    callback = PartialGraphsCallback(inference_calls="record", speed_check=False)
    trainer = train(tmp_path, model, [callback], use_cpu=False, steps=6, eval_steps=2)
    reference = train(tmp_path, ref, use_cpu=False, steps=6, eval_steps=2)
    assert losses(trainer) == losses(reference)
    assert losses(trainer, "eval_loss") == losses(reference, "eval_loss")
    stats = callback.stats()
    # Evaluations at steps 2, 4, 6 (4 batches, 2 targets): the first recorded, eagerly.
    assert stats["fallbacks"] == 4 * 2 and stats["replayed"] == 5 * 2 * 2 + 2 * 4 * 2, stats
