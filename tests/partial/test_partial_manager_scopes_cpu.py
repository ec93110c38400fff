"""The manager with scopes (CPU, eager capture backend): whole layers, whole MoE
sublayers and dense MLPs graphed on HF Llama, Qwen3-MoE, Mixtral and DeepSeek-V3, with
losses and every gradient bitwise equal to eager and no fallback; narrowing said and
counted; activation checkpointing with whole layers."""

import copy
import logging

import pytest

from cudagraphs.errors import CudaGraphsTypeError
from cudagraphs.moe_kernels import GroupedMMProbe
from cudagraphs.partial import SCOPES, PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import backend, train_and_compare

KINDS = {
    # per model and scopes: the target kinds, one list entry per layer (2 layers)
    ("llama", SCOPES): ["layer", "layer"],
    ("qwen3_moe", SCOPES): ["layer", "layer"],
    ("mixtral", SCOPES): ["layer", "layer"],
    ("deepseek_v3", SCOPES): ["layer", "layer"],
    ("llama", ("mlp",)): ["mlp", "mlp"],
    ("qwen3_moe", ("moe",)): ["moe", "moe"],
    ("mixtral", ("attention", "moe")): ["attention", "moe", "attention", "moe"],
    # DeepSeek-V3's layer 0 is dense (first_k_dense_replace=1): an MLP there.
    ("deepseek_v3", ("attention", "moe", "mlp")): ["attention", "mlp", "attention", "moe"],
}


@pytest.mark.parametrize("family, scopes", list(KINDS), ids=lambda v: str(v))
def test_scopes_train_equal_to_eager_without_fallbacks(family, scopes):
    model = tiny(family)
    ref = copy.deepcopy(model)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=scopes)
    assert [e.target.kind for e in mgr.recordings] == KINDS[(family, scopes)]
    stats = train_and_compare(model, ref, mgr)
    assert stats["fallbacks"] == 0 and stats["replayed"] == 2 * len(mgr.recordings), stats
    assert not mgr.narrowed and not mgr.skipped
    mgr.close()


def test_eager_experts_narrow_a_layer_to_attention_and_router_said_and_counted(caplog):
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        mgr = PartialCudaGraphManager.from_model_parts(
            model, capture_backend=backend, scopes=SCOPES
        )
    assert [e.target.kind for e in mgr.recordings] == ["attention", "router"] * 2
    assert [b.reason for b in mgr.narrowed] == ["eager_experts"] * 2
    (said,) = [r for r in caplog.records if "narrower scopes" in r.getMessage()]
    assert "eager" in said.getMessage() and "model.layers.0" in said.getMessage()
    stats = train_and_compare(model, ref, mgr)
    assert stats["narrowed_eager_experts"] == 2 and stats["fallbacks"] == 0, stats
    mgr.close()


def test_grouped_mm_that_torch_runs_on_the_host_narrows_each_moe_layer(monkeypatch):
    # What a float32 Qwen3-MoE meets on a GPU (see test_cuda_partial): the probe says
    # grouped GEMM copies offsets to the host, so each layer keeps attention + router.
    monkeypatch.setattr(GroupedMMProbe, "on_device", lambda self, weight: False)
    model = tiny("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    ref = copy.deepcopy(model)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=SCOPES)
    assert [e.target.kind for e in mgr.recordings] == ["attention", "router"] * 2
    assert [b.reason for b in mgr.narrowed] == ["host_grouped_mm"] * 2
    stats = train_and_compare(model, ref, mgr)
    assert stats["narrowed_host_grouped_mm"] == 2 and stats["fallbacks"] == 0, stats
    mgr.close()


def test_the_experts_switch_widens_those_layers_back():
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=backend, scopes=SCOPES, experts_implementation="grouped_mm"
    )
    assert [e.target.kind for e in mgr.recordings] == ["layer", "layer"] and not mgr.narrowed


def test_whole_layers_under_activation_checkpointing_keep_the_checkpoint_inside():
    # transformers 5 checkpoints inside the layer's own forward and recomputes that
    # function, not the module: a whole-layer target replays once per step, with the
    # checkpoint (and its recompute in backward) inside what it runs.
    model = tiny("llama")
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=backend, scopes=("layer",)
    )
    stats = train_and_compare(model, ref, mgr)
    assert stats["fallbacks"] == 0 and stats["replayed"] == 2 * 2, stats


def test_a_retired_switch_is_refused_beside_scopes():
    with pytest.raises(CudaGraphsTypeError, match="attention= and router= are retired"):
        PartialCudaGraphManager.from_model_parts(
            tiny("llama"), capture_backend=backend, scopes=("layer",), attention=False
        )


def test_the_default_is_every_scope():
    model = tiny("qwen3_moe")
    by_default = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend)
    assert [e.target.kind for e in by_default.recordings] == ["layer", "layer"]
    by_default.close()
    attention = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=backend, scopes=("attention",)
    )
    assert [e.target.kind for e in attention.recordings] == ["attention", "attention"]
    attention.close()


def test_a_default_narrowing_is_said_at_info_and_an_asked_one_at_warning(caplog):
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    levels = {}
    for asked in (None, SCOPES):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cudagraphs.partial.manager"):
            mgr = PartialCudaGraphManager.from_model_parts(
                model, capture_backend=backend, scopes=asked
            )
        assert [b.reason for b in mgr.narrowed] == ["eager_experts"] * 2
        (said,) = [r for r in caplog.records if "narrower scopes" in r.getMessage()]
        levels[asked] = said.levelno
        mgr.close()
    assert levels == {None: logging.INFO, SCOPES: logging.WARNING}
