"""Discovery from the model's own metadata (``_no_split_modules``, ``_can_record_outputs``):
tiny Hugging Face architectures built from config on the CPU (dense, MoE, hybrid Mamba
and linear-attention, encoder-decoder, Conv1D), the blocks skipped with their reasons,
cross-attention, and the structural fallback for modules no declaration covers."""

import dataclasses
import logging
import re
from types import SimpleNamespace

import pytest
from torch import nn

from cudagraphs.partial import (
    SkippedBlock,
    Target,
    TargetPlan,
    discover_blocks,
    plan_targets,
    select_targets,
)
from cudagraphs.partial.metadata import first_declared, read_metadata
from cudagraphs.partial.planning import why_nothing_found
from cudagraphs.partial.vocabulary import ClassSpec
from helpers.discovery import ATTN_ROUTER
from helpers.hf_models import tiny, tiny_arch

A, R = "attention", "router"
NO_SCOPE = "no_graph_safe_scope"


def dense(stack: str, attn: str = "self_attn", n: int = 2) -> list[tuple[str, str]]:
    return [(f"{stack}.{i}.{attn}", A) for i in range(n)]


def moe(stack: str, n: int = 2) -> list[tuple[str, str]]:
    return [
        t for i in range(n) for t in ((f"{stack}.{i}.self_attn", A), (f"{stack}.{i}.mlp.gate", R))
    ]


def names_kinds(targets: list[Target]) -> list[tuple[str, str]]:
    return [(t.name, t.kind) for t in targets]


def skips(plan: TargetPlan) -> list[tuple[str, str]]:
    return [(s.name, s.reason) for s in plan.skipped]


# family -> (targets as (name, kind), skipped blocks as (name, reason))
EXPECTED = {
    "llama": (dense("model.layers"), []),
    "mistral": (dense("model.layers"), []),
    "qwen2": (dense("model.layers"), []),
    "qwen3": (dense("model.layers"), []),
    "gemma": (dense("model.layers"), []),
    "phi": (dense("model.layers"), []),
    "gpt_neox": (dense("gpt_neox.layers", "attention"), []),
    # Falcon declares its layer class but no attention class: structure inside the layer.
    "falcon": (dense("transformer.h", "self_attention"), []),
    "opt": (dense("model.decoder.layers"), []),
    # GPT-2's projections are Conv1D, not Linear: only the metadata finds its attention.
    "gpt2": (dense("transformer.h", "attn"), []),
    "olmoe": (moe("model.layers"), []),
    "qwen3_moe": (moe("model.layers"), []),
    "mixtral": (moe("model.layers"), []),
    # first_k_dense_replace=1: layer 0 has a dense MLP.
    "deepseek_v3": (dense("model.layers") + [("model.layers.1.mlp.gate", R)], []),
    # Encoder and decoder self-attention alike (no metadata tells them apart); the
    # decoder's cross-attention (layer.1) is not a target.
    "t5": (dense("encoder.block", "layer.0") + dense("decoder.block", "layer.0"), []),
    # Layers 0/2: Mamba + MoE (router only); 1: attention + MLP; 3: Mamba + MLP.
    "jamba": (
        [
            ("model.layers.0.feed_forward.router", R),
            ("model.layers.1.self_attn", A),
            ("model.layers.2.feed_forward.router", R),
        ],
        [("model.layers.3", NO_SCOPE)],
    ),
    # Layers 0/2: Gated DeltaNet (never attention); layer 2 is dense, so nothing in it.
    "qwen3_next": (
        [
            ("model.layers.0.mlp.gate", R),
            ("model.layers.1.self_attn", A),
            ("model.layers.1.mlp.gate", R),
            ("model.layers.3.self_attn", A),
            ("model.layers.3.mlp.gate", R),
        ],
        [("model.layers.2", NO_SCOPE)],
    ),
    "bamba": ([("model.layers.1.self_attn", A)], [("model.layers.0", NO_SCOPE)]),
    # Mamba and attention side by side in every layer: the attention, not the mixer.
    "falcon_h1": (dense("model.layers"), []),
}
FROM_CONFIGS = {"qwen3_moe", "mixtral", "deepseek_v3"}  # the shared CONFIGS of helpers.hf_models


