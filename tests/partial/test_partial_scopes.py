"""Scopes (``layer``, ``moe``, ``mlp``, ``attention``, ``moe_router``): the targets per
block for each scope set on tiny Hugging Face models (dense, MoE, MoE with shared
experts, GPT-2's Conv1D, hybrid Mamba and linear-attention), the narrowing with its
reasons (eager and unknown experts, no attention), the argument checks, and the
graph-safety rules as pure functions (CPU only)."""

import functools
import logging
from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from _hf_models import CONFIGS, tiny, tiny_arch
from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError, TargetSelectionError
from cudagraphs.partial.discovery import DiscoveredBlock, Target, discover_blocks
from cudagraphs.partial.planning import TargetPlan, plan_targets, select_targets, why_nothing_found
from cudagraphs.partial.scopes import (
    SCOPES,
    BlockOffer,
    ScopeChoice,
    check_scopes,
    choose_scopes,
    experts_implementation,
    find_mlp,
    scope_block,
    static_experts,
)
from cudagraphs.partial.skips import NarrowedBlock

A, R, L, M, P = "attention", "router", "layer", "moe", "mlp"
NO_SCOPE = "no_graph_safe_scope"
ATTN_ROUTER = ("attention", "moe_router")
SETS = {"layer": ("layer",), "moe": ("moe",), "mlp": ("mlp",), "attn_router": ATTN_ROUTER}
SETS["all"] = SCOPES


@functools.cache
def model_of(family: str) -> nn.Module:
    """One tiny model per family for the read-only tests (planning modifies nothing)."""
    return tiny(family) if family in CONFIGS else tiny_arch(family)


def per_layer(stack: str, suffix: str, kind: str, layers=(0, 1)) -> list[tuple[str, str]]:
    return [(f"{stack}.{i}{suffix}", kind) for i in layers]


def skipped(stack: str, layers=(0, 1)) -> list[tuple[str, str]]:
    return [(f"{stack}.{i}", NO_SCOPE) for i in layers]


def moe_attn_router(stack="model.layers") -> list[tuple[str, str]]:
    return [
        t for i in (0, 1) for t in ((f"{stack}.{i}.self_attn", A), (f"{stack}.{i}.mlp.gate", R))
    ]


