"""Structural discovery of partial-graph targets: HF model families built from config,
checkpoint wrappers, extra (MTP) stacks, user models and rejected selections (CPU only)."""

import logging
import re
from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from _hf_models import CONFIGS, tiny
from cudagraphs.errors import CudaGraphsError, CudaGraphsTypeError
from cudagraphs.partial import (
    DiscoveredBlock,
    Target,
    TargetSelectionError,
    discover_blocks,
    find_attention,
    find_moe,
    model_label,
    plan_targets,
    select_targets,
    unwrap_checkpoint,
)
from cudagraphs.partial.planning import why_nothing_found
from cudagraphs.partial.selectors import as_model_parts, include_predicate

ATTN = "model.layers.{}.self_attn"
ROUTER = "model.layers.{}.mlp.gate"
EXPECTED_TARGETS = {
    "llama": [(ATTN.format(0), "attention"), (ATTN.format(1), "attention")],
    "qwen3_moe": [
        (ATTN.format(0), "attention"),
        (ROUTER.format(0), "router"),
        (ATTN.format(1), "attention"),
        (ROUTER.format(1), "router"),
    ],
    "mixtral": [
        (ATTN.format(0), "attention"),
        (ROUTER.format(0), "router"),
        (ATTN.format(1), "attention"),
        (ROUTER.format(1), "router"),
    ],
    # first_k_dense_replace=1: layer 0 has a dense MLP (no router), layer 1 is MoE.
    "deepseek_v3": [
        (ATTN.format(0), "attention"),
        (ATTN.format(1), "attention"),
        (ROUTER.format(1), "router"),
    ],
}
EXPECTED_MOE = {
    "llama": [None, None],
    "qwen3_moe": ["model.layers.0.mlp", "model.layers.1.mlp"],
    "mixtral": ["model.layers.0.mlp", "model.layers.1.mlp"],
    "deepseek_v3": [None, "model.layers.1.mlp"],
}
FAMILIES = sorted(CONFIGS)


def names_kinds(targets: list[Target]) -> list[tuple[str, str]]:
    return [(t.name, t.kind) for t in targets]


# --- the four HF families -----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_targets(family):
    model = tiny(family)
    targets = select_targets(model)
    assert names_kinds(targets) == EXPECTED_TARGETS[family]
    modules = dict(model.named_modules())
    for t in targets:
        assert t.module is modules[t.name], f"{t.name} is not the model's own module"
        assert t.block == t.name.split(".self_attn")[0].split(".mlp")[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_blocks(family):
    model = tiny(family)
    blocks = discover_blocks(model)
    assert all(isinstance(b, DiscoveredBlock) for b in blocks)
    assert [b.name for b in blocks] == ["model.layers.0", "model.layers.1"]
    assert [b.module for b in blocks] == list(model.model.layers)
    assert [b.moe for b in blocks] == EXPECTED_MOE[family]
    for i, b in enumerate(blocks):
        assert b.attention is not None and b.attention.name == ATTN.format(i)
        assert b.attention.module is model.model.layers[i].self_attn
        if b.moe is None:
            assert b.router is None
        else:
            assert b.router is not None and b.router.name == ROUTER.format(i)
            assert b.router.module is model.model.layers[i].mlp.gate


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_find_moe_on_hf_layer(family):
    model = tiny(family)
    layer = model.model.layers[1]
    moe_name, moe, router_name, router = find_moe(layer, "model.layers.1")
    assert (moe_name, router_name) == ("model.layers.1.mlp", "model.layers.1.mlp.gate")
    assert moe is layer.mlp and router is layer.mlp.gate
    assert find_moe(layer.self_attn) is None


def test_find_attention_prefix():
    layer = tiny("llama").model.layers[0]
    assert find_attention(layer) == ("self_attn", layer.self_attn)
    assert find_attention(layer, "model.layers.0") == ("model.layers.0.self_attn", layer.self_attn)
    assert find_attention(layer.mlp) is None


def test_deepseek_shared_experts_only_by_include():
    model = tiny("deepseek_v3")
    assert "model.layers.1.mlp.shared_experts" not in [t.name for t in select_targets(model)]
    targets = select_targets(model, include=["model.layers.*.mlp.shared_experts"])
    assert names_kinds(targets) == EXPECTED_TARGETS["deepseek_v3"] + [
        ("model.layers.1.mlp.shared_experts", "custom")
    ]
    assert targets[-1].module is model.model.layers[1].mlp.shared_experts
    assert targets[-1].block is None


# --- activation checkpoint wrappers -------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("depth", [1, 2])
def test_checkpoint_wrapped_layers_are_unwrapped(family, depth):
    model = tiny(family)
    inner = list(model.model.layers)
    for i, layer in enumerate(inner):
        wrapped = layer
        for _ in range(depth):
            wrapped = checkpoint_wrapper(wrapped)
        model.model.layers[i] = wrapped
    assert all(unwrap_checkpoint(w) is layer for w, layer in zip(model.model.layers, inner))

    assert names_kinds(select_targets(model)) == EXPECTED_TARGETS[family]
    blocks = discover_blocks(model)
    assert [b.name for b in blocks] == ["model.layers.0", "model.layers.1"]
    assert [b.module for b in blocks] == inner, "blocks must be the wrapped layers"
    assert [b.moe for b in blocks] == EXPECTED_MOE[family]
    assert blocks[0].attention.module is inner[0].self_attn


def test_checkpoint_wrapped_attention_is_unwrapped():
    model = tiny("llama")
    attn = model.model.layers[1].self_attn
    model.model.layers[1].self_attn = checkpoint_wrapper(attn)
    targets = select_targets(model)
    assert names_kinds(targets) == EXPECTED_TARGETS["llama"]
    assert targets[1].module is attn


def test_unwrap_checkpoint_plain_module_is_itself():
    m = nn.Linear(2, 2)
    assert unwrap_checkpoint(m) is m
    assert unwrap_checkpoint(checkpoint_wrapper(checkpoint_wrapper(m))) is m


# --- user models: toy blocks and an extra (MTP) stack ---------------------------------


class ToyAttention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None):
        return self.o(self.q(hidden_states) + self.k(hidden_states) + self.v(hidden_states))


