"""PartialGraphsCallback around a real transformers.Trainer on the CPU: graphs off and
said once without a CUDA device; with an eager capture backend standing in for the
core, the whole path (record one optimizer step under gradient accumulation, capture,
replay, stats in the logs, close) with losses equal to a Trainer run without it."""

import copy
import logging

import pytest
import torch

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError  # noqa: E402
from cudagraphs.integrations.hf import PartialGraphsCallback  # noqa: E402
from helpers.trainer import Backend, losses, train  # noqa: E402


def test_without_a_cuda_device_graphs_are_off_said_once_and_training_is_unchanged(tmp_path, caplog):
    model = tiny()
    ref = copy.deepcopy(model)
    callback = PartialGraphsCallback()
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        trainer = train(tmp_path, model, [callback], steps=4)
        train(tmp_path, model, [callback], steps=2)  # a second run: not said again
    reference = train(tmp_path, ref, steps=4)
    off = [r for r in caplog.records if "partial graphs are off" in r.getMessage()]
    assert len(off) == 1 and "no CUDA device" in off[0].getMessage()
    assert callback.off_reason and callback.manager is None and callback.stats() == {}
    assert losses(trainer) == losses(reference) and len(losses(trainer)) == 4
    assert not any(k.startswith("cudagraphs/") for h in trainer.state.log_history for k in h)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_the_whole_path_under_gradient_accumulation_equals_the_run_without_it(tmp_path, kind):
    model = tiny(kind)
    ref = copy.deepcopy(model)
    backend = Backend()
    callback = PartialGraphsCallback(record_step=2, capture_backend=backend)
    trainer = train(tmp_path, model, [callback])
    reference = train(tmp_path, ref)
    assert losses(trainer) == losses(reference) and len(losses(trainer)) == 10
    assert backend.captures == 1 and callback.manager is None, "captured once, closed"
    targets = 2  # the default scopes: each of the two layers whole
    stats = callback.stats()
    # Steps 3-10 replay: two micro-batches per step, each target once per forward.
    assert stats["captured"] == targets and stats["fallbacks"] == 0, stats
    assert stats["replayed"] == 8 * 2 * targets, stats
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["cudagraphs/captured"] for h in logged] == [0] + [targets] * 9
    assert [h["cudagraphs/replayed"] for h in logged] == [0, 0] + [
        2 * targets * k for k in range(1, 9)
    ]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: weights after training"
    layer = model.model.layers[0]
    assert "forward" not in layer.__dict__, "close() gave the module its eager forward back"


def test_evaluation_during_training_runs_eagerly_beside_the_training_graphs(tmp_path):
    model = tiny()
    ref = copy.deepcopy(model)
    callback = PartialGraphsCallback(capture_backend=Backend())
    trainer = train(tmp_path, model, [callback], steps=6, eval_steps=2)
    reference = train(tmp_path, ref, steps=6, eval_steps=2)
    assert losses(trainer) == losses(reference)
    assert losses(trainer, "eval_loss") == losses(reference, "eval_loss")
    assert len(losses(trainer, "eval_loss")) == 3
    stats = callback.stats()
    # 3 evaluations of 4 batches, 2 targets each: eager (inference_calls="ignore").
    assert stats["fallbacks"] == 3 * 4 * 2 and stats["fallback_requires_grad"] == 24, stats
    assert stats["replayed"] == 5 * 2 * 2, stats


def test_the_first_evaluation_is_recorded_when_asked_and_later_ones_replay(tmp_path):
    model = tiny()
    ref = copy.deepcopy(model)
    backend = Backend()
    callback = PartialGraphsCallback(capture_backend=backend, inference_calls="record")
    trainer = train(tmp_path, model, [callback], steps=6, eval_steps=2)
    reference = train(tmp_path, ref, steps=6, eval_steps=2)
    assert losses(trainer) == losses(reference)
    assert losses(trainer, "eval_loss") == losses(reference, "eval_loss")
    assert backend.captures == 2, "the training step, then the first evaluation"
    stats = callback.stats()
    # The first evaluation (step 2) ran eagerly while recorded; the next two replay.
    assert stats["fallbacks"] == 4 * 2, stats
    assert stats["replayed"] == 5 * 2 * 2 + 2 * 4 * 2, stats
    assert stats["captured"] == 4, "a training and an inference variant per target"