ML = "model.layers"
MOE_FAMILY = {
    "layer": (per_layer(ML, "", L), [], []),
    "moe": (per_layer(ML, ".mlp", M), [], []),
    "mlp": ([], skipped(ML), []),
    "attn_router": (moe_attn_router(), [], []),
    "all": (per_layer(ML, "", L), [], []),
}
# family -> scope set -> (targets (name, kind), skipped (name, reason),
# narrowed (name, wanted, got, reason))
EXPECTED = {
    "llama": {
        "layer": (per_layer(ML, "", L), [], []),
        "moe": ([], skipped(ML), []),
        "mlp": (per_layer(ML, ".mlp", P), [], []),
        "attn_router": (per_layer(ML, ".self_attn", A), [], []),
        "all": (per_layer(ML, "", L), [], []),
    },
    "qwen3_moe": MOE_FAMILY,
    "mixtral": MOE_FAMILY,
    # Layer 0 is dense (first_k_dense_replace=1), layer 1 MoE with shared experts.
    "deepseek_v3": {
        "layer": (per_layer(ML, "", L), [], []),
        "moe": ([(f"{ML}.1.mlp", M)], skipped(ML, [0]), []),
        "mlp": ([(f"{ML}.0.mlp", P)], skipped(ML, [1]), []),
        "attn_router": (
            [(f"{ML}.0.self_attn", A), (f"{ML}.1.self_attn", A), (f"{ML}.1.mlp.gate", R)],
            [],
            [],
        ),
        "all": (per_layer(ML, "", L), [], []),
    },
    # Conv1D projections: only the 2-D-weight rule finds GPT-2's MLP.
    "gpt2": {
        "layer": (per_layer("transformer.h", "", L), [], []),
        "moe": ([], skipped("transformer.h"), []),
        "mlp": (per_layer("transformer.h", ".mlp", P), [], []),
        "attn_router": (per_layer("transformer.h", ".attn", A), [], []),
        "all": (per_layer("transformer.h", "", L), [], []),
    },
    # Layers 0/2: Mamba + MoE; 1: attention + MLP; 3: Mamba + MLP.
    "jamba": {
        "layer": ([(f"{ML}.1", L)], skipped(ML, [0, 2, 3]), []),
        "moe": (
            [(f"{ML}.0.feed_forward", M), (f"{ML}.2.feed_forward", M)],
            skipped(ML, [1, 3]),
            [],
        ),
        "mlp": (
            [(f"{ML}.1.feed_forward", P), (f"{ML}.3.feed_forward", P)],
            skipped(ML, [0, 2]),
            [],
        ),
        "attn_router": (
            [(f"{ML}.0.feed_forward.router", R), (f"{ML}.1.self_attn", A)]
            + [(f"{ML}.2.feed_forward.router", R)],
            skipped(ML, [3]),
            [],
        ),
        "all": (
            [(f"{ML}.0.feed_forward", M), (f"{ML}.1", L), (f"{ML}.2.feed_forward", M)]
            + [(f"{ML}.3.feed_forward", P)],
            [],
            [
                (f"{ML}.0", "layer", ("moe",), "no_attention"),
                (f"{ML}.2", "layer", ("moe",), "no_attention"),
                (f"{ML}.3", "layer", ("mlp",), "no_attention"),
            ],
        ),
    },
    # Layers 0/2: Gated DeltaNet (never attention); 1/3 attention; layer 2 dense.
    "qwen3_next": {
        "layer": ([(f"{ML}.1", L), (f"{ML}.3", L)], skipped(ML, [0, 2]), []),
        "moe": (per_layer(ML, ".mlp", M, [0, 1, 3]), skipped(ML, [2]), []),
        "mlp": ([(f"{ML}.2.mlp", P)], skipped(ML, [0, 1, 3]), []),
        "attn_router": (
            [(f"{ML}.0.mlp.gate", R), (f"{ML}.1.self_attn", A), (f"{ML}.1.mlp.gate", R)]
            + [(f"{ML}.3.self_attn", A), (f"{ML}.3.mlp.gate", R)],
            skipped(ML, [2]),
            [],
        ),
        "all": (
            [(f"{ML}.0.mlp", M), (f"{ML}.1", L), (f"{ML}.2.mlp", P), (f"{ML}.3", L)],
            [],
            [
                (f"{ML}.0", "layer", ("moe",), "no_attention"),
                (f"{ML}.2", "layer", ("mlp",), "no_attention"),
            ],
        ),
    },
}


def names_kinds(plan: TargetPlan) -> list[tuple[str, str]]:
    return [(t.name, t.kind) for t in plan.targets]


def narrowings(plan: TargetPlan) -> list[tuple[str, str, tuple[str, ...], str]]:
    return [(n.name, n.wanted, n.got, n.reason) for n in plan.narrowed]


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
def test_attention_and_router_scopes_equal_the_default_plan(family):
    model = model_of(family)
    default, scoped = plan_targets(model), plan_targets(model, scopes=ATTN_ROUTER)
    assert plan_targets(model, scopes=None) == default
    assert scoped.targets == default.targets
    assert [(s.name, s.reason) for s in scoped.skipped] == [
        (s.name, s.reason) for s in default.skipped
    ]
    assert default.narrowed == [] and scoped.narrowed == []


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
        (f"{ML}.{i}", "layer", ATTN_ROUTER, "eager_experts") for i in (0, 1)
    ]
    detail = plan.narrowed[0].detail
    assert "'eager'" in detail and "graphed at attention + moe_router instead" in detail
    assert "model.set_experts_implementation('grouped_mm')" in detail

    plan = plan_targets(model, scopes=("moe", "moe_router"))
    assert names_kinds(plan) == per_layer(ML, ".mlp.gate", R)
    assert narrowings(plan) == [
        (f"{ML}.{i}", "moe", ("moe_router",), "eager_experts") for i in (0, 1)
    ]

    # Nothing narrower asked for: the blocks are skipped, the detail says why.
    plan = plan_targets(model, scopes=("moe",))
    assert plan.targets == [] and plan.narrowed == []
    assert [s.reason for s in plan.skipped] == [NO_SCOPE, NO_SCOPE]
    assert "'eager'" in plan.skipped[0].detail
    assert "set_experts_implementation('grouped_mm')" in plan.skipped[0].detail

    model.set_experts_implementation("batched_mm")
    assert names_kinds(plan_targets(model, scopes=SCOPES)) == per_layer(ML, "", L)