class ToyMoE(nn.Module):
    def __init__(self, d=8, n=2, router_name="router"):
        super().__init__()
        self.add_module(router_name, nn.Linear(d, n, bias=False))
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))


class ToyBlock(nn.Module):
    def __init__(self, d=8, moe=False):
        super().__init__()
        self.attn = ToyAttention(d)
        self.ffn = ToyMoE(d) if moe else nn.Linear(d, d)


class OtherBlock(nn.Module):
    """An MTP block of another type: projection plus a full block inside."""

    def __init__(self, d=8):
        super().__init__()
        self.proj = nn.Linear(2 * d, d)
        self.mixer = ToyAttention(d)


class ToyModel(nn.Module):
    def __init__(self, mtp_block=ToyBlock):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([ToyBlock(), ToyBlock(moe=True)])
        self.mtp = nn.ModuleList([mtp_block()])


@pytest.mark.parametrize("mtp_block", [ToyBlock, OtherBlock])
def test_extra_mtp_stack_is_discovered(mtp_block):
    model = ToyModel(mtp_block)
    blocks = discover_blocks(model)
    assert [b.name for b in blocks] == ["layers.0", "layers.1", "mtp.0"]
    assert [b.moe for b in blocks] == [None, "layers.1.ffn", None]
    mtp_attn = "mtp.0.attn" if mtp_block is ToyBlock else "mtp.0.mixer"
    assert names_kinds(select_targets(model)) == [
        ("layers.0.attn", "attention"),
        ("layers.1.attn", "attention"),
        ("layers.1.ffn.router", "router"),
        (mtp_attn, "attention"),
    ]


def test_module_dict_stack_and_prefix():
    stack = nn.ModuleDict({"a": ToyBlock(), "b": ToyBlock()})
    assert [b.name for b in discover_blocks(stack, "decoder")] == ["decoder.a", "decoder.b"]


def test_not_a_stack():
    # Mixed block types, or blocks without attention, are not a block stack.
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([ToyBlock(), OtherBlock()])
    assert discover_blocks(mixed) == []
    plain = nn.Module()
    plain.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    assert discover_blocks(plain) == []
    assert select_targets(plain) == []