def build(family: str, **overrides) -> nn.Module:
    return tiny(family) if family in FROM_CONFIGS else tiny_arch(family, **overrides)


def block_of(name: str) -> str:
    return re.match(r"^(.*?\.\d+)\.", name).group(1)


# --- every architecture ----------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_architecture_plan(family):
    model = build(family)
    plan = plan_targets(model, scopes=ATTN_ROUTER)
    targets, skipped = EXPECTED[family]
    assert plan.source == "metadata"
    assert names_kinds(plan.targets) == targets
    assert skips(plan) == skipped
    assert select_targets(model, scopes=ATTN_ROUTER) == plan.targets
    modules = dict(model.named_modules())
    for t in plan.targets:
        assert t.module is modules[t.name], f"{t.name} is not the model's own module"
        assert t.block == block_of(t.name)
        # Named by the model's own classes: no mixer or MLP is taken for either kind.
        suffix = "Attention" if t.kind == A else "Router"
        assert type(t.module).__name__.endswith(suffix), (t.name, type(t.module).__name__)
    for s in plan.skipped:
        assert isinstance(s, SkippedBlock)
        assert s.block_type == type(modules[s.name]).__name__
        assert s.detail.startswith(f"{s.block_type} {s.name} holds ")
        assert "include=" in s.detail


def test_blocks_carry_source_and_moe():
    blocks = discover_blocks(build("jamba"))
    assert [type(b.module).__name__ for b in blocks] == [
        "JambaMambaDecoderLayer",
        "JambaAttentionDecoderLayer",
        "JambaMambaDecoderLayer",
        "JambaMambaDecoderLayer",
    ]
    assert {b.source for b in blocks} == {"metadata"}
    assert [b.moe for b in blocks] == [
        "model.layers.0.feed_forward",
        None,
        "model.layers.2.feed_forward",
        None,
    ]
    assert [b.attention is not None for b in blocks] == [False, True, False, False]
    assert blocks[0].metadata.owner == "JambaModel"


# --- hybrids: what is skipped, and why ------------------------------------------------------


def test_jamba_mamba_layers_are_skipped_without_routers():
    plan = plan_targets(build("jamba"), scopes=("attention",))
    assert names_kinds(plan.targets) == [("model.layers.1.self_attn", A)]
    assert skips(plan) == [(f"model.layers.{i}", NO_SCOPE) for i in (0, 2, 3)]
    layer0, _, layer3 = plan.skipped
    assert "mamba (JambaMambaMixer)" in layer0.detail
    assert "no module of the attention class JambaAttention (JambaModel declares it)" in (
        layer0.detail
    )
    assert (
        "its router model.layers.0.feed_forward.router is left out (moe_router is not among "
        "the scopes)" in layer0.detail
    )
    assert "left out" not in layer3.detail
    assert layer3.detail.endswith("include=['model.layers.3.mamba'].")


def test_jamba_skip_detail_in_full():
    (skipped,) = plan_targets(build("jamba"), scopes=ATTN_ROUTER).skipped
    assert skipped == SkippedBlock(
        name="model.layers.3",
        block_type="JambaMambaDecoderLayer",
        reason=NO_SCOPE,
        detail="JambaMambaDecoderLayer model.layers.3 holds mamba (JambaMambaMixer), "
        "feed_forward (JambaMLP), input_layernorm (JambaRMSNorm), pre_ff_layernorm "
        "(JambaRMSNorm); no scope asked for fits it (attention: no module of the attention "
        "class JambaAttention (JambaModel declares it); moe_router: no router of the class "
        "JambaTopKRouter (JambaModel declares it)). Fix: if one of its modules is graph-safe (no host sync, the same shapes every "
        "step), name it with include=, e.g. include=['model.layers.3.mamba'].",
    )


