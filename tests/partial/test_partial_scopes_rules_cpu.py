"""The rules that choose partial-graph scopes, on the CPU: the choice rules alone, the
dense MLP rule, include and wrappers and what is refused, and where the MoE sublayer
sits."""

import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError, TargetSelectionError
from cudagraphs.moe_kernels import experts_implementation
from cudagraphs.partial.discovery import discover_blocks, find_mlp, find_moe
from cudagraphs.partial.planning import plan_targets, why_nothing_found
from cudagraphs.partial.scopes import (
    BlockOffer,
    ScopeChoice,
    check_scopes,
    choose_scopes,
    scope_block,
)
from cudagraphs.partial.vocabulary import SCOPES, DiscoveredBlock, Target
from helpers.hf_models import tiny
from helpers.scopes import (
    ATTENTION,
    ATTN_ROUTER,
    MLP,
    MODEL_LAYERS,
    MOE,
    ROUTER,
    ToyAttention,
    ToyBlock,
    ToyMoE,
    model_of,
    names_kinds,
    per_layer,
    toy_model,
)

# --- the choice rules alone -----------------------------------------------------------


def offer(
    attention=True,
    router=False,
    moe=False,
    experts=None,
    mlp=False,
    on_device=True,
    router_logits=False,
) -> BlockOffer:
    return BlockOffer(attention, router, moe, experts, mlp, on_device, router_logits)


DENSE = offer(mlp=True)
MOE_STATIC = offer(router=True, moe=True, experts="grouped_mm")
MOE_EAGER = offer(router=True, moe=True, experts="eager")
MAMBA_MOE = offer(attention=False, router=True, moe=True, experts="grouped_mm")
MAMBA_EAGER = offer(attention=False, router=True, moe=True, experts="eager")
ROUTER_IN_BLOCK = offer(router=True, moe=False, experts="grouped_mm")
# grouped_mm whose dtype torch runs on the host (float32 on torch 2.11): not static.
MOE_HOST_GROUPED = offer(router=True, moe=True, experts="grouped_mm", on_device=False)


@pytest.mark.parametrize(
    "block, requested, choice",
    [
        (DENSE, SCOPES, ScopeChoice(("layer",))),
        (DENSE, ("mlp", "attention"), ScopeChoice(("attention", "mlp"))),
        (DENSE, ("moe",), ScopeChoice(())),
        (MOE_STATIC, SCOPES, ScopeChoice(("layer",))),
        (MOE_STATIC, ("moe", "moe_router"), ScopeChoice(("moe",))),
        (MOE_EAGER, SCOPES, ScopeChoice(ATTN_ROUTER, "layer", ("eager_experts",))),
        (MOE_EAGER, ("layer",), ScopeChoice((), "layer", ("eager_experts",))),
        (MOE_EAGER, ("moe",), ScopeChoice((), "moe", ("eager_experts",))),
        (MOE_EAGER, ("moe_router",), ScopeChoice(("moe_router",))),
        (MOE_HOST_GROUPED, SCOPES, ScopeChoice(ATTN_ROUTER, "layer", ("host_grouped_mm",))),
        (MOE_HOST_GROUPED, ("moe",), ScopeChoice((), "moe", ("host_grouped_mm",))),
        # The device question belongs to grouped_mm alone: batched_mm stays static.
        (
            offer(router=True, moe=True, experts="batched_mm", on_device=False),
            SCOPES,
            ScopeChoice(("layer",)),
        ),
        (offer(router=True, moe=True), ("moe",), ScopeChoice((), "moe", ("unknown_experts",))),
        (MAMBA_MOE, SCOPES, ScopeChoice(("moe",), "layer", ("no_attention",))),
        (
            MAMBA_EAGER,
            SCOPES,
            ScopeChoice(("moe_router",), "layer", ("no_attention", "eager_experts")),
        ),
        (
            offer(attention=False, mlp=True),
            ("layer", "mlp"),
            ScopeChoice(("mlp",), "layer", ("no_attention",)),
        ),
        # The router's parent is the block: no MoE sublayer to graph apart from it.
        (ROUTER_IN_BLOCK, ("moe", "moe_router"), ScopeChoice(("moe_router",))),
        (DENSE, (), ScopeChoice(())),
        # Router logits collected by a hook on the router: the router graphed alone,
        # its hook outside the graph, whatever the experts.
        (
            offer(router=True, moe=True, experts="grouped_mm", router_logits=True),
            SCOPES,
            ScopeChoice(ATTN_ROUTER, "layer", ("router_logits",)),
        ),
        (
            offer(router=True, moe=True, experts="batched_mm", router_logits=True),
            ("moe", "moe_router"),
            ScopeChoice(("moe_router",), "moe", ("router_logits",)),
        ),
        (
            offer(router=True, moe=False, experts="grouped_mm", router_logits=True),
            SCOPES,
            ScopeChoice(("attention", "moe_router"), "layer", ("router_logits",)),
        ),
    ],
)
def test_choose_scopes(block, requested, choice):
    assert choose_scopes(block, requested) == choice