def test_an_implementation_not_known_to_be_static_is_unknown():
    model = tiny("mixtral")
    model.config._experts_implementation = "some_kernel"  # the experts share this config
    plan = plan_targets(model, scopes=SCOPES)
    assert narrowings(plan) == [
        (f"{ML}.{i}", "layer", ATTN_ROUTER, "unknown_experts") for i in (0, 1)
    ]
    assert "'some_kernel', not one known to keep static shapes" in plan.narrowed[0].detail


# --- a user model: structure only, no config ------------------------------------------


class ToyAttention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None):
        return self.o(self.q(hidden_states))


class ToyMoE(nn.Module):
    def __init__(self, d=8, n=2):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, hidden_states):
        return sum(e(hidden_states) for e in self.experts)


class ToyBlock(nn.Module):
    def __init__(self, d=8, moe=False):
        super().__init__()
        self.attn = ToyAttention(d)
        self.norm = nn.LayerNorm(d)
        self.ffn = ToyMoE(d) if moe else nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))


def toy_model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([ToyBlock(), ToyBlock(moe=True)])
    return model


def test_user_moe_with_unknown_experts_is_narrowed():
    model = toy_model()
    assert experts_implementation(model.layers[1].ffn, model) is None
    plan = plan_targets(model, scopes=SCOPES)
    assert names_kinds(plan) == [
        ("layers.0", L),
        ("layers.1.attn", A),
        ("layers.1.ffn.router", R),
    ]
    assert narrowings(plan) == [("layers.1", "layer", ATTN_ROUTER, "unknown_experts")]
    assert plan.source == "structure"
    detail = plan.narrowed[0].detail
    assert "not stated" in detail and "include=['layers.1.ffn']" in detail
    assert names_kinds(plan_targets(model, scopes=("mlp",))) == [("layers.0.ffn", P)]


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
        t for i in (0, 1) for t in ((f"layers.{i}.attn", A), (f"layers.{i}.router", R))
    ]
    assert plan.narrowed == []
    plan = plan_targets(model, scopes=("moe",))
    assert plan.targets == [] and "no MoE sublayer" in plan.skipped[0].detail
    assert names_kinds(plan_targets(model, scopes=SCOPES)) == per_layer("layers", "", L)


@pytest.mark.parametrize(
    "stated, layer_1",
    [
        ("grouped_mm", [("layers.1", L)]),
        ({"": "batched_mm"}, [("layers.1", L)]),
        ({"text_config": "grouped_mm"}, [("layers.1.attn", A), ("layers.1.ffn.router", R)]),
        ("eager", [("layers.1.attn", A), ("layers.1.ffn.router", R)]),
    ],
    ids=["str", "dict-main", "dict-other-key", "eager"],
)
def test_user_model_config_states_the_implementation(stated, layer_1):
    model = toy_model()
    model.config = SimpleNamespace(_experts_implementation=stated)
    assert names_kinds(plan_targets(model, scopes=SCOPES)) == [("layers.0", L)] + layer_1


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


# --- the choice rules alone -----------------------------------------------------------


def offer(
    attention=True, router=False, moe=False, experts=None, mlp=False, on_device=True
) -> BlockOffer:
    return BlockOffer(attention, router, moe, experts, mlp, on_device)


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
    ],
)
def test_choose_scopes(block, requested, choice):
    assert choose_scopes(block, requested) == choice


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
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.scopes"):
        assert find_mlp(block, "b", taken=["b.attn"]) == ("b.mlp_a", block.mlp_a)
    assert "several MLP-like children ['b.mlp_a', 'b.mlp_b']" in caplog.text
    # A child holding a taken module (the MoE sublayer deeper inside) is not dense.
    assert find_mlp(block, "b", taken=["b.attn", "b.mlp_a.up"]) == ("b.mlp_b", block.mlp_b)


