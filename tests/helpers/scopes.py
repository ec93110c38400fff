"""Helpers of the partial-graph scope CPU tests (tests/partial/test_partial_scopes*.py):
the tiny HF models by family, the targets expected per model and scope set, and plans
as (name, kind) pairs and narrowings."""

import functools

from torch import nn

from cudagraphs.partial.planning import TargetPlan
from cudagraphs.partial.vocabulary import SCOPES
from helpers.hf_models import CONFIGS, tiny, tiny_arch

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
