"""Small embedded models for the main job, the benchmarks and the tests.

Nothing is downloaded: the models are built from a config with random weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockConfig", "PreNormBlock", "make_block_stack"]


@dataclass(frozen=True)
class BlockConfig:
    hidden: int = 512
    heads: int = 8
    ffn: int = 2048
    dropout: float = 0.0


class PreNormBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``,
    with causal scaled-dot-product attention. Input and output: ``[batch, seq, hidden]``.
    """

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden {cfg.hidden} is not divisible by heads {cfg.heads}")
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        heads = self.cfg.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def make_block_stack(
    num_layers: int,
    cfg: BlockConfig,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> nn.ModuleList:
    """``num_layers`` blocks with weights drawn from ``seed`` (the same for every call)."""
    # Weights are drawn on the CPU from a forked CPU generator: neither the caller's CPU
    # nor any CUDA random state changes.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        blocks = nn.ModuleList(PreNormBlock(cfg) for _ in range(num_layers))
    return blocks.to(device=device, dtype=dtype)
