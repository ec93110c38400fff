"""Tiny Hugging Face causal LMs built from config (no downloads), shared by the
partial-graph tests. Safe to import without transformers: :func:`tiny` skips the test
that calls it then, so tests of toy modules in the same file still run."""

import pytest
import torch
from torch import nn

CONFIGS = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ),
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        head_dim=16,
    ),
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
    ),
    "deepseek_v3": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        vocab_size=128,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
}


def tiny(family: str = "llama", seed: int = 0) -> nn.Module:
    """A fresh tiny causal LM of ``family`` with weights drawn from ``seed`` (skips the
    calling test when transformers is not installed)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family, **CONFIGS[family])
    return transformers.AutoModelForCausalLM.from_config(config)
