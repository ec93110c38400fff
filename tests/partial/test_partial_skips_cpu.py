"""The skipped and narrowed block records (``partial/skips.py``): what each detail
carries (the block's name and class, what it holds, what was looked for and why it was
refused, the fixes as numbered options with the module to name), not its prose
(CPU only)."""

import functools
import re

import pytest
from torch import nn

from cudagraphs.moe_kernels import GroupedMMProbe
from cudagraphs.partial.planning import plan_targets
from cudagraphs.partial.scopes import BlockOffer, ScopeChoice, ScopedBlock
from cudagraphs.partial.skips import narrow_record, scoped_skip_record
from cudagraphs.partial.vocabulary import SCOPES, DiscoveredBlock
from helpers.hf_models import tiny, tiny_arch

ML = "model.layers"
NO_SCOPE = "no_graph_safe_scope"
STATIC_FIX = "model.set_experts_implementation('grouped_mm')"


@functools.cache
def jamba() -> nn.Module:
    """Layers 0/2: Mamba + MoE; 1: attention + MLP; 3: Mamba + MLP (read-only use)."""
    return tiny_arch("jamba")


def fixes_of(detail: str) -> list[str]:
    """The fixes a detail ends with: ``Fix: X.`` for one, ``Fixes: 1. X; 2. Y.`` for
    several (numbered from 1, each once)."""
    assert detail.endswith("."), detail
    _, several, tail = detail.rpartition(". Fixes: ")
    if not several:
        _, one, tail = detail.rpartition(". Fix: ")
        assert one, detail
        return [tail[:-1]]
    items = tail[:-1].split("; ")
    numbers = [item.split(". ", 1)[0] for item in items]
    assert numbers == [str(i) for i in range(1, len(items) + 1)], detail
    return [item.split(". ", 1)[1] for item in items]


def reason(detail: str, scope: str) -> str | None:
    """The reason a scoped skip gives for ``scope`` (``... fits it (layer: X; moe: Y).``)."""
    match = re.search(rf"(?:\(|; ){scope}: (.*?)(?:; |\)\. Fix)", detail)
    return match and match.group(1)


def says(detail: str, scope: str, *words: str) -> bool:
    """Whether the detail gives, for ``scope``, a reason holding every one of ``words``."""
    why = reason(detail, scope)
    return why is not None and all(w in why for w in words)


def the_skip(plan, name):
    (record,) = [s for s in plan.skipped if s.name == name]
    return record


# --- a scoped skip: per scope, why not ---------------------------------------------------


JAMBA_HEAD = (
    "JambaMambaDecoderLayer model.layers.0 holds mamba (JambaMambaMixer), feed_forward "
    "(JambaSparseMoeBlock), input_layernorm (JambaRMSNorm)"
)


@pytest.mark.parametrize(
    "scopes, layer, reasons",
    [
        (("layer",), 0, [("layer", "no attention module")]),
        (("attention",), 0, [("attention", "attention class JambaAttention", "JambaModel")]),
        (("moe_router",), 1, [("moe_router", "router of the class JambaTopKRouter", "JambaModel")]),
        (("mlp",), 0, [("mlp", "no dense MLP")]),
        (("moe",), 1, [("moe", "no MoE sublayer")]),
        (("layer", "mlp"), 0, [("layer", "no attention module"), ("mlp", "no dense MLP")]),
    ],
)
def test_a_scoped_skip_says_per_scope_why_not(scopes, layer, reasons):
    record = the_skip(plan_targets(jamba(), scopes=scopes), f"{ML}.{layer}")
    assert record.reason == NO_SCOPE
    block_type = type(jamba().model.layers[layer]).__name__
    assert record.block_type == block_type
    assert record.detail.startswith(f"{block_type} {ML}.{layer} holds ")
    for scope, *words in reasons:
        assert says(record.detail, scope, *words), (scope, record.detail)
    for scope in set(SCOPES) - set(scopes):
        assert not says(record.detail, scope), scope
    # No experts refused: the one fix names the block's mixer (or attention).
    mixer = "mamba" if layer == 0 else "self_attn"
    (fix,) = fixes_of(record.detail)
    assert f"include=['{ML}.{layer}.{mixer}']" in fix
    assert STATIC_FIX not in record.detail
    # The other blocks hold attention: no word of attention classes being replaced.
    assert "no block of this model part holds one" not in record.detail