OFFERS = st.builds(
    BlockOffer,
    attention=st.booleans(),
    router=st.booleans(),
    moe=st.booleans(),
    experts=st.sampled_from([None, "eager", "grouped_mm", "batched_mm", "other"]),
    mlp=st.booleans(),
    grouped_on_device=st.booleans(),
    router_logits=st.booleans(),
)
REQUESTS = st.sets(st.sampled_from(SCOPES))


@settings(max_examples=300, deadline=None)
@given(OFFERS, REQUESTS)
def test_collected_router_logits_never_leave_a_router_inside_a_wider_graph(offer, requested):
    # The reference: with the router's logits collected by its hook, no chosen graph
    # holds the router with anything else (layer, moe); the router alone is taken where
    # asked for, and "router_logits" is the reason a wider requested scope was refused.
    # Without a router the flag changes nothing.
    import dataclasses

    choice = choose_scopes(offer, requested)
    plain = choose_scopes(dataclasses.replace(offer, router_logits=False), requested)
    if not (offer.router and offer.router_logits):
        assert choice == plain
        return
    assert not {"layer", "moe"} & set(choice.scopes)
    if "moe_router" in requested:
        assert "moe_router" in choice.scopes
    wider = ("layer" in requested and offer.attention) or ("moe" in requested and offer.moe)
    assert ("router_logits" in choice.reasons) == wider


# --- the dense MLP rule ---------------------------------------------------------------


class TwoProjections(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(self.up(x))


class Mixer(TwoProjections):  # a Mamba-like mixer: called with a cache and a mask too
    def forward(self, hidden_states, cache=None, attention_mask=None):
        return self.down(self.up(hidden_states))


class KwargsMLP(TwoProjections):
    def forward(self, x, **kwargs):
        return self.down(self.up(x))


@pytest.mark.parametrize(
    "child, found",
    [
        (TwoProjections(), True),
        (nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), True),
        (nn.Linear(8, 8), False),  # one projection
        (Mixer(), False),
        (KwargsMLP(), False),
        (nn.LayerNorm(8), False),
        (nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]), False),  # no forward of its own
    ],
    ids=["two-projections", "sequential", "linear", "mixer", "kwargs", "norm", "module-list"],
)
def test_find_mlp(child, found):
    block = nn.Module()
    block.ffn = child
    assert find_mlp(block, "b") == (("b.ffn", child) if found else None)


def test_find_mlp_leaves_taken_modules_out_and_takes_the_first(caplog):
    block = nn.Module()
    block.attn, block.mlp_a, block.mlp_b = TwoProjections(), TwoProjections(), TwoProjections()
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.discovery"):
        assert find_mlp(block, "b", taken=["b.attn"]) == ("b.mlp_a", block.mlp_a)
    assert "several MLP-like children ['b.mlp_a', 'b.mlp_b']" in caplog.text
    # A child holding a taken module (the MoE sublayer deeper inside) is not dense.
    assert find_mlp(block, "b", taken=["b.attn", "b.mlp_a.up"]) == ("b.mlp_b", block.mlp_b)


# --- include, wrappers, and what is refused --------------------------------------------


def test_include_inside_a_chosen_layer_is_refused():
    model = model_of("deepseek_v3")
    with pytest.raises(TargetSelectionError, match=f"lies inside target {MODEL_LAYERS}.1;"):
        plan_targets(model, scopes=("layer",), include=f"{MODEL_LAYERS}.*.mlp.shared_experts")


