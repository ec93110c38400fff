"""Models, prompts and HF's static-cache generate for the GPU tests of the HF
generator (tests/serving/test_cuda_hf_*.py)."""

import torch
import transformers

from helpers.hf_generate import hf_keyword

EOS, PAD = 2, 0
MAX_CACHE_LEN = 96
NEW = 24
LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
)
QWEN3_MOE = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    head_dim=32,
    vocab_size=1024,
)


def build(family, dtype, **extra):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **{**CONFIGS[family], **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    if family == "qwen3_moe":
        model.set_experts_implementation("grouped_mm")
    return model.to(device="cuda", dtype=dtype).eval()


CONFIGS = {"llama": LLAMA, "qwen3_moe": QWEN3_MOE}


def prompts(batch, seed, longest=12):
    """Left-padded prompts of lengths longest, longest-1, ... (cycling), ids >= 3."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1024, (batch, longest), generator=gen)
    mask = torch.ones(batch, longest, dtype=torch.long)
    for row in range(batch):
        pad = row % 5
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    return ids.cuda(), mask.cuda()


def hf_static(model, ids, mask, new=NEW, *, pad=PAD, max_cache_len=MAX_CACHE_LEN, **kwargs):
    """HF's greedy static-cache generate, its own compile off: the tokens ours must equal."""
    keyword = hf_keyword(model)
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            disable_compile=True,
            eos_token_id=kwargs.pop("eos_token_id", EOS),
            pad_token_id=pad,
            **{keyword: cache},
            **kwargs,
        )