def test_a_scoped_skip_names_what_the_block_holds():
    record = the_skip(plan_targets(jamba(), scopes=("layer",)), f"{ML}.0")
    assert record.detail.startswith(JAMBA_HEAD)


def test_eager_experts_refuse_layer_and_moe_with_the_switch_as_fix():
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    for scope in ("layer", "moe"):
        record = the_skip(plan_targets(model, scopes=(scope,)), f"{ML}.0")
        assert says(record.detail, scope, f"{ML}.0.mlp", "'eager'", "sync")
        assert "not one known" not in record.detail
        fixes = fixes_of(record.detail)
        assert len(fixes) == 3 and STATIC_FIX in fixes[0]
        assert "include=['model.layers.0.self_attn']" in fixes[2]


def test_grouped_mm_on_the_host_refuses_layer_and_moe_with_bf16_and_batched_mm_as_fixes(
    monkeypatch,
):
    monkeypatch.setattr(GroupedMMProbe, "on_device", lambda self, weight: False)
    model = tiny("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    for scope in ("layer", "moe"):
        record = the_skip(plan_targets(model, scopes=(scope,)), f"{ML}.0")
        assert says(record.detail, scope, f"{ML}.0.mlp", "'grouped_mm'", "host")
        fixes = fixes_of(record.detail)
        assert "bfloat16" in fixes[0] and "'batched_mm'" in fixes[1], fixes


def test_unknown_experts_refuse_layer_and_moe_naming_the_implementation():
    model = tiny("mixtral")
    model.config._experts_implementation = "some_kernel"
    for scope in ("layer", "moe"):
        record = the_skip(plan_targets(model, scopes=(scope,)), f"{ML}.1")
        assert says(record.detail, scope, f"{ML}.1.mlp", "'some_kernel'", "not one known")
        assert "'eager'" not in record.detail
        assert STATIC_FIX in fixes_of(record.detail)[0]


class Attn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None):
        return self.o(self.q(hidden_states))