def test_attention_is_recognized_by_capability():
    class NoContext(nn.Module):  # takes hidden states but no mask/positions
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, hidden_states):
            return self.o(self.q(hidden_states))

    class OneProjection(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)

        def forward(self, hidden_states, attention_mask=None):
            return self.q(hidden_states)

    class XAttention(ToyAttention):  # "x" plus position embeddings also qualifies
        def forward(self, x, position_embeddings=None):
            return self.o(x)

    for child, found in [(NoContext(), False), (OneProjection(), False), (XAttention(), True)]:
        block = nn.Module()
        block.mixer = child
        hit = find_attention(block, "b")
        assert (hit == ("b.mixer", child)) if found else hit is None, type(child).__name__


def test_attention_taking_position_ids_is_recognized():
    class PositionIdsAttention(ToyAttention):
        def forward(self, hidden_states, position_ids=None):
            return self.o(hidden_states)

    block = nn.Module()
    block.mixer = PositionIdsAttention()
    assert find_attention(block) == ("mixer", block.mixer)


def test_an_empty_child_slot_does_not_hide_the_children_after_it():
    # An optional submodule left out (registered as None) comes before the attention.
    block = nn.Module()
    block.register_module("cross_attn", None)
    block.attn = ToyAttention()
    assert find_attention(block) == ("attn", block.attn)
    model = nn.Module()
    model.layers = nn.ModuleList([block])
    assert names_kinds(select_targets(model)) == [("layers.0.attn", "attention")]


def test_several_attention_like_children_take_the_first_and_say_so(caplog):
    block = nn.Module()
    block.attn_a, block.attn_b = ToyAttention(), ToyAttention()
    single = nn.Module()
    single.attn = ToyAttention()
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.discovery"):
        assert find_attention(single, "one") == ("one.attn", single.attn)
        assert caplog.records == []
        assert find_attention(block, "blk") == ("blk.attn_a", block.attn_a)
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG
    assert record.getMessage() == (
        "block blk has several attention-like children ['attn_a', 'attn_b']; taking the first"
    )


def test_moe_is_recognized_by_gate_and_experts():
    assert find_moe(ToyBlock(moe=True), "blk")[::2] == ("blk.ffn", "blk.ffn.router")
    gate_named = ToyBlock()
    gate_named.ffn = ToyMoE(router_name="gate")
    assert find_moe(gate_named)[2] == "ffn.gate"

    no_experts = ToyBlock()
    no_experts.ffn = nn.Module()
    no_experts.ffn.gate = nn.Linear(8, 2)
    assert find_moe(no_experts) is None

    weightless_router = ToyBlock(moe=True)
    weightless_router.ffn.router = nn.ReLU()
    assert find_moe(weightless_router) is None

    # The block itself holding gate+experts is not "an MoE sublayer of the block".
    flat = ToyMoE(router_name="gate")
    assert find_moe(flat) is None


@pytest.mark.parametrize(
    "gate",
    [nn.LayerNorm(8), nn.Conv1d(8, 2, 1), nn.ReLU()],
    ids=["1-D weight", "3-D weight", "no weight"],
)
def test_a_gate_without_a_2d_weight_beside_experts_is_not_a_router(gate):
    # A router maps hidden states to expert logits: a 2-D weight. A norm called "gate"
    # (1-D weight) or a convolution (3-D) beside experts is not one.
    block = ToyBlock()
    block.ffn = ToyMoE(router_name="gate")
    block.ffn.gate = gate
    assert find_moe(block) is None
    model = nn.Module()
    model.layers = nn.ModuleList([block])
    assert names_kinds(select_targets(model)) == [("layers.0.attn", "attention")]
    assert discover_blocks(model)[0].router is None


def test_a_gate_with_a_non_tensor_weight_is_not_a_router():
    block = ToyBlock(moe=True)
    block.ffn.router = nn.Identity()
    block.ffn.router.weight = 2.0  # no .dim(): not a projection
    assert find_moe(block) is None


def test_the_router_name_is_tried_when_the_gate_is_not_a_router():
    block = ToyBlock(moe=True)  # ffn.router: a 2-D projection
    block.ffn.gate = nn.LayerNorm(8)  # a 1-D "gate" beside it
    assert find_moe(block, "b")[2:] == ("b.ffn.router", block.ffn.router)


# --- selection switches and include ---------------------------------------------------


def test_attention_and_router_switches():
    model = tiny("qwen3_moe")
    assert names_kinds(select_targets(model, attention=False)) == [
        (ROUTER.format(0), "router"),
        (ROUTER.format(1), "router"),
    ]
    assert names_kinds(select_targets(model, router=False)) == [
        (ATTN.format(0), "attention"),
        (ATTN.format(1), "attention"),
    ]
    assert select_targets(model, attention=False, router=False) == []