# --- include, wrappers, and what is refused --------------------------------------------


def test_include_inside_a_chosen_layer_is_refused():
    model = model_of("deepseek_v3")
    with pytest.raises(TargetSelectionError, match=f"lies inside target {ML}.1;"):
        plan_targets(model, scopes=("layer",), include=f"{ML}.*.mlp.shared_experts")


def test_include_of_a_chosen_scope_target_is_not_added_twice():
    model = model_of("llama")
    plan = plan_targets(model, scopes=("mlp",), include=f"{ML}.*.mlp")
    assert names_kinds(plan) == per_layer(ML, ".mlp", P)


def test_empty_scopes_take_include_alone():
    model = model_of("llama")
    plan = plan_targets(model, scopes=())
    assert plan.targets == []
    assert [s.reason for s in plan.skipped] == ["nothing_asked", "nothing_asked"]
    assert "scopes=()" in plan.skipped[0].detail
    plan = plan_targets(model, scopes=[], include=f"{ML}.0.mlp")
    assert names_kinds(plan) == [(f"{ML}.0.mlp", "custom")]
    assert [s.name for s in plan.skipped] == [f"{ML}.1"]


def test_checkpoint_wrapped_modules_are_the_targets():
    model = tiny("qwen3_moe")
    inner = [layer.mlp for layer in model.model.layers]
    for layer in model.model.layers:
        layer.mlp = checkpoint_wrapper(layer.mlp)
    plan = plan_targets(model, scopes=("moe",))
    assert names_kinds(plan) == per_layer(ML, ".mlp", M)
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
    ],
)
def test_scopes_with_flags_switched_off_are_refused(flags, named):
    with pytest.raises(CudaGraphsValueError, match=f"{named}: .*use one or the other"):
        plan_targets(model_of("llama"), scopes=("layer",), **flags)
    with pytest.raises(CudaGraphsTypeError, match="attention must be a bool"):
        plan_targets(model_of("llama"), scopes=("layer",), attention=1)


def test_why_nothing_found_names_the_scopes():
    model = toy_model()
    why = why_nothing_found([model], attention=True, router=True, include=None, scopes=("moe",))
    assert "looking for scopes moe" in why
    why = why_nothing_found([model], attention=True, router=True, include=None, scopes=())
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
    assert names_kinds(plan) == per_layer("layers", ".ffn.moe", M)
    assert [t.module for t in plan.targets] == [b.ffn.moe for b in model.layers]


def test_a_block_at_the_root_names_its_pieces_without_a_prefix():
    block = ToyBlock(moe=True)
    block.config = SimpleNamespace(_experts_implementation="grouped_mm")
    found = DiscoveredBlock(
        "",
        block,
        Target("attn", block.attn, A, ""),
        Target("ffn.router", block.ffn.router, R, ""),
        "ffn",
    )
    scoped = scope_block(found, block, ("moe", "attention"))
    assert scoped.pieces == (("attn", block.attn, "attention"), ("ffn", block.ffn, "moe"))
    assert scoped.offer.experts == "grouped_mm"


class OneArgAttention(TwoProjections):
    """A declared attention class whose forward takes one tensor, like a dense MLP."""


def test_the_attention_is_never_taken_for_the_dense_mlp():
    block = nn.Module()
    block.attn, block.mlp = OneArgAttention(), TwoProjections()
    found = DiscoveredBlock("b", block, Target("b.attn", block.attn, A, "b"), None, None)
    scoped = scope_block(found, block, ("attention", "mlp"))
    assert scoped.pieces == (("b.attn", block.attn, "attention"), ("b.mlp", block.mlp, "mlp"))


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
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.scopes"):
        assert find_mlp(block) == ("ffn", block.ffn)
    assert "several" not in caplog.text
    block.ffn_b = TwoProjections()
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.scopes"):
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
    why = why_nothing_found(
        [toy_model()], attention=True, router=True, include=None, scopes=("layer", "moe")
    )
    assert "looking for scopes layer, moe;" in why
