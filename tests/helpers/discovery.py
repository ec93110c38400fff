"""Helpers of the partial-graph discovery CPU tests (tests/partial/test_partial_discovery*.py):
the targets expected in each tiny HF family, and targets as (name, kind) pairs."""

from torch import nn

from cudagraphs.partial import (
    Target,
)
from helpers.hf_models import CONFIGS

#: The scopes the discovery tests plan with: each block's attention and MoE router, the
#: pieces discovery itself finds (the wider scopes are tested in test_partial_scopes*.py).
ATTN_ROUTER = ("attention", "moe_router")

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


class ToyModel(nn.Module):
    def __init__(self, mtp_block=ToyBlock):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([ToyBlock(), ToyBlock(moe=True)])
        self.mtp = nn.ModuleList([mtp_block()])