def test_recording_starts_at_the_first_step_at_or_after_record_step(tmp_path):
    model = tiny()
    callback = PartialGraphsCallback(record_step=4, capture_backend=Backend())
    trainer = train(tmp_path, model, [callback], steps=6, accumulation=1)
    logged = [h["cudagraphs/captured"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [0, 0, 0, 2, 2, 2]
    assert callback.stats()["replayed"] == 2 * 2


def test_gradient_checkpointing_is_passed_on_and_equal_to_the_run_without_it(tmp_path):
    model = tiny()
    ref = copy.deepcopy(model)
    callback = PartialGraphsCallback(capture_backend=Backend())
    fields = transformers.TrainingArguments.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else None
    extra = {name or "gradient_checkpointing": True}
    trainer = train(tmp_path, model, [callback], steps=4, **extra)
    reference = train(tmp_path, ref, steps=4, **extra)
    assert losses(trainer) == losses(reference)
    stats = callback.stats()
    # Whole layers (the default scopes) hold the checkpoint inside: each replays once
    # per forward, its recompute runs inside its backward graph.
    assert stats["fallbacks"] == 0 and stats["replayed"] == 3 * 2 * 2, stats


def test_a_model_with_nothing_graphable_trains_eagerly_with_the_reason(tmp_path, caplog):
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(128, 16), torch.nn.Linear(16, 128)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.embed(input_ids))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return {"loss": loss, "logits": logits}

    callback = PartialGraphsCallback(capture_backend=Backend())
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        train(tmp_path, Plain(), [callback], steps=2)
    assert callback.off_reason == "nothing graphable was found in the model"
    assert any("nothing graphable found" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "scopes, kinds", [(["moe_router"], {"router"}), (["layer"], {"layer"}), (["moe"], {"moe"})]
)
def test_scopes_choose_the_targets_and_training_is_unchanged(tmp_path, scopes, kinds):
    model = tiny("qwen3_moe")
    ref = copy.deepcopy(model)
    seen = []

    class Spy(PartialGraphsCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if self.manager is not None:
                seen.extend(e.target.kind for e in self.manager.recordings)
            return super().on_step_end(args, state, control, **kwargs)

    callback = Spy(scopes=scopes, capture_backend=Backend())
    trainer = train(tmp_path, model, [callback], steps=3, accumulation=1)
    reference = train(tmp_path, ref, steps=3, accumulation=1)
    assert losses(trainer) == losses(reference)
    assert set(seen) == kinds
    assert callback.stats()["captured"] == 2, "one target per layer"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"scopes": ["attn"]}, CudaGraphsValueError, r"scopes\[0\]"),
        ({"scopes": ["layer", "layer"]}, CudaGraphsValueError, r"scopes\[1\] repeats 'layer'"),
        ({"scopes": "attention"}, CudaGraphsTypeError, r"scopes"),
        ({"record_step": 0}, CudaGraphsValueError, r"^record_step must be an int >= 1"),
        ({"record_step": 1.5}, CudaGraphsTypeError, r"^record_step must be an int, got float"),
        ({"max_variants": 0}, CudaGraphsValueError, r"^max_variants must be an int >= 1"),
        ({"inference_calls": "eager"}, CudaGraphsValueError, r"inference_calls must be"),
        ({"capture_backend": 3}, CudaGraphsTypeError, r"capture_backend must be callable"),
        ({"log_prefix": None}, CudaGraphsTypeError, r"log_prefix must be a str"),
    ],
)
def test_bad_arguments_are_refused_when_the_callback_is_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        PartialGraphsCallback(**kwargs)


def test_it_is_a_trainer_callback():
    assert isinstance(PartialGraphsCallback(), transformers.TrainerCallback)


def test_recording_for_an_evaluation_never_records_training_steps(tmp_path):
    model = tiny()
    callback = PartialGraphsCallback(capture_backend=Backend(), inference_calls="record")
    train(tmp_path, model, [callback], steps=4)  # no evaluation at all
    stats = callback.stats()
    assert stats["captured"] == 2 and stats["fallbacks"] == 0, stats
    assert stats["replayed"] == 3 * 2 * 2, stats


def test_the_model_scope_through_the_trainer_graphs_the_model_with_its_loss(tmp_path):
    # The Trainer calls the model with labels and num_items_in_batch: the whole model,
    # loss included, is one target; its layers stay off while it is graphed.
    from cudagraphs.partial import MODEL_SCOPE, SCOPES

    model = tiny()
    ref = copy.deepcopy(model)
    backend = Backend()
    callback = PartialGraphsCallback(
        record_step=2, capture_backend=backend, scopes=(*SCOPES, MODEL_SCOPE)
    )
    trainer = train(tmp_path, model, [callback])
    reference = train(tmp_path, ref)
    assert losses(trainer) == losses(reference) and len(losses(trainer)) == 10
    stats = callback.stats()
    assert stats["captured"] == 1 and stats["off_in_model_graph"] == 2, stats
    assert stats["replayed"] == 8 * 2 and stats["fallbacks"] == 0, stats
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: weights after training"
    assert "forward" not in model.__dict__, "close() gave the model its eager forward back"
