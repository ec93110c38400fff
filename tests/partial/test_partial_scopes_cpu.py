"""Scopes of partial graphs on the CPU: the targets per model and scope set, the experts
implementation that decides an MoE scope, and a user model described by structure
only."""

from types import SimpleNamespace

import pytest
from torch import nn

from cudagraphs.moe_kernels import experts_implementation, static_experts
from cudagraphs.partial.discovery import discover_blocks
from cudagraphs.partial.planning import plan_targets, select_targets
from cudagraphs.partial.vocabulary import SCOPES, NarrowedBlock
from helpers.hf_models import tiny
from helpers.scopes import (
    ATTENTION,
    ATTN_ROUTER,
    EXPECTED,
    LAYER,
    MLP,
    MODEL_LAYERS,
    NO_SCOPE,
    ROUTER,
    SETS,
    ToyAttention,
    model_of,
    moe_attn_router,
    names_kinds,
    narrowings,
    per_layer,
    toy_model,
)

# --- targets per model and scope set --------------------------------------------------


@pytest.mark.parametrize("scope_set", sorted(SETS))
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_targets_per_scope_set(family, scope_set):
    model = model_of(family)
    plan = plan_targets(model, scopes=SETS[scope_set])
    targets, skips, narrowed = EXPECTED[family][scope_set]
    assert names_kinds(plan) == targets
    assert [(s.name, s.reason) for s in plan.skipped] == skips
    assert narrowings(plan) == narrowed
    assert select_targets(model, scopes=SETS[scope_set]) == plan.targets
    modules = dict(model.named_modules())
    blocks = {b.name for b in discover_blocks(model)}
    for t in plan.targets:
        assert t.module is modules[t.name], f"{t.name} is not the model's own module"
        assert t.block in blocks and (t.name == t.block or t.name.startswith(t.block + "."))


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_default_plan_is_every_scope(family):
    model = model_of(family)
    default = plan_targets(model)
    assert plan_targets(model, scopes=None) == default == plan_targets(model, scopes=SCOPES)
    targets, skips, narrowed = EXPECTED[family]["all"]
    assert names_kinds(default) == targets
    assert [(s.name, s.reason) for s in default.skipped] == skips
    assert narrowings(default) == narrowed


def test_deepseek_moe_scope_holds_router_experts_and_shared_experts():
    model = model_of("deepseek_v3")
    (target,) = plan_targets(model, scopes=("moe",)).targets
    moe = model.model.layers[1].mlp
    assert target.module is moe
    inside = list(target.module.modules())
    for part in (moe.gate, moe.experts, moe.shared_experts):
        assert any(part is m for m in inside)


def test_narrowed_records_say_why_and_how_to_fix():
    (record, *_) = plan_targets(model_of("jamba"), scopes=SCOPES).narrowed
    assert isinstance(record, NarrowedBlock)
    assert record.block_type == "JambaMambaDecoderLayer"
    assert "no attention module" in record.detail
    assert "graphed at moe instead" in record.detail
    assert "include=['model.layers.0.mamba']" in record.detail


# --- the experts implementation -------------------------------------------------------


def test_tiny_moe_models_default_to_grouped_mm():
    model = tiny("qwen3_moe")
    assert callable(getattr(model, "set_experts_implementation", None))
    assert model.config._experts_implementation == "grouped_mm"
    assert experts_implementation(model.model.layers[0].mlp, model) == "grouped_mm"


def test_eager_experts_narrow_moe_and_layer_to_the_router():
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    assert experts_implementation(model.model.layers[1].mlp, model) == "eager"

    plan = plan_targets(model, scopes=SCOPES)
    assert names_kinds(plan) == moe_attn_router()
    assert narrowings(plan) == [
        (f"{MODEL_LAYERS}.{i}", "layer", ATTN_ROUTER, "eager_experts") for i in (0, 1)
    ]
    detail = plan.narrowed[0].detail
    assert "'eager'" in detail and "graphed at attention + moe_router instead" in detail
    assert "model.set_experts_implementation('grouped_mm')" in detail

    plan = plan_targets(model, scopes=("moe", "moe_router"))
    assert names_kinds(plan) == per_layer(MODEL_LAYERS, ".mlp.gate", ROUTER)
    assert narrowings(plan) == [
        (f"{MODEL_LAYERS}.{i}", "moe", ("moe_router",), "eager_experts") for i in (0, 1)
    ]

    # Nothing narrower asked for: the blocks are skipped, the detail says why.
    plan = plan_targets(model, scopes=("moe",))
    assert plan.targets == [] and plan.narrowed == []
    assert [s.reason for s in plan.skipped] == [NO_SCOPE, NO_SCOPE]
    assert "'eager'" in plan.skipped[0].detail
    assert "set_experts_implementation('grouped_mm')" in plan.skipped[0].detail

    model.set_experts_implementation("batched_mm")
    assert names_kinds(plan_targets(model, scopes=SCOPES)) == per_layer(MODEL_LAYERS, "", LAYER)


def test_an_implementation_not_known_to_be_static_is_unknown():
    model = tiny("mixtral")
    model.config._experts_implementation = "some_kernel"  # the experts share this config
    plan = plan_targets(model, scopes=SCOPES)
    assert narrowings(plan) == [
        (f"{MODEL_LAYERS}.{i}", "layer", ATTN_ROUTER, "unknown_experts") for i in (0, 1)
    ]
    assert "'some_kernel', not one known to keep static shapes" in plan.narrowed[0].detail


