"""Tiny float32 MoE models for the grouped-GEMM tests of every layer
(tests/*/test_*moe_fp32*.py): OLMoE, Qwen3-MoE and Mixtral built from config (no
downloads), a decoder layer callable with one tensor, and a stand-in probe answer."""

import pytest
import torch
from torch import nn

from helpers.hf_models import CONFIGS

OLMOE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)
MOE_CONFIGS = {"olmoe": OLMOE, "qwen3_moe": CONFIGS["qwen3_moe"], "mixtral": CONFIGS["mixtral"]}
FIXES = ("1. bfloat16 weights", "2. the batched_mm experts", 'experts_implementation="batched_mm"')


def moe(family="olmoe", dtype=torch.float32, implementation=None, device="cpu", seed=0):
    """A fresh tiny MoE causal LM in ``dtype`` on ``device``; ``implementation`` is
    passed as ``experts_implementation`` (``None``: transformers' default, grouped_mm)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    extra = {} if implementation is None else {"experts_implementation": implementation}
    config = transformers.AutoConfig.for_model(
        family, dtype=dtype, attn_implementation="sdpa", **MOE_CONFIGS[family], **extra
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype)


class RopedLayer(nn.Module):
    """A decoder layer called with the hidden states alone: the rotary embeddings of
    positions ``0..seq-1`` are made once, outside any graph."""

    def __init__(self, layer, rotary, hidden):
        super().__init__()
        self.layer = layer
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        with torch.no_grad():
            self.cos, self.sin = rotary(hidden, positions)

    def forward(self, hidden):
        out = self.layer(hidden, attention_mask=None, position_embeddings=(self.cos, self.sin))
        return out[0] if isinstance(out, tuple) else out


def roped_layers(model, hidden):
    """One :class:`RopedLayer` per decoder layer of ``model``."""
    return [RopedLayer(layer, model.model.rotary_emb, hidden) for layer in model.model.layers]


def probe_says(monkeypatch, keeps=(torch.bfloat16,)):
    """Every grouped-GEMM question is answered as torch 2.11 on an H200 would: the
    offsets stay on the device only for a dtype in ``keeps`` (the CPU tests' stand-in
    for a GPU). Returns the list of (dtype, device) pairs asked about."""
    from cudagraphs.moe_kernels import GroupedMMProbe

    asked = []

    def on_device(self, weight):
        asked.append((weight.dtype, weight.device))
        return weight.dtype in keeps

    monkeypatch.setattr(GroupedMMProbe, "on_device", on_device)
    return asked
