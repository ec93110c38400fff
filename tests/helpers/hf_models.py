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


# Tiny configs of more architectures, for the metadata-discovery tests (tiny_arch). Kept
# apart from CONFIGS, the four families every partial-graph test runs over. Token ids
# are set inside the tiny vocabulary so that the configs validate without warnings.
_SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)
_MAMBA = dict(
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=1,
    mamba_d_state=8,
    mamba_chunk_size=16,
    mamba_expand=2,
)
_TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
ARCH_CONFIGS = {
    "llama": _SMALL,
    "mistral": _SMALL,
    "qwen2": _SMALL,
    "qwen3": dict(_SMALL, head_dim=8),
    "gemma": dict(_SMALL, head_dim=8),
    "phi": dict(_SMALL, num_key_value_heads=4),
    "olmoe": dict(_SMALL, num_experts=4, num_experts_per_tok=2, **_TOKENS),
    "gpt_neox": dict(_SMALL, num_key_value_heads=4, **_TOKENS),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64),
    "opt": dict(
        hidden_size=32,
        ffn_dim=64,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=64,
        **_TOKENS,
    ),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=64, **_TOKENS),
    "t5": dict(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        vocab_size=64,
        decoder_start_token_id=0,
        **_TOKENS,
    ),
    # Layer 1 is attention, 0/2/3 Mamba; layers 0 and 2 have an MoE feed-forward.
    "jamba": dict(
        _SMALL,
        num_hidden_layers=4,
        attn_layer_period=4,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
    # Layers 0/2 linear attention (Gated DeltaNet), 1/3 full attention; layer 2 dense.
    "qwen3_next": dict(
        _SMALL,
        num_hidden_layers=4,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        mlp_only_layers=[2],
    ),
    # Layer 0 Mamba, layer 1 attention.
    "bamba": dict(_SMALL, attn_layer_indices=[1], **_MAMBA),
    # Every layer runs Mamba and attention side by side.
    "falcon_h1": dict(_SMALL, head_dim=8, mamba_d_ssm=64, **_MAMBA),
}
_SEQ2SEQ = {"t5"}


def tiny_arch(family: str, seed: int = 0, **overrides) -> nn.Module:
    """A fresh tiny model of ``family`` from :data:`ARCH_CONFIGS` (and ``overrides``):
    a causal LM, or a seq2seq LM for T5. Skips the calling test when transformers, or
    this family in the installed transformers, is missing."""
    transformers = pytest.importorskip("transformers")
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family!r} models")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family, **{**ARCH_CONFIGS[family], **overrides})
    if family in _SEQ2SEQ:
        return transformers.AutoModelForSeq2SeqLM.from_config(config)
    return transformers.AutoModelForCausalLM.from_config(config)
