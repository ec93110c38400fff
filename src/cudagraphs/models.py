"""Small embedded models for the main job, the benchmarks and the tests.

Nothing is downloaded: the models are built from a config with random weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import CudaGraphsValueError

__all__ = [
    "BlockConfig",
    "DecoderConfig",
    "PreNormBlock",
    "TinyDecoder",
    "greedy_decode",
    "make_block_stack",
]


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
            raise CudaGraphsValueError(f"hidden {cfg.hidden} is not divisible by heads {cfg.heads}")
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


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    layers: int = 2
    max_seq: int = 64
    max_batch: int = 64


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        head_dim = cfg.hidden // cfg.heads
        self.cfg, self.head_dim = cfg, head_dim
        self.norm1 = nn.RMSNorm(cfg.hidden)
        self.q = nn.Linear(cfg.hidden, cfg.heads * head_dim, bias=False)
        self.kv = nn.Linear(cfg.hidden, 2 * cfg.kv_heads * head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * head_dim, cfg.hidden, bias=False)
        self.norm2 = nn.RMSNorm(cfg.hidden)
        self.up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        cfg, b, hd = self.cfg, x.shape[0], self.head_dim
        h = self.norm1(x)
        q = self.q(h).view(b, cfg.heads, 1, hd)
        k, v = self.kv(h).view(b, 2, cfg.kv_heads, hd).unbind(1)
        rows = torch.arange(b, device=x.device)
        # Static cache, [batch slot, position, kv head, dim]: each row writes its new
        # key/value at its own position; no shapes depend on the positions.
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v
        keys = k_cache[:b].transpose(1, 2).repeat_interleave(cfg.heads // cfg.kv_heads, 1)
        values = v_cache[:b].transpose(1, 2).repeat_interleave(cfg.heads // cfg.kv_heads, 1)
        visible = torch.arange(cfg.max_seq, device=x.device) <= positions[:, None]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None, None, :])
        x = x + self.o(attn.reshape(b, cfg.heads * hd))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyDecoder(nn.Module):
    """A Llama-like decoder with a static KV cache, for the serving demo and tests.

    ``forward(tokens, positions)`` is one decode step: ``tokens`` and ``positions``
    are ``[batch]``; row ``i`` is sequence slot ``i`` of the cache. It returns
    ``[batch, vocab]`` logits. Shapes depend only on the batch size, so one graph per
    batch-size bucket serves every step. Padding rows (slots past the real batch)
    write into their own cache slots and never touch the real rows.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
            raise CudaGraphsValueError(f"heads must divide hidden and kv_heads divide heads: {cfg}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(_DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        shape = (cfg.layers, cfg.max_batch, cfg.max_seq, cfg.kv_heads, cfg.hidden // cfg.heads)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.k_cache[i], self.v_cache[i])
        return self.head(self.norm(x))


def greedy_decode(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prompts: torch.Tensor,
    new_tokens: int,
) -> torch.Tensor:
    """Greedy decoding through one-token ``step(tokens, positions) -> logits`` calls:
    the prompt is fed token by token (filling the cache), then ``new_tokens`` are
    generated. ``prompts`` is ``[batch, prompt_len]``; returns ``[batch, new_tokens]``."""
    batch, prompt_len = prompts.shape
    out = []
    logits = None
    for pos in range(prompt_len + new_tokens - 1):
        tokens = prompts[:, pos] if pos < prompt_len else out[-1]
        positions = torch.full((batch,), pos, dtype=torch.long, device=prompts.device)
        logits = step(tokens, positions)
        if pos >= prompt_len - 1:
            out.append(logits.argmax(-1))
    return torch.stack(out, dim=1)
