"""Helpers of the partial-graph scope CPU tests (tests/partial/test_partial_scopes*.py):
the tiny HF models by family, the targets expected per model and scope set, and plans
as (name, kind) pairs and narrowings."""

import functools

from torch import nn

from cudagraphs.partial.planning import TargetPlan
from cudagraphs.partial.vocabulary import SCOPES
from helpers.hf_models import CONFIGS, tiny, tiny_arch

# The target kinds, as plans name them.
ATTENTION, ROUTER, LAYER, MOE, MLP = "attention", "router", "layer", "moe", "mlp"
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
        t
        for i in (0, 1)
        for t in ((f"{stack}.{i}.self_attn", ATTENTION), (f"{stack}.{i}.mlp.gate", ROUTER))
    ]


# The decoder stack of the HF families here (GPT-2's is transformer.h).
MODEL_LAYERS = "model.layers"


MOE_FAMILY = {
    "layer": (per_layer(MODEL_LAYERS, "", LAYER), [], []),
    "moe": (per_layer(MODEL_LAYERS, ".mlp", MOE), [], []),
    "mlp": ([], skipped(MODEL_LAYERS), []),
    "attn_router": (moe_attn_router(), [], []),
    "all": (per_layer(MODEL_LAYERS, "", LAYER), [], []),
}