def test_qwen3_next_linear_attention_is_never_attention():
    model = build("qwen3_next")
    plan = plan_targets(model, scopes=("attention",))
    assert names_kinds(plan.targets) == [
        ("model.layers.1.self_attn", A),
        ("model.layers.3.self_attn", A),
    ]
    assert skips(plan) == [("model.layers.0", NO_SCOPE), ("model.layers.2", NO_SCOPE)]
    assert all("linear_attn (Qwen3NextGatedDeltaNet)" in s.detail for s in plan.skipped)
    assert plan.skipped[1].detail.endswith("include=['model.layers.2.linear_attn'].")
    blocks = discover_blocks(model)
    assert [b.attention is not None for b in blocks] == [False, True, False, True]
    linear = {id(model.model.layers[i].linear_attn) for i in (0, 2)}
    assert not linear & {id(t.module) for t in select_targets(model, scopes=ATTN_ROUTER)}


def test_qwen3_next_routers_of_linear_layers_are_found():
    plan = plan_targets(build("qwen3_next"), scopes=("moe_router",))
    assert names_kinds(plan.targets) == [
        ("model.layers.0.mlp.gate", R),
        ("model.layers.1.mlp.gate", R),
        ("model.layers.3.mlp.gate", R),
    ]
    assert skips(plan) == [("model.layers.2", NO_SCOPE)]


def test_bamba_mamba_layer_detail_names_the_structural_router_rule():
    # Bamba declares no router class: the router was looked for by structure.
    (skipped,) = plan_targets(build("bamba"), scopes=ATTN_ROUTER).skipped
    assert "no module of the attention class BambaAttention (BambaModel declares it)" in (
        skipped.detail
    )
    assert "no MoE router (a gate or router with a 2-D weight beside experts)" in skipped.detail


def test_include_of_a_skipped_blocks_module_graphs_it_and_unskips_it():
    model = build("jamba")
    plan = plan_targets(model, include="model.layers.3.mamba", scopes=ATTN_ROUTER)
    assert plan.skipped == []
    assert plan.targets[-1] == Target("model.layers.3.mamba", model.model.layers[3].mamba, "custom")
    # A target that is the block, or holds it, counts too.
    assert plan_targets(model, include="model.layers.3", scopes=ATTN_ROUTER).skipped == []
    whole = plan_targets(model, include="model.layers", scopes=())
    assert names_kinds(whole.targets) == [("model.layers", "custom")]
    assert whole.skipped == []


# --- scopes that leave pieces out ---------------------------------------------------------


def test_attention_left_out_skips_dense_blocks_and_says_what_was_left_out():
    plan = plan_targets(build("llama"), scopes=("moe_router",))
    assert plan.targets == []
    assert skips(plan) == [("model.layers.0", NO_SCOPE), ("model.layers.1", NO_SCOPE)]
    detail = plan.skipped[0].detail
    assert "(moe_router: no MoE router" in detail
    assert (
        "its attention model.layers.0.self_attn is left out (attention is not among the scopes)"
        in detail
    )


def test_nothing_asked_is_its_own_reason():
    plan = plan_targets(build("llama"), scopes=())
    assert plan.targets == [] and plan.source == "metadata"
    assert skips(plan) == [("model.layers.0", "nothing_asked"), ("model.layers.1", "nothing_asked")]
    assert "scopes=() and include names nothing in it" in plan.skipped[0].detail


def test_why_nothing_found_names_the_metadata_rule():
    why = why_nothing_found([build("llama")], include=None, scopes=("moe_router",))
    assert why == (
        "in LlamaForCausalLM with 2 block(s), looking for scopes moe_router; blocks are the "
        "decoder-layer classes the model declares (_no_split_modules), and plan_targets "
        "reports each block that yields no target with the reason. Fixes: 1. pass include= "
        "naming the modules to graph; 2. pass the model parts that hold the decoder layers"
    )


# --- cross-attention ---------------------------------------------------------------------


def test_gpt2_cross_attention_is_not_a_target():
    model = build("gpt2", add_cross_attention=True)
    assert type(model.transformer.h[0].crossattention) is type(model.transformer.h[0].attn)
    plan = plan_targets(model, scopes=ATTN_ROUTER)
    assert names_kinds(plan.targets) == dense("transformer.h", "attn")