def test_include_by_predicate():
    model = tiny("mixtral")
    seen = []

    def pick(name, module):
        seen.append(name)
        return name.endswith(".mlp.experts")

    targets = select_targets(model, attention=False, router=False, include=pick)
    assert names_kinds(targets) == [
        ("model.layers.0.mlp.experts", "custom"),
        ("model.layers.1.mlp.experts", "custom"),
    ]
    assert targets[0].module is model.model.layers[0].mlp.experts
    assert "model.layers.0.self_attn.q_proj" in seen, "the predicate sees every submodule"


def test_include_predicate_is_given_each_module():
    model = tiny("llama")
    targets = select_targets(
        model, attention=False, include=lambda name, module: module is model.model.layers[1].mlp
    )
    assert names_kinds(targets) == [("model.layers.1.mlp", "custom")]


def test_include_matching_nothing_adds_nothing():
    model = tiny("llama")
    assert select_targets(model, include=["no.such.module"]) == select_targets(model)
    assert select_targets(model, include=lambda n, m: False) == select_targets(model)
    assert select_targets(model, include=[]) == select_targets(model)


def test_include_of_an_already_chosen_target_is_not_duplicated():
    model = tiny("llama")
    targets = select_targets(model, include=["*.self_attn"])
    assert names_kinds(targets) == EXPECTED_TARGETS["llama"]


def test_include_with_attention_off_takes_custom_kind():
    targets = select_targets(tiny("llama"), attention=False, include=["*.self_attn"])
    assert names_kinds(targets) == [(ATTN.format(0), "custom"), (ATTN.format(1), "custom")]


@pytest.mark.parametrize(
    "pattern, inner, outer",
    [
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj", ATTN.format(0)),
        ("model.layers.1", ATTN.format(1), "model.layers.1"),
    ],
)
def test_include_nested_in_a_target_is_rejected(pattern, inner, outer):
    model = tiny("llama")
    msg = f"target {re.escape(inner)} lies inside target {re.escape(outer)}"
    with pytest.raises(TargetSelectionError, match=msg):
        select_targets(model, include=[pattern])


def test_a_target_inside_a_top_level_include_is_rejected():
    with pytest.raises(
        TargetSelectionError, match="target layers.0.attn lies inside target layers"
    ):
        select_targets(ToyModel(), include="layers")


def test_target_selection_error_is_value_error():
    assert issubclass(TargetSelectionError, ValueError)
    assert issubclass(TargetSelectionError, CudaGraphsError)


# --- what include accepts ---------------------------------------------------------------

MLPS = [("model.layers.0.mlp", "custom"), ("model.layers.1.mlp", "custom")]


def test_include_plain_string_is_one_glob_pattern():
    # Not a sequence of one-character patterns: "*" alone would match every module.
    model = tiny("llama")
    targets = select_targets(model, attention=False, include="model.layers.*.mlp")
    assert names_kinds(targets) == MLPS
    assert targets[0].module is model.model.layers[0].mlp
    with_attention = select_targets(model, include="model.layers.*.mlp")
    assert names_kinds(with_attention) == [
        (ATTN.format(0), "attention"),
        MLPS[0],
        (ATTN.format(1), "attention"),
        MLPS[1],
    ]


@pytest.mark.parametrize(
    "include",
    [["model.layers.*.mlp"], ("model.layers.*.mlp",), ["nothing", "model.layers.?.mlp"]],
    ids=["list", "tuple", "two patterns"],
)
def test_include_list_or_tuple_of_patterns(include):
    assert names_kinds(select_targets(tiny("llama"), attention=False, include=include)) == MLPS


def test_include_predicate_as_before():
    targets = select_targets(
        tiny("llama"), attention=False, include=lambda name, module: name.endswith(".mlp")
    )
    assert names_kinds(targets) == MLPS


@pytest.mark.parametrize(
    "bad, named",
    [
        (5, "include must be a glob pattern"),
        ({"model.layers.*.mlp"}, "include must be a glob pattern .*got set"),
        (b"model.*", "include must be a glob pattern .*got bytes"),
        (["model.*", 3], r"include\[1\] must be a glob pattern \(str\), got int"),
    ],
    ids=["int", "set", "bytes", "list with an int"],
)
def test_include_of_another_type_is_a_typed_error(bad, named):
    with pytest.raises(CudaGraphsTypeError, match=named):
        select_targets(tiny("llama"), include=bad)


