"""Discovery of partial-graph targets on the CPU: the four HF families, activation
checkpoint wrappers, user models (toy blocks, an extra MTP stack), the selection
switches and what include accepts."""

import logging
import re

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from cudagraphs.errors import CudaGraphsError, CudaGraphsTypeError
from cudagraphs.partial import (
    DiscoveredBlock,
    TargetSelectionError,
    discover_blocks,
    find_attention,
    find_moe,
    select_targets,
    unwrap_checkpoint,
)
from cudagraphs.partial.arguments import include_predicate
from helpers.discovery import (
    ATTN,
    ATTN_ROUTER,
    EXPECTED_MOE,
    EXPECTED_TARGETS,
    FAMILIES,
    ROUTER,
    ToyAttention,
    ToyBlock,
    ToyModel,
    ToyMoE,
    names_kinds,
)
from helpers.hf_models import tiny

# --- the four HF families -----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_targets(family):
    model = tiny(family)
    targets = select_targets(model, scopes=ATTN_ROUTER)
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
    assert "model.layers.1.mlp.shared_experts" not in [
        t.name for t in select_targets(model, scopes=ATTN_ROUTER)
    ]
    targets = select_targets(
        model, include=["model.layers.*.mlp.shared_experts"], scopes=ATTN_ROUTER
    )
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

    assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == EXPECTED_TARGETS[family]
    blocks = discover_blocks(model)
    assert [b.name for b in blocks] == ["model.layers.0", "model.layers.1"]
    assert [b.module for b in blocks] == inner, "blocks must be the wrapped layers"
    assert [b.moe for b in blocks] == EXPECTED_MOE[family]
    assert blocks[0].attention.module is inner[0].self_attn


def test_checkpoint_wrapped_attention_is_unwrapped():
    model = tiny("llama")
    attn = model.model.layers[1].self_attn
    model.model.layers[1].self_attn = checkpoint_wrapper(attn)
    targets = select_targets(model, scopes=ATTN_ROUTER)
    assert names_kinds(targets) == EXPECTED_TARGETS["llama"]
    assert targets[1].module is attn


def test_unwrap_checkpoint_plain_module_is_itself():
    m = nn.Linear(2, 2)
    assert unwrap_checkpoint(m) is m
    assert unwrap_checkpoint(checkpoint_wrapper(checkpoint_wrapper(m))) is m


# --- user models: toy blocks and an extra (MTP) stack ---------------------------------


class OtherBlock(nn.Module):
    """An MTP block of another type: projection plus a full block inside."""

    def __init__(self, d=8):
        super().__init__()
        self.proj = nn.Linear(2 * d, d)
        self.mixer = ToyAttention(d)


@pytest.mark.parametrize("mtp_block", [ToyBlock, OtherBlock])
def test_extra_mtp_stack_is_discovered(mtp_block):
    model = ToyModel(mtp_block)
    blocks = discover_blocks(model)
    assert [b.name for b in blocks] == ["layers.0", "layers.1", "mtp.0"]
    assert [b.moe for b in blocks] == [None, "layers.1.ffn", None]
    mtp_attn = "mtp.0.attn" if mtp_block is ToyBlock else "mtp.0.mixer"
    assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == [
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
    assert select_targets(plain, scopes=ATTN_ROUTER) == []


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
    assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == [
        ("layers.0.attn", "attention")
    ]


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
    assert names_kinds(select_targets(model, scopes=ATTN_ROUTER)) == [
        ("layers.0.attn", "attention")
    ]
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
    assert names_kinds(select_targets(model, scopes=("moe_router",))) == [
        (ROUTER.format(0), "router"),
        (ROUTER.format(1), "router"),
    ]
    assert names_kinds(select_targets(model, scopes=("attention",))) == [
        (ATTN.format(0), "attention"),
        (ATTN.format(1), "attention"),
    ]
    assert select_targets(model, scopes=()) == []


def test_include_by_predicate():
    model = tiny("mixtral")
    seen = []

    def pick(name, module):
        seen.append(name)
        return name.endswith(".mlp.experts")

    targets = select_targets(model, include=pick, scopes=())
    assert names_kinds(targets) == [
        ("model.layers.0.mlp.experts", "custom"),
        ("model.layers.1.mlp.experts", "custom"),
    ]
    assert targets[0].module is model.model.layers[0].mlp.experts
    assert "model.layers.0.self_attn.q_proj" in seen, "the predicate sees every submodule"


def test_include_predicate_is_given_each_module():
    model = tiny("llama")
    targets = select_targets(
        model,
        include=lambda name, module: module is model.model.layers[1].mlp,
        scopes=("moe_router",),
    )
    assert names_kinds(targets) == [("model.layers.1.mlp", "custom")]


def test_include_matching_nothing_adds_nothing():
    model = tiny("llama")
    assert select_targets(model, include=["no.such.module"], scopes=ATTN_ROUTER) == select_targets(
        model, scopes=ATTN_ROUTER
    )
    assert select_targets(model, include=lambda n, m: False, scopes=ATTN_ROUTER) == select_targets(
        model, scopes=ATTN_ROUTER
    )
    assert select_targets(model, include=[], scopes=ATTN_ROUTER) == select_targets(
        model, scopes=ATTN_ROUTER
    )


def test_include_of_an_already_chosen_target_is_not_duplicated():
    model = tiny("llama")
    targets = select_targets(model, include=["*.self_attn"], scopes=ATTN_ROUTER)
    assert names_kinds(targets) == EXPECTED_TARGETS["llama"]


def test_include_with_attention_off_takes_custom_kind():
    targets = select_targets(tiny("llama"), include=["*.self_attn"], scopes=("moe_router",))
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
        select_targets(model, include=[pattern], scopes=ATTN_ROUTER)


def test_a_target_inside_a_top_level_include_is_rejected():
    with pytest.raises(
        TargetSelectionError, match="target layers.0.attn lies inside target layers"
    ):
        select_targets(ToyModel(), include="layers", scopes=ATTN_ROUTER)


def test_target_selection_error_is_value_error():
    assert issubclass(TargetSelectionError, ValueError)
    assert issubclass(TargetSelectionError, CudaGraphsError)


# --- what include accepts ---------------------------------------------------------------

MLPS = [("model.layers.0.mlp", "custom"), ("model.layers.1.mlp", "custom")]


def test_include_plain_string_is_one_glob_pattern():
    # Not a sequence of one-character patterns: "*" alone would match every module.
    model = tiny("llama")
    targets = select_targets(model, include="model.layers.*.mlp", scopes=("moe_router",))
    assert names_kinds(targets) == MLPS
    assert targets[0].module is model.model.layers[0].mlp
    with_attention = select_targets(model, include="model.layers.*.mlp", scopes=ATTN_ROUTER)
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
    assert (
        names_kinds(select_targets(tiny("llama"), include=include, scopes=("moe_router",))) == MLPS
    )


def test_include_predicate_as_before():
    targets = select_targets(
        tiny("llama"),
        include=lambda name, module: name.endswith(".mlp"),
        scopes=("moe_router",),
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
        select_targets(tiny("llama"), include=bad, scopes=ATTN_ROUTER)


def test_include_predicate_normalization():
    assert include_predicate(None) is None
    pick = include_predicate("a.*")
    assert pick("a.b", nn.Linear(1, 1)) and not pick("b.a", nn.Linear(1, 1))

    def predicate(name, module):
        return True

    assert include_predicate(predicate) is predicate


def test_model_must_be_a_module():
    with pytest.raises(CudaGraphsTypeError, match="model must be an nn.Module, got list"):
        select_targets([tiny("llama")], scopes=ATTN_ROUTER)