# family -> scope set -> (targets (name, kind), skipped (name, reason),
# narrowed (name, wanted, got, reason))
EXPECTED = {
    "llama": {
        "layer": (per_layer(MODEL_LAYERS, "", LAYER), [], []),
        "moe": ([], skipped(MODEL_LAYERS), []),
        "mlp": (per_layer(MODEL_LAYERS, ".mlp", MLP), [], []),
        "attn_router": (per_layer(MODEL_LAYERS, ".self_attn", ATTENTION), [], []),
        "all": (per_layer(MODEL_LAYERS, "", LAYER), [], []),
    },
    "qwen3_moe": MOE_FAMILY,
    "mixtral": MOE_FAMILY,
    # Layer 0 is dense (first_k_dense_replace=1), layer 1 MoE with shared experts.
    "deepseek_v3": {
        "layer": (per_layer(MODEL_LAYERS, "", LAYER), [], []),
        "moe": ([(f"{MODEL_LAYERS}.1.mlp", MOE)], skipped(MODEL_LAYERS, [0]), []),
        "mlp": ([(f"{MODEL_LAYERS}.0.mlp", MLP)], skipped(MODEL_LAYERS, [1]), []),
        "attn_router": (
            [
                (f"{MODEL_LAYERS}.0.self_attn", ATTENTION),
                (f"{MODEL_LAYERS}.1.self_attn", ATTENTION),
                (f"{MODEL_LAYERS}.1.mlp.gate", ROUTER),
            ],
            [],
            [],
        ),
        "all": (per_layer(MODEL_LAYERS, "", LAYER), [], []),
    },
    # Conv1D projections: only the 2-D-weight rule finds GPT-2's MLP.
    "gpt2": {
        "layer": (per_layer("transformer.h", "", LAYER), [], []),
        "moe": ([], skipped("transformer.h"), []),
        "mlp": (per_layer("transformer.h", ".mlp", MLP), [], []),
        "attn_router": (per_layer("transformer.h", ".attn", ATTENTION), [], []),
        "all": (per_layer("transformer.h", "", LAYER), [], []),
    },
    # Layers 0/2: Mamba + MoE; 1: attention + MLP; 3: Mamba + MLP.
    "jamba": {
        "layer": ([(f"{MODEL_LAYERS}.1", LAYER)], skipped(MODEL_LAYERS, [0, 2, 3]), []),
        "moe": (
            [(f"{MODEL_LAYERS}.0.feed_forward", MOE), (f"{MODEL_LAYERS}.2.feed_forward", MOE)],
            skipped(MODEL_LAYERS, [1, 3]),
            [],
        ),
        "mlp": (
            [(f"{MODEL_LAYERS}.1.feed_forward", MLP), (f"{MODEL_LAYERS}.3.feed_forward", MLP)],
            skipped(MODEL_LAYERS, [0, 2]),
            [],
        ),
        "attn_router": (
            [
                (f"{MODEL_LAYERS}.0.feed_forward.router", ROUTER),
                (f"{MODEL_LAYERS}.1.self_attn", ATTENTION),
            ]
            + [(f"{MODEL_LAYERS}.2.feed_forward.router", ROUTER)],
            skipped(MODEL_LAYERS, [3]),
            [],
        ),
        "all": (
            [
                (f"{MODEL_LAYERS}.0.feed_forward", MOE),
                (f"{MODEL_LAYERS}.1", LAYER),
                (f"{MODEL_LAYERS}.2.feed_forward", MOE),
            ]
            + [(f"{MODEL_LAYERS}.3.feed_forward", MLP)],
            [],
            [
                (f"{MODEL_LAYERS}.0", "layer", ("moe",), "no_attention"),
                (f"{MODEL_LAYERS}.2", "layer", ("moe",), "no_attention"),
                (f"{MODEL_LAYERS}.3", "layer", ("mlp",), "no_attention"),
            ],
        ),
    },
    # Layers 0/2: Gated DeltaNet (never attention); 1/3 attention; layer 2 dense.
    "qwen3_next": {
        "layer": (
            [(f"{MODEL_LAYERS}.1", LAYER), (f"{MODEL_LAYERS}.3", LAYER)],
            skipped(MODEL_LAYERS, [0, 2]),
            [],
        ),
        "moe": (per_layer(MODEL_LAYERS, ".mlp", MOE, [0, 1, 3]), skipped(MODEL_LAYERS, [2]), []),
        "mlp": ([(f"{MODEL_LAYERS}.2.mlp", MLP)], skipped(MODEL_LAYERS, [0, 1, 3]), []),
        "attn_router": (
            [
                (f"{MODEL_LAYERS}.0.mlp.gate", ROUTER),
                (f"{MODEL_LAYERS}.1.self_attn", ATTENTION),
                (f"{MODEL_LAYERS}.1.mlp.gate", ROUTER),
            ]
            + [(f"{MODEL_LAYERS}.3.self_attn", ATTENTION), (f"{MODEL_LAYERS}.3.mlp.gate", ROUTER)],
            skipped(MODEL_LAYERS, [2]),
            [],
        ),
        "all": (
            [
                (f"{MODEL_LAYERS}.0.mlp", MOE),
                (f"{MODEL_LAYERS}.1", LAYER),
                (f"{MODEL_LAYERS}.2.mlp", MLP),
                (f"{MODEL_LAYERS}.3", LAYER),
            ],
            [],
            [
                (f"{MODEL_LAYERS}.0", "layer", ("moe",), "no_attention"),
                (f"{MODEL_LAYERS}.2", "layer", ("mlp",), "no_attention"),
            ],
        ),
    },
}


def names_kinds(plan: TargetPlan) -> list[tuple[str, str]]:
    return [(t.name, t.kind) for t in plan.targets]


def narrowings(plan: TargetPlan) -> list[tuple[str, str, tuple[str, ...], str]]:
    return [(n.name, n.wanted, n.got, n.reason) for n in plan.narrowed]


class ToyAttention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None):
        return self.o(self.q(hidden_states))


class ToyBlock(nn.Module):
    def __init__(self, d=8, moe=False):
        super().__init__()
        self.attn = ToyAttention(d)
        self.norm = nn.LayerNorm(d)
        self.ffn = ToyMoE(d) if moe else nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))


class ToyMoE(nn.Module):
    def __init__(self, d=8, n=2):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, hidden_states):
        return sum(e(hidden_states) for e in self.experts)


def toy_model() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList([ToyBlock(), ToyBlock(moe=True)])
    return model
