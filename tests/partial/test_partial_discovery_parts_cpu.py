"""Discovery of partial-graph targets on the CPU: modules invoked more than once per
forward, model parts, why nothing was found, model_label, and what a declared layer
class means."""

import logging
from types import SimpleNamespace

import pytest
from torch import nn

from cudagraphs.errors import CudaGraphsTypeError
from cudagraphs.partial import (
    TargetSelectionError,
    discover_blocks,
    model_label,
    plan_targets,
    select_targets,
)
from cudagraphs.partial.arguments import as_model_parts
from cudagraphs.partial.planning import why_nothing_found
from helpers.discovery import (
    ATTN,
    ATTN_ROUTER,
    EXPECTED_TARGETS,
    ToyModel,
    names_kinds,
)
from helpers.hf_models import tiny

# --- physical modules invoked more than once per forward ------------------------------


def test_tied_layers_in_one_stack_are_rejected():
    model = tiny("llama")
    model.model.layers.append(model.model.layers[0])  # layers 0 and 2 are one object
    with pytest.raises(TargetSelectionError) as err:
        select_targets(model, scopes=ATTN_ROUTER)
    assert "model.layers.0.self_attn" in str(err.value)
    assert "model.layers.2.self_attn" in str(err.value)


def test_mtp_reusing_a_main_layer_is_rejected():
    model = ToyModel()
    model.mtp[0] = model.layers[0]
    with pytest.raises(TargetSelectionError) as err:
        select_targets(model, scopes=ATTN_ROUTER)
    msg = str(err.value)
    assert "layers.0.attn" in msg and "mtp.0.attn" in msg and "same module object" in msg


def test_shared_attention_between_blocks_is_rejected():
    model = tiny("llama")
    model.model.layers[1].self_attn = model.model.layers[0].self_attn
    with pytest.raises(TargetSelectionError) as err:
        select_targets(model, scopes=ATTN_ROUTER)
    assert ATTN.format(0) in str(err.value) and ATTN.format(1) in str(err.value)
    # Leaving the shared module out of the targets is the documented way around it.
    assert select_targets(model, scopes=("moe_router",)) == []


# --- model parts -------------------------------------------------------------------------


def test_as_model_parts_of_one_module_or_a_sequence():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert as_model_parts(a) == [a]
    stack = nn.ModuleList([a, b])
    assert as_model_parts(stack) == [stack], "a ModuleList is one module"
    assert as_model_parts([a, b]) == [a, b]
    assert as_model_parts((a,)) == [a]
    assert as_model_parts(m for m in (b, a)) == [b, a]
    assert as_model_parts([]) == []


@pytest.mark.parametrize(
    "bad, named",
    [
        ("model", "model_parts must be an nn.Module or a sequence of them .*, got str$"),
        (b"model", "model_parts must be an nn.Module or a sequence of them .*, got bytes$"),
        (5, "model_parts must be an nn.Module or a sequence of them .*, got int$"),
        ([nn.Linear(2, 2), 3], r"^model_parts\[1\] must be an nn.Module, got int 3$"),
    ],
    ids=["str", "bytes", "int", "list with an int"],
)
def test_as_model_parts_of_another_type_is_a_typed_error(bad, named):
    with pytest.raises(CudaGraphsTypeError, match=named):
        as_model_parts(bad)


# --- why nothing was found ------------------------------------------------------------


def test_why_nothing_found_names_what_was_searched_and_asked_and_the_fixes():
    # The manager logs this line as it is: it is this function's whole product.
    why = why_nothing_found([ToyModel(), nn.Linear(2, 2)], include=["x.*"], scopes=ATTN_ROUTER)
    assert why == (
        "in ToyModel with 3 block(s), Linear with 0 block(s), looking for scopes "
        "attention, moe_router, include=['x.*']; blocks are found in a ModuleList/ModuleDict of "
        "same-typed modules that each hold an attention module. Fixes: 1. pass include= "
        "naming the modules to graph; 2. pass the model parts that hold the decoder layers"
    )


@pytest.mark.parametrize(
    "scopes, include, asked",
    [
        (("attention",), None, "looking for scopes attention; "),
        (("moe_router",), None, "looking for scopes moe_router; "),
        ((), "*.mlp", "looking for include='*.mlp'; "),
    ],
)
def test_why_nothing_found_lists_only_what_was_asked(scopes, include, asked):
    why = why_nothing_found([nn.Linear(2, 2)], include=include, scopes=scopes)
    assert why.startswith("in Linear with 0 block(s), " + asked), why


def test_why_nothing_found_when_nothing_was_asked_or_given():
    assert (
        why_nothing_found([nn.Linear(2, 2)], include=None, scopes=())
        == "in Linear with 0 block(s): scopes=() and no include: nothing asked for"
    )
    assert why_nothing_found([], include=None, scopes=ATTN_ROUTER) == "no model parts were given"