def test_t5_decoder_alone():
    model = build("t5")
    plan = plan_targets(model.decoder, scopes=ATTN_ROUTER)
    assert plan.source == "metadata"
    assert names_kinds(plan.targets) == dense("block", "layer.0")
    assert type(model.decoder.block[0].layer[1]).__name__ == "T5LayerCrossAttention"


# --- toy models with declarations -----------------------------------------------------------


class ToyAttention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None):
        return self.o(self.q(hidden_states) + self.k(hidden_states) + self.v(hidden_states))


class ToyRouter(nn.Linear):
    pass


class ToyMoE(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.route = ToyRouter(d, 2)  # not called gate/router: only a declaration finds it
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(2))


class ToyLayer(nn.Module):
    def __init__(self, cross=False, moe=False):
        super().__init__()
        self.attn = ToyAttention()
        if cross:
            self.cross = ToyAttention()
        self.ffn = ToyMoE() if moe else nn.Linear(8, 8)


class Recorder:
    """Stands in for transformers' OutputRecorder (duck-typed: no transformers here)."""

    def __init__(self, target_class=None, layer_name=None, class_name=None):
        self.target_class, self.layer_name, self.class_name = target_class, layer_name, class_name


def declared_model(layers, no_split=("ToyLayer",), record=None) -> nn.Module:
    cls = type(
        "ToyPreTrained",
        (nn.Module,),
        {"_no_split_modules": list(no_split), "_can_record_outputs": record},
    )
    model = cls()
    model.layers = nn.ModuleList(layers)
    return model


class CrossFirstLayer(nn.Module):
    def __init__(self, self_attention=True):
        super().__init__()
        self.cross = ToyAttention()  # before the self-attention in module order
        if self_attention:
            self.attn = ToyAttention()


def test_cross_attention_of_the_attention_class_is_excluded():
    # Both are ToyAttention, told apart by the cross-attention declaration's layer name
    # (as GPT-2 does); a layer with only cross-attention yields nothing.
    record = {
        "attentions": ToyAttention,
        "cross_attentions": Recorder(ToyAttention, layer_name="cross"),
    }
    layers = [CrossFirstLayer(), CrossFirstLayer(self_attention=False)]
    model = declared_model(layers, no_split=["CrossFirstLayer"], record=record)
    plan = plan_targets(model, scopes=ATTN_ROUTER)
    assert names_kinds(plan.targets) == [("layers.0.attn", A)]
    assert skips(plan) == [("layers.1", NO_SCOPE)]
    assert plan.skipped[0].detail.startswith("CrossFirstLayer layers.1 holds cross (ToyAttention)")


def test_declared_router_need_not_be_called_gate():
    record = {"attentions": [ToyAttention], "router_logits": Recorder(ToyRouter)}
    model = declared_model([ToyLayer(), ToyLayer(moe=True)], record=record)
    assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == dense("layers", "attn") + [
        ("layers.1.ffn.route", R)
    ]
    assert [b.moe for b in discover_blocks(model)] == [None, "layers.1.ffn"]
    # Without the declaration the structure does not know "route" as a router.
    plain = nn.Module()
    plain.layers = model.layers
    assert [t.kind for t in select_targets(plain, scopes=ATTN_ROUTER)] == [A, A]


def test_declared_attention_direct_child_first_and_several_logged(caplog):
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = ToyAttention()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.deep = Deep()  # first in module order, but one level deeper
            self.second = ToyAttention()
            self.attn = ToyAttention()

    model = declared_model([Layer()], no_split=["Layer"], record={"attentions": ToyAttention})
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.metadata"):
        assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == [("layers.0.second", A)]
    assert caplog.messages == [
        "block layers.0 has several attention modules ['layers.0.second', 'layers.0.attn']; "
        "taking the first"
    ]


def test_a_declared_layer_that_is_itself_attention_is_its_own_target():
    model = declared_model(
        [ToyAttention(), ToyAttention()],
        no_split=["ToyAttention"],
        record={"attentions": ToyAttention},
    )
    assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == [
        ("layers.0", A),
        ("layers.1", A),
    ]


# --- metadata naming classes absent from the model -----------------------------------------


