"""Helpers of the Hugging Face generator's CPU tests (tests/serving/test_hf_*_cpu.py):
left-padded prompts, HF's static-cache generate as the reference, a generator captured
with the eager stand-in, and what EOS makes of free-running tokens."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import StaticCache  # noqa: E402

from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import (  # noqa: E402
    GraphedGenerator,
)

L = 24  # max_cache_len of every generator here
PROMPT = 6
EOS, PAD = 2, 0  # tiny llama's generation_config eos is 2; passed explicitly to both sides


def prompts(batch, prompt_len=PROMPT, seed=0):
    """Left-padded prompts: row r has r % 3 padding tokens (id 0) before real ids >= 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, prompt_len), generator=g)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    for r in range(batch):
        mask[r, : r % 3] = 0
        ids[r, : r % 3] = 0
    return ids, mask


def hf_keyword(model):
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_generate(model, ids, mask, max_new_tokens, max_cache_len=L, **kw):
    """HF's static-cache ``generate`` (greedy unless ``kw`` says) over a cache of
    ``max_cache_len`` positions."""
    kw.setdefault("do_sample", False)
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        disable_compile=True,
        **{hf_keyword(model): StaticCache(config=model.config, max_cache_len=max_cache_len)},
        **kw,
    )


def captured(model, batch_sizes=(1, 2, 4, 8), **kw):
    gen = GraphedGenerator(model, batch_sizes, max_cache_len=L, capture_backend=eager_backend, **kw)
    gen.capture(progress=False)
    return gen


def assert_serves_hf_tokens(gen, model, batches=(4, 3, 2), new=8):
    """Greedy tokens of ``gen`` equal HF's static-cache ``generate`` at each batch
    size, every decode step on the graphs (no eager run)."""
    for batch in batches:
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=EOS, pad_token_id=PAD)
        want = hf_generate(model, ids, mask, new, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, want), batch
    assert gen.stats()["eager_runs"] == {}


def ended(free, eos, pad):
    """What ``free`` (new tokens made without EOS) becomes with EOS ids ``eos``: a row's
    tokens after its first EOS are ``pad``; the output ends when every row has ended."""
    out = free.clone()
    lengths = []
    for r in range(free.shape[0]):
        hits = [t for t in range(free.shape[1]) if int(free[r, t]) in eos]
        if hits:
            out[r, hits[0] + 1 :] = pad
            lengths.append(hits[0] + 1)
        else:
            lengths.append(free.shape[1])
    return out[:, : max(lengths)]