# --- a user model: structure only, no config ------------------------------------------


def test_user_moe_with_unknown_experts_is_narrowed():
    model = toy_model()
    assert experts_implementation(model.layers[1].ffn, model) is None
    plan = plan_targets(model, scopes=SCOPES)
    assert names_kinds(plan) == [
        ("layers.0", LAYER),
        ("layers.1.attn", ATTENTION),
        ("layers.1.ffn.router", ROUTER),
    ]
    assert narrowings(plan) == [("layers.1", "layer", ATTN_ROUTER, "unknown_experts")]
    assert plan.source == "structure"
    detail = plan.narrowed[0].detail
    assert "not stated" in detail and "include=['layers.1.ffn']" in detail
    assert names_kinds(plan_targets(model, scopes=("mlp",))) == [("layers.0.ffn", MLP)]


class FlatRouter(nn.Linear):
    pass


class FlatBlock(nn.Module):
    """Router and experts held by the block itself: no MoE sublayer apart from it."""

    def __init__(self, d=8):
        super().__init__()
        self.attn = ToyAttention(d)
        self.router = FlatRouter(d, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(2))


class FlatModel(nn.Module):
    _no_split_modules = ["FlatBlock"]
    _can_record_outputs = {"router_logits": FlatRouter}

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([FlatBlock(), FlatBlock()])
        self.config = SimpleNamespace(_experts_implementation="grouped_mm")


def test_a_router_held_by_the_block_itself_has_no_moe_scope():
    model = FlatModel()
    plan = plan_targets(model, scopes=("attention", "moe", "moe_router"))
    assert names_kinds(plan) == [
        t for i in (0, 1) for t in ((f"layers.{i}.attn", ATTENTION), (f"layers.{i}.router", ROUTER))
    ]
    assert plan.narrowed == []
    plan = plan_targets(model, scopes=("moe",))
    assert plan.targets == [] and "no MoE sublayer" in plan.skipped[0].detail
    assert names_kinds(plan_targets(model, scopes=SCOPES)) == per_layer("layers", "", LAYER)


@pytest.mark.parametrize(
    "stated, layer_1",
    [
        ("grouped_mm", [("layers.1", LAYER)]),
        ({"": "batched_mm"}, [("layers.1", LAYER)]),
        (
            {"text_config": "grouped_mm"},
            [("layers.1.attn", ATTENTION), ("layers.1.ffn.router", ROUTER)],
        ),
        ("eager", [("layers.1.attn", ATTENTION), ("layers.1.ffn.router", ROUTER)]),
    ],
    ids=["str", "dict-main", "dict-other-key", "eager"],
)
def test_user_model_config_states_the_implementation(stated, layer_1):
    model = toy_model()
    model.config = SimpleNamespace(_experts_implementation=stated)
    assert names_kinds(plan_targets(model, scopes=SCOPES)) == [("layers.0", LAYER)] + layer_1


def test_the_experts_own_config_comes_before_the_model_config():
    model = toy_model()
    model.config = SimpleNamespace(_experts_implementation="grouped_mm")
    model.layers[1].ffn.experts.config = SimpleNamespace(_experts_implementation="eager")
    assert experts_implementation(model.layers[1].ffn, model) == "eager"
    # A config without the attribute says nothing: the model's is in force.
    model.layers[1].ffn.experts.config = SimpleNamespace()
    assert experts_implementation(model.layers[1].ffn, model) == "grouped_mm"


def test_a_sub_config_reads_its_own_key_of_a_dict():
    text = SimpleNamespace(_experts_implementation={"": "eager", "text_config": "grouped_mm"})
    outer = SimpleNamespace(
        sub_configs={"text_config": object},
        text_config=text,
        _experts_implementation={"": "eager", "text_config": "grouped_mm"},
    )
    model = toy_model()
    model.config = outer
    model.layers.config = text  # the language model inside a composite model
    assert experts_implementation(model.layers[1].ffn, model) == "grouped_mm"
    model.layers.config = SimpleNamespace(_experts_implementation=None)
    assert experts_implementation(model.layers[1].ffn, model) is None


@pytest.mark.parametrize(
    "implementation, static",
    [("grouped_mm", True), ("batched_mm", True), ("eager", False), (None, False)]
    + [("sonicmoe", False), ("", False), (1, False)],
)
def test_static_experts(implementation, static):
    assert static_experts(implementation) is static


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_collected_router_logits_keep_each_router_graphed_alone(implementation):
    # MoE training with the load-balancing loss (output_router_logits=True):
    # transformers collects the logits with a forward hook on each router, which a
    # replay of a graph around the router would never run (router_logits empty, an
    # IndexError in the loss). The router is its own target, its hook outside.
    model = tiny("mixtral")
    model.set_experts_implementation(implementation)
    assert {t.kind for t in plan_targets(model).targets} == {"layer"}
    model.config.output_router_logits = True
    plan = plan_targets(model)
    assert [(t.name, t.kind) for t in plan.targets] == [
        ("model.layers.0.self_attn", "attention"),
        ("model.layers.0.mlp.gate", "router"),
        ("model.layers.1.self_attn", "attention"),
        ("model.layers.1.mlp.gate", "router"),
    ]
    assert [n.reason for n in plan.narrowed] == ["router_logits"] * 2
    assert "forward hook on model.layers.0.mlp.gate" in plan.narrowed[0].detail