def test_include_of_a_chosen_scope_target_is_not_added_twice():
    model = model_of("llama")
    plan = plan_targets(model, scopes=("mlp",), include=f"{MODEL_LAYERS}.*.mlp")
    assert names_kinds(plan) == per_layer(MODEL_LAYERS, ".mlp", MLP)


def test_empty_scopes_take_include_alone():
    model = model_of("llama")
    plan = plan_targets(model, scopes=())
    assert plan.targets == []
    assert [s.reason for s in plan.skipped] == ["nothing_asked", "nothing_asked"]
    assert "scopes=()" in plan.skipped[0].detail
    plan = plan_targets(model, scopes=[], include=f"{MODEL_LAYERS}.0.mlp")
    assert names_kinds(plan) == [(f"{MODEL_LAYERS}.0.mlp", "custom")]
    assert [s.name for s in plan.skipped] == [f"{MODEL_LAYERS}.1"]


def test_checkpoint_wrapped_modules_are_the_targets():
    model = tiny("qwen3_moe")
    inner = [layer.mlp for layer in model.model.layers]
    for layer in model.model.layers:
        layer.mlp = checkpoint_wrapper(layer.mlp)
    plan = plan_targets(model, scopes=("moe",))
    assert names_kinds(plan) == per_layer(MODEL_LAYERS, ".mlp", MOE)
    assert [t.module for t in plan.targets] == inner


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("layer", CudaGraphsTypeError, r"got str 'layer'; for one scope write \('layer',\)"),
        ({"layer"}, CudaGraphsTypeError, "must be a list or tuple of scope names"),
        (["layer", 3], CudaGraphsTypeError, r"scopes\[1\] must be a scope name \(str\), got int"),
        (
            ("attention", "router"),
            CudaGraphsValueError,
            r"scopes\[1\] is 'router', not a scope \(did you mean 'moe_router'\?\); the "
            "scopes are attention, moe_router, mlp, moe, layer",
        ),
        (
            ["layer", "mlp", "layer"],
            CudaGraphsValueError,
            r"scopes\[2\] repeats 'layer' \(already scopes\[0\]\)",
        ),
    ],
    ids=["str", "set", "not-str", "unknown", "duplicate"],
)
def test_check_scopes_errors(value, error, message):
    with pytest.raises(error, match=message):
        check_scopes(value)
    with pytest.raises(error, match=message):
        plan_targets(model_of("llama"), scopes=value)


def test_check_scopes_returns_a_tuple():
    assert check_scopes(["moe", "layer"]) == ("moe", "layer")
    assert check_scopes(()) == ()
    assert SCOPES == ("attention", "moe_router", "mlp", "moe", "layer")


@pytest.mark.parametrize(
    "flags, named",
    [
        (dict(attention=False), "attention=False"),
        (dict(router=False), "router=False"),
        (dict(attention=False, router=False), "attention=False and router=False"),
        (dict(attention=1), "attention=1"),
    ],
)
def test_scopes_beside_a_retired_switch_are_refused(flags, named):
    with pytest.raises(CudaGraphsTypeError, match=f"got {named}; attention= and router= are"):
        plan_targets(model_of("llama"), scopes=("layer",), **flags)


def test_why_nothing_found_names_the_scopes():
    model = toy_model()
    why = why_nothing_found([model], include=None, scopes=("moe",))
    assert "looking for scopes moe" in why
    why = why_nothing_found([model], include=None, scopes=())
    assert "scopes=() and no include: nothing asked for" in why


# --- where the MoE sublayer sits, and which config states its experts ------------------


class DeepMoEBlock(nn.Module):
    """The MoE sublayer two levels beneath the block (``ffn.moe``)."""

    def __init__(self, d=8):
        super().__init__()
        self.attn = ToyAttention(d)
        self.ffn = nn.Module()
        self.ffn.moe = ToyMoE(d)


def test_an_moe_sublayer_deeper_in_the_block_is_the_moe_scope():
    model = nn.Module()
    model.layers = nn.ModuleList([DeepMoEBlock(), DeepMoEBlock()])
    model.config = SimpleNamespace(_experts_implementation="grouped_mm")
    plan = plan_targets(model, scopes=("moe",))
    assert names_kinds(plan) == per_layer("layers", ".ffn.moe", MOE)
    assert [t.module for t in plan.targets] == [b.ffn.moe for b in model.layers]