def test_layer_classes_absent_fall_back_to_structure():
    # The declaration describes none of these modules, so the structural rule applies.
    model = declared_model([ToyLayer(), ToyLayer()], no_split=["NoSuchLayer"])
    plan = plan_targets(model, scopes=ATTN_ROUTER)
    assert plan.source == "structure"
    assert names_kinds(plan.targets) == dense("layers", "attn")

    hf = build("llama")
    reference = names_kinds(select_targets(hf, scopes=ATTN_ROUTER))
    hf._no_split_modules = ["RenamedLayer"]
    hf.model._no_split_modules = ["RenamedLayer"]
    plan = plan_targets(hf, scopes=ATTN_ROUTER)
    assert plan.source == "structure" and names_kinds(plan.targets) == reference


def test_a_declaration_that_names_nothing_beneath_it_leaves_the_outer_one_in_force():
    record = {"attentions": ToyAttention, "router_logits": ToyRouter}
    inner = declared_model([ToyLayer(moe=True)], no_split=["NoSuchLayer"])
    outer = declared_model([], record=record)
    outer.inner = inner
    blocks = discover_blocks(outer)
    assert [(b.name, b.source, b.metadata.owner) for b in blocks] == [
        ("inner.layers.0", "metadata", "ToyPreTrained")
    ]
    # The router is not called gate/router: only the outer declaration finds it.
    assert names_kinds(select_targets(outer, scopes=ATTN_ROUTER)) == [
        ("inner.layers.0.attn", A),
        ("inner.layers.0.ffn.route", R),
    ]


def test_attention_class_absent_is_a_reason_not_a_guess():
    # Every LlamaAttention replaced by a module of another class: the model declares
    # which class is attention, so nothing else is taken for it; each block says why.
    model = build("llama")
    for layer in model.model.layers:
        layer.self_attn = ToyAttention(32)
    plan = plan_targets(model, scopes=ATTN_ROUTER)
    assert plan.targets == [] and plan.source == "metadata"
    assert skips(plan) == [("model.layers.0", NO_SCOPE), ("model.layers.1", NO_SCOPE)]
    assert "no block of this model part holds one (if the attention modules were replaced" in (
        plan.skipped[0].detail
    )
    assert plan.skipped[0].detail.endswith("include=['model.layers.0.self_attn'].")
    fixed = plan_targets(model, include="model.layers.*.self_attn", scopes=ATTN_ROUTER)
    assert names_kinds(fixed.targets) == [(n, "custom") for n, _ in dense("model.layers")]
    assert fixed.skipped == []


def test_fsdp_renamed_layer_class_is_still_a_declared_layer():
    # fully_shard swaps a module's class for a subclass named FSDP<name>.
    model = build("llama")
    for layer in model.model.layers:
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    plan = plan_targets(model, scopes=ATTN_ROUTER)
    assert plan.source == "metadata" and names_kinds(plan.targets) == dense("model.layers")


# --- no metadata: the structural rule, unchanged -------------------------------------------


def test_user_model_without_metadata_keeps_the_structural_result():
    model = nn.Module()
    model.layers = nn.ModuleList([ToyLayer(), ToyLayer()])
    plan = plan_targets(model, scopes=ATTN_ROUTER)
    assert plan == TargetPlan(
        targets=[
            Target(f"layers.{i}.attn", model.layers[i].attn, A, f"layers.{i}") for i in (0, 1)
        ],
        skipped=[],
        source="structure",
    )
    assert {b.source for b in discover_blocks(model)} == {"structure"}


def test_a_stage_of_bare_hf_layers_is_structural():
    layers = build("llama").model.layers
    plan = plan_targets(layers, scopes=ATTN_ROUTER)
    assert plan.source == "structure"
    assert names_kinds(plan.targets) == [("0.self_attn", A), ("1.self_attn", A)]
    # Mixed layer types are no structural stack: nothing found, and nothing to skip.
    assert plan_targets(build("jamba").model.layers, scopes=ATTN_ROUTER) == TargetPlan(
        [], [], "structure"
    )