# --- model_label is only a label ----------------------------------------------------


def test_model_label_is_not_a_capability_gate():
    base = tiny("qwen3_moe")
    renamed_cls = type("SomethingElse", (type(base),), {})
    renamed = tiny("qwen3_moe")
    renamed.__class__ = renamed_cls
    assert model_label(base) == "Qwen3MoeForCausalLM with 2 block(s)"
    assert model_label(renamed) == "SomethingElse with 2 block(s)"
    assert names_kinds(select_targets(renamed, scopes=ATTN_ROUTER)) == names_kinds(
        select_targets(base, scopes=ATTN_ROUTER)
    )

    # A model with no recognizable name at all (a bare container) still works.
    anonymous = nn.Module()
    anonymous.body = base.model
    assert [t.name for t in select_targets(anonymous, scopes=ATTN_ROUTER)] == [
        "body." + name.removeprefix("model.") for name, _ in EXPECTED_TARGETS["qwen3_moe"]
    ]
    assert model_label(ToyModel()) == "ToyModel with 3 block(s)"


# --- declarations: what a layer class alone, or one held nowhere, means ------------------


class _Attn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None):
        return self.o(self.q(hidden_states))


class _MoE(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.gate = nn.Linear(d, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(2))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.ffn = _Attn(), _MoE()


class _AttentionDeclared(nn.Module):
    """Declares its layer and attention classes but no router class."""

    _no_split_modules = ["_Layer"]
    _can_record_outputs = {"attentions": _Attn}

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])


def test_a_declaration_without_a_router_class_finds_routers_by_structure():
    plan = plan_targets(_AttentionDeclared(), scopes=ATTN_ROUTER)
    assert plan.source == "metadata"
    assert names_kinds(plan.targets) == [
        t
        for i in (0, 1)
        for t in ((f"layers.{i}.attn", "attention"), (f"layers.{i}.ffn.gate", "router"))
    ]


class _AttnLayer(_Attn):
    """A layer that is its own attention module."""


class _SelfAttentionLayers(nn.Module):
    _no_split_modules = ["_AttnLayer"]
    # Declared with a layer name: the qualified name of the layer must hold ".layers.".
    _can_record_outputs = {
        "attentions": SimpleNamespace(target_class=_AttnLayer, layer_name="layers")
    }

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_AttnLayer(), _AttnLayer()])


def test_a_layer_declared_as_attention_by_its_qualified_name_is_the_target():
    assert names_kinds(select_targets(_SelfAttentionLayers(), scopes=ATTN_ROUTER)) == [
        ("layers.0", "attention"),
        ("layers.1", "attention"),
    ]


class _Gate(nn.Linear):
    pass


class _GatedMoE(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.gate = _Gate(d, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(2))


class _TwoRouters(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.ffn_a, self.ffn_b = _Attn(), _GatedMoE(), _GatedMoE()


class _RoutersDeclared(nn.Module):
    _no_split_modules = ["_TwoRouters"]
    _can_record_outputs = {"attentions": _Attn, "router_logits": _Gate}

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_TwoRouters()])


def test_several_declared_routers_take_the_first_and_say_so(caplog):
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.metadata"):
        (block,) = discover_blocks(_RoutersDeclared())
    assert block.router.name == "layers.0.ffn_a.gate"
    assert "several router modules" in caplog.text


class _Elsewhere(nn.Module):
    """Declares a layer class it does not hold: its stack is found by structure."""

    _no_split_modules = ["NotHere"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])


@pytest.mark.parametrize("nested, named", [(True, "inner"), (False, "the model part")])
def test_a_declaration_held_nowhere_is_not_in_force_and_says_so(caplog, nested, named):
    model = nn.Module()
    model.inner = _Elsewhere()
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.discovery"):
        blocks = discover_blocks(model if nested else model.inner)
    prefix = "inner." if nested else ""
    assert [(b.name, b.source) for b in blocks] == [
        (f"{prefix}layers.{i}", "structure") for i in (0, 1)
    ]
    (message,) = [r.getMessage() for r in caplog.records if "declares decoder layers" in r.message]
    assert message.startswith(f"{named} (_Elsewhere) declares decoder layers ['NotHere']")


def test_each_skipped_and_narrowed_block_is_logged(caplog):
    model = nn.Module()
    model.layers = nn.ModuleList([_Layer(), _Layer()])  # experts implementation not stated
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.planning"):
        plan = plan_targets(model, scopes=("layer", "attention"))
        skipped = plan_targets(model, scopes=("mlp",)).skipped
    messages = [r.getMessage() for r in caplog.records]
    for n in plan.narrowed:
        assert f"partial graphs: narrowed {n.name} ({n.reason}): {n.detail}" in messages
    for s in skipped:
        assert f"partial graphs: skipped {s.name} ({s.reason}): {s.detail}" in messages
    assert len(plan.narrowed) == len(skipped) == 2