def test_a_block_at_the_root_names_its_pieces_without_a_prefix():
    block = ToyBlock(moe=True)
    block.config = SimpleNamespace(_experts_implementation="grouped_mm")
    assert find_moe(block) == ("ffn", block.ffn, "ffn.router", block.ffn.router)
    found = DiscoveredBlock(
        "",
        block,
        Target("attn", block.attn, ATTENTION, ""),
        Target("ffn.router", block.ffn.router, ROUTER, ""),
        "ffn",
        moe_module=block.ffn,
    )
    scoped = scope_block(found, block, ("moe", "attention"))
    assert scoped.pieces == (("attn", block.attn, "attention"), ("ffn", block.ffn, "moe"))
    assert scoped.offer.experts == "grouped_mm"


class OneArgAttention(TwoProjections):
    """A declared attention class whose forward takes one tensor, like a dense MLP."""


class OneArgAttentionLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = OneArgAttention(), TwoProjections()


class DeclaresOneArgAttention(nn.Module):
    _no_split_modules = ["OneArgAttentionLayer"]
    _can_record_outputs = {"attentions": OneArgAttention}

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([OneArgAttentionLayer()])


def test_the_attention_is_never_taken_for_the_dense_mlp():
    model = DeclaresOneArgAttention()
    (found,) = discover_blocks(model)
    layer = model.layers[0]
    assert found.mlp == Target("layers.0.mlp", layer.mlp, "mlp", "layers.0")
    scoped = scope_block(found, model, ("attention", "mlp"))
    assert scoped.pieces == (
        ("layers.0.attn", layer.attn, "attention"),
        ("layers.0.mlp", layer.mlp, "mlp"),
    )


def test_an_empty_or_unset_implementation_states_nothing():
    model = toy_model()
    model.config = SimpleNamespace(_experts_implementation="")
    assert experts_implementation(model.layers[1].ffn, model) is None
    model.config = SimpleNamespace(_experts_implementation={"text_config": "grouped_mm"})
    assert experts_implementation(model.layers[1].ffn, model) is None


def test_the_experts_own_sub_config_finds_its_key_in_the_configs_above():
    text = SimpleNamespace(_experts_implementation={"": "eager", "text_config": "grouped_mm"})
    outer = SimpleNamespace(
        # A key without its attribute, and another sub-config, come first.
        sub_configs={"audio_config": object, "vision_config": object, "text_config": object},
        vision_config=SimpleNamespace(),
        text_config=text,
        _experts_implementation="eager",
    )
    model = toy_model()
    model.config = outer
    model.layers[1].ffn.experts.config = text
    assert experts_implementation(model.layers[1].ffn, model) == "grouped_mm"


def test_a_config_above_without_sub_configs_leaves_the_main_key():
    model = toy_model()
    model.config = SimpleNamespace(_experts_implementation="eager")
    model.layers[1].ffn.experts.config = SimpleNamespace(_experts_implementation={"": "batched_mm"})
    assert experts_implementation(model.layers[1].ffn, model) == "batched_mm"


def test_find_mlp_without_a_prefix_and_logs_only_several(caplog):
    block = nn.Module()
    block.ffn = TwoProjections()
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.discovery"):
        assert find_mlp(block) == ("ffn", block.ffn)
    assert "several" not in caplog.text
    block.ffn_b = TwoProjections()
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.discovery"):
        find_mlp(block, "blk")
    assert "block blk has several MLP-like children ['blk.ffn', 'blk.ffn_b']" in caplog.text


@pytest.mark.parametrize(
    "value, error, absent",
    [
        (5, CudaGraphsTypeError, "for one scope write"),
        (("zzzz",), CudaGraphsValueError, "did you mean"),
    ],
)
def test_check_scopes_hints_only_where_they_help(value, error, absent):
    with pytest.raises(error) as caught:
        check_scopes(value)
    assert absent not in str(caught.value)
    assert repr(value[0] if isinstance(value, tuple) else value) in str(caught.value)


def test_why_nothing_found_lists_every_scope():
    why = why_nothing_found([toy_model()], include=None, scopes=("layer", "moe"))
    assert "looking for scopes layer, moe;" in why