def test_declared_model_beside_a_structural_stack():
    wrapper = nn.Module()
    wrapper.backbone = build("llama").model
    wrapper.mtp = nn.ModuleList([ToyLayer()])
    plan = plan_targets(wrapper, scopes=ATTN_ROUTER)
    assert plan.source == "metadata"
    assert names_kinds(plan.targets) == dense("backbone.layers") + [("mtp.0.attn", A)]
    assert [b.source for b in discover_blocks(wrapper)] == ["metadata", "metadata", "structure"]


# --- reading the declarations ------------------------------------------------------------------


def test_read_metadata_is_duck_typed():
    assert read_metadata(nn.Linear(2, 2)) is None
    assert read_metadata(declared_model([], no_split=[])) is None
    odd = declared_model([], no_split=["L", 3, "", "L"], record="not a mapping")
    meta = read_metadata(odd)
    assert meta.layer_classes == ("L",) and meta.attention == () and meta.router == ()
    record = {
        "attentions": [ToyAttention, "self_attn", Recorder(), None],
        "cross_attentions": Recorder(ToyAttention, layer_name=".cross."),
        "router_logits": Recorder(class_name="route"),
    }
    meta = read_metadata(declared_model([], record=record))
    assert meta.owner == "ToyPreTrained"
    assert meta.attention == (ClassSpec(ToyAttention), ClassSpec(None, name_hint="self_attn"))
    assert meta.cross_attention == (ClassSpec(ToyAttention, layer_name="cross"),)
    assert meta.router == (ClassSpec(None, name_hint="route"),)


def test_hf_declarations_read():
    model = build("gpt2")
    meta = read_metadata(model)
    assert meta.layer_classes == ("GPT2Block",)
    assert [s.label() for s in meta.attention] == ["GPT2Attention at .attn"]
    assert [s.label() for s in meta.cross_attention] == ["GPT2Attention at .crossattention"]
    assert read_metadata(build("falcon")).attention == ()
    # post_init turns the class's list into a set on the instance: read in sorted order.
    jamba = build("jamba")
    assert isinstance(jamba._no_split_modules, set)
    assert read_metadata(jamba).layer_classes == (
        "JambaAttentionDecoderLayer",
        "JambaMambaDecoderLayer",
    )


@pytest.mark.parametrize(
    "name, hit",
    [
        ("h.0.attn", True),
        ("attn", True),
        ("h.0.attn.inner", True),
        ("h.0.c_attn", False),
        ("h.0.attn_norm", False),
    ],
)
def test_layer_name_matches_whole_name_components(name, hit):
    spec = ClassSpec(ToyAttention, layer_name="attn")
    assert spec.matches(name, ToyAttention()) is hit
    assert spec.matches(name, nn.Linear(2, 2)) is False


@pytest.mark.parametrize(
    "hint, name, hit",
    [
        ("ToyAttention", "anything", True),  # a class name (Llava-NeXT-Video writes these)
        ("ToyAttn", "anything", False),
        ("self_attn", "layers.0.self_attn", True),  # a name suffix (Informer's class_name)
        ("self_attn", "self_attn", True),
        ("self_attn", "layers.0.xself_attn", False),
    ],
)
def test_name_hint_is_a_class_name_or_a_name_suffix(hint, name, hit):
    assert ClassSpec(None, name_hint=hint).matches(name, ToyAttention()) is hit


def test_first_declared_returns_the_parent():
    layer = ToyLayer(moe=True)
    hit = first_declared(layer, "b", lambda n, m: isinstance(m, ToyRouter), "router")
    assert hit == ("b.ffn.route", layer.ffn.route, "b.ffn", layer.ffn)
    assert first_declared(layer, "b", lambda n, m: False, "router") is None


def test_records_are_frozen():
    plan = plan_targets(nn.Linear(2, 2), scopes=ATTN_ROUTER)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.source = "metadata"
    assert plan == TargetPlan([], [], "structure")
    skipped = SkippedBlock("a", "B", NO_SCOPE, "d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        skipped.reason = "x"


def test_simple_namespace_recorder_is_enough():
    record = {"attentions": SimpleNamespace(target_class=ToyAttention, layer_name="attn")}
    model = declared_model([ToyLayer(cross=True)], record=record)
    assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == [("layers.0.attn", A)]