def test_include_predicate_normalization():
    assert include_predicate(None) is None
    pick = include_predicate("a.*")
    assert pick("a.b", nn.Linear(1, 1)) and not pick("b.a", nn.Linear(1, 1))

    def predicate(name, module):
        return True

    assert include_predicate(predicate) is predicate


@pytest.mark.parametrize("flag", ["attention", "router"])
def test_switches_must_be_bools(flag):
    with pytest.raises(CudaGraphsTypeError, match=f"{flag} must be a bool, got int"):
        select_targets(tiny("llama"), **{flag: 1})


def test_model_must_be_a_module():
    with pytest.raises(CudaGraphsTypeError, match="model must be an nn.Module, got list"):
        select_targets([tiny("llama")])


# --- physical modules invoked more than once per forward ------------------------------


def test_tied_layers_in_one_stack_are_rejected():
    model = tiny("llama")
    model.model.layers.append(model.model.layers[0])  # layers 0 and 2 are one object
    with pytest.raises(TargetSelectionError) as err:
        select_targets(model)
    assert "model.layers.0.self_attn" in str(err.value)
    assert "model.layers.2.self_attn" in str(err.value)


def test_mtp_reusing_a_main_layer_is_rejected():
    model = ToyModel()
    model.mtp[0] = model.layers[0]
    with pytest.raises(TargetSelectionError) as err:
        select_targets(model)
    msg = str(err.value)
    assert "layers.0.attn" in msg and "mtp.0.attn" in msg and "same module object" in msg


def test_shared_attention_between_blocks_is_rejected():
    model = tiny("llama")
    model.model.layers[1].self_attn = model.model.layers[0].self_attn
    with pytest.raises(TargetSelectionError) as err:
        select_targets(model)
    assert ATTN.format(0) in str(err.value) and ATTN.format(1) in str(err.value)
    # Leaving the shared module out of the targets is the documented way around it.
    assert select_targets(model, attention=False) == []


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
    why = why_nothing_found(
        [ToyModel(), nn.Linear(2, 2)], attention=True, router=True, include=["x.*"]
    )
    assert why == (
        "in ToyModel with 3 block(s), Linear with 0 block(s), looking for attention, "
        "MoE routers, include=['x.*']; blocks are found in a ModuleList/ModuleDict of "
        "same-typed modules that each hold an attention module. Fixes: 1. pass include= "
        "naming the modules to graph; 2. pass the model parts that hold the decoder layers"
    )


@pytest.mark.parametrize(
    "attention, router, include, asked",
    [
        (True, False, None, "looking for attention; "),
        (False, True, None, "looking for MoE routers; "),
        (False, False, "*.mlp", "looking for include='*.mlp'; "),
    ],
)
def test_why_nothing_found_lists_only_what_was_asked(attention, router, include, asked):
    why = why_nothing_found([nn.Linear(2, 2)], attention=attention, router=router, include=include)
    assert why.startswith("in Linear with 0 block(s), " + asked), why


def test_why_nothing_found_when_nothing_was_asked_or_given():
    assert (
        why_nothing_found([nn.Linear(2, 2)], attention=False, router=False, include=None)
        == "in Linear with 0 block(s): attention=False, router=False and no include: "
        "nothing asked for"
    )
    assert why_nothing_found([], attention=True, router=True, include=None) == (
        "no model parts were given"
    )


# --- model_label is only a label ----------------------------------------------------


def test_model_label_is_not_a_capability_gate():
    base = tiny("qwen3_moe")
    renamed_cls = type("SomethingElse", (type(base),), {})
    renamed = tiny("qwen3_moe")
    renamed.__class__ = renamed_cls
    assert model_label(base) == "Qwen3MoeForCausalLM with 2 block(s)"
    assert model_label(renamed) == "SomethingElse with 2 block(s)"
    assert names_kinds(select_targets(renamed)) == names_kinds(select_targets(base))

    # A model with no recognizable name at all (a bare container) still works.
    anonymous = nn.Module()
    anonymous.body = base.model
    assert [t.name for t in select_targets(anonymous)] == [
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
    plan = plan_targets(_AttentionDeclared())
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
    assert names_kinds(select_targets(_SelfAttentionLayers())) == [
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