class MoE(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.router = nn.Linear(d, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(2))


class Block(nn.Module):
    def __init__(self, moe=True):
        super().__init__()
        self.attn = Attn()
        self.ffn = MoE() if moe else nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def user_model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([Block(moe=False), Block()])
    return model


def test_unstated_experts_fix_names_the_moe_sublayer():
    plan = plan_targets(user_model(), scopes=("moe",))
    dense, moe = plan.skipped
    assert says(dense.detail, "moe", "no MoE sublayer")
    assert says(moe.detail, "moe", "layers.1.ffn is not stated", "config._experts_implementation")
    first, second, last = fixes_of(moe.detail)
    assert "include=['layers.1.ffn']" in first and "moe_router" in first
    assert STATIC_FIX in second
    assert "include=['layers.1.attn']" in last


# --- a narrowed block ---------------------------------------------------------------------


def test_a_narrowing_gives_every_refusal_and_every_fix_once():
    model = tiny_arch("jamba")
    model.set_experts_implementation("eager")
    record = plan_targets(model, scopes=SCOPES).narrowed[0]
    assert (record.name, record.wanted, record.got, record.reason) == (
        f"{ML}.0",
        "layer",
        ("moe_router",),
        "no_attention",
    )
    assert record.block_type == "JambaMambaDecoderLayer"
    # The refusals are those a skip of the same block gives for layer and moe, in order.
    skip = the_skip(plan_targets(model, scopes=("layer", "moe")), f"{ML}.0")
    no_attention, eager = reason(skip.detail, "layer"), reason(skip.detail, "moe")
    assert "no attention module" in no_attention
    assert f"{ML}.0.feed_forward" in eager and "'eager'" in eager
    assert f"but {no_attention}; {eager}; graphed at moe_router instead." in record.detail
    mixer, static, manager = fixes_of(record.detail)
    assert "include=['model.layers.0.mamba']" in mixer
    assert STATIC_FIX in static and "experts-implementation option" in manager


def test_a_narrowing_of_unstated_experts_names_the_moe_sublayer():
    (record,) = plan_targets(user_model(), scopes=SCOPES).narrowed
    by_name, transformers = fixes_of(record.detail)
    assert "include=['layers.1.ffn']" in by_name
    assert "set_experts_implementation('grouped_mm')" in transformers


def bare_block(name="b", module=None) -> DiscoveredBlock:
    return DiscoveredBlock(name, module or nn.Identity(), None, None, None)


def scoped(choice: ScopeChoice, **offer) -> ScopedBlock:
    flags = dict(attention=False, router=False, moe=False, experts=None, mlp=False) | offer
    return ScopedBlock(BlockOffer(**flags), choice, ())


@pytest.mark.parametrize(
    "choice",
    [
        ScopeChoice(("attention",)),  # nothing refused
        ScopeChoice(("attention",), None, ("no_attention",)),
        ScopeChoice(("attention",), "layer", ()),
        ScopeChoice((), "layer", ("no_attention",)),  # nothing taken: a skip
    ],
)
def test_a_narrowing_record_needs_a_refusal_and_a_scope_taken(choice):
    with pytest.raises(AssertionError):
        narrow_record(bare_block(), scoped(choice), "b")


# --- what a skip says of the block ---------------------------------------------------------


def test_a_block_holding_nothing_says_so():
    record = scoped_skip_record(
        bare_block(),
        scoped(ScopeChoice(())),
        requested=("attention", "moe_router"),
        attention_anywhere=True,
        example="b",
    )
    assert record.block_type == "Identity"
    assert record.detail.startswith("Identity b holds no submodules;")
    assert says(record.detail, "attention", "attention-like child")
    assert says(record.detail, "moe_router", "MoE router")
    (fix,) = fixes_of(record.detail)
    assert "include=['b']" in fix
    record = scoped_skip_record(
        bare_block(),
        scoped(ScopeChoice(())),
        requested=("mlp",),
        attention_anywhere=True,
        example="b",
    )
    assert record.detail.startswith("Identity b holds no submodules;")
    assert says(record.detail, "mlp", "no dense MLP")


def test_nothing_asked_names_the_block_and_the_fixes():
    plan = plan_targets(jamba(), scopes=())
    assert [s.reason for s in plan.skipped] == ["nothing_asked"] * 4
    record = plan.skipped[0]
    assert record.block_type == "JambaMambaDecoderLayer"
    assert record.detail.startswith(JAMBA_HEAD)
    assert "scopes=()" in record.detail and "include=" in record.detail


class Mixer(nn.Module):  # neither attention nor an MLP: called with a cache
    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, cache=None):
        return self.b(self.a(hidden_states))


class AttnA(Attn):
    pass


class AttnB(Attn):
    pass


class MixerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer()


class LayersOnly(nn.Module):
    """Declares its layer class and nothing else: attention and routers by structure."""

    _no_split_modules = ["MixerLayer"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MixerLayer(), MixerLayer()])


class TwoAttentionClasses(LayersOnly):
    """Declares two attention classes, neither of which is left in the model."""

    _can_record_outputs = {"attentions": [AttnA, AttnB]}


def test_a_layer_class_alone_looks_for_attention_by_structure():
    (record, _) = plan_targets(LayersOnly()).skipped
    assert "attention-like child" in record.detail and "MoE router" in record.detail
    assert "declares it" not in record.detail


def test_every_declared_attention_class_is_named():
    (record, _) = plan_targets(TwoAttentionClasses()).skipped
    assert "attention class AttnA or AttnB (TwoAttentionClasses declares it)" in record.detail
    # None of them in any block: the attention modules may have been replaced.
    assert "no block of this model part holds one" in record.detail
    record = the_skip(plan_targets(TwoAttentionClasses(), scopes=("attention",)), "layers.1")
    assert says(record.detail, "attention", "AttnA or AttnB", "no block of this model part")
