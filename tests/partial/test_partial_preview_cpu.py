"""plan_targets previews what the manager graphs (CPU): with the same ``scopes`` and
``include`` (``None`` included: the default, every scope), the manager's targets, its
skipped and its narrowed blocks are the plan's, for a dense model, MoE models whose
experts are static, run on the host or loop eagerly, and hybrids of attention and
Mamba or linear-attention layers."""

import pytest

from cudagraphs.partial import MODEL_SCOPE, SCOPES, PartialCudaGraphManager, plan_targets
from helpers.hf_models import tiny, tiny_arch
from helpers.moe_models import probe_says


def eager_backend(callables, sample_args, sample_kwargs):
    return list(callables)


def dense():
    return tiny("llama")


def moe_grouped():
    model = tiny("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    return model


def moe_eager():
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    return model


MODELS = {
    "dense": dense,
    "moe_grouped_mm": moe_grouped,
    "moe_eager": moe_eager,
    "hybrid_mamba": lambda: tiny_arch("jamba"),
    "hybrid_linear_attention": lambda: tiny_arch("qwen3_next"),
}


def graphed(model, **kwargs):
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=eager_backend, **kwargs)
    try:
        return [e.target for e in mgr.recordings], mgr.skipped, mgr.narrowed
    finally:
        mgr.close()


def assert_preview(model, **kwargs):
    plan = plan_targets(model, **kwargs)
    targets, skipped, narrowed = graphed(model, **kwargs)
    assert targets == plan.targets
    assert [t.module for t in targets] == [t.module for t in plan.targets]
    assert (skipped, narrowed) == (plan.skipped, plan.narrowed)
    return plan


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_default_plan_is_what_the_manager_graphs(name):
    plan = assert_preview(MODELS[name]())
    assert plan.targets, "every model here has something graph-safe"


def test_the_default_plan_takes_the_widest_scope_of_each_layer():
    assert [t.kind for t in assert_preview(dense()).targets] == ["layer", "layer"]
    assert [t.kind for t in assert_preview(moe_grouped()).targets] == ["layer", "layer"]
    eager = assert_preview(moe_eager())
    assert [t.kind for t in eager.targets] == ["attention", "router"] * 2
    assert [n.reason for n in eager.narrowed] == ["eager_experts"] * 2


def test_grouped_mm_run_on_the_host_narrows_in_the_plan_as_in_the_manager(monkeypatch):
    probe_says(monkeypatch, keeps=())  # float32 grouped GEMM off the device, as on a GPU
    plan = assert_preview(moe_grouped())
    assert [n.reason for n in plan.narrowed] == ["host_grouped_mm"] * 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scopes=SCOPES),
        dict(scopes=("attention", "moe_router")),
        dict(scopes=("moe",)),
        dict(scopes=(MODEL_SCOPE, *SCOPES)),
        dict(include="model.layers.*.mlp.experts", scopes=("attention",)),
    ],
    ids=["every-scope", "attention-router", "moe", "model", "include"],
)
@pytest.mark.parametrize("name", ["moe_grouped_mm", "hybrid_mamba"])
def test_a_plan_with_scopes_or_include_is_what_the_manager_graphs(name, kwargs):
    assert_preview(MODELS[name](), **kwargs)
