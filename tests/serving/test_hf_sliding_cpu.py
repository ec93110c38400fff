"""GraphedGenerator on sliding-window models, on the CPU with the eager stand-in for
CUDA capture: windows shorter than the request, all-sliding (Mistral, Gemma 3) and
hybrid (Qwen2 with its window on the upper layers, Gemma 2 alternating) caches; greedy
tokens equal HF's static-cache ``generate``, whose sliding layers keep the window in
their storage where ours keep it in the mask. A control shows the window changes the
tokens of these models, so the comparison would see a window that was not applied."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.hf_generate import EOS, PAD, captured, hf_generate, prompts  # noqa: E402
from helpers.hf_models import CONFIGS  # noqa: E402

WINDOW = 4
NEW = 12  # prompts of 6 plus 12 new tokens: the window is passed early
SIZES = CONFIGS["llama"]
FAMILIES = {
    "mistral": {},
    "qwen2": dict(use_sliding_window=True, max_window_layers=1),
    "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16),
}


def build(family, window=WINDOW):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        family, **SIZES, **FAMILIES[family], sliding_window=window
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_hf_static_cache_past_the_window(family):
    model = build(family)
    kinds = {
        type(layer).__name__
        for layer in transformers.StaticCache(config=model.config, max_cache_len=24).layers
    }
    assert "StaticSlidingWindowLayer" in kinds  # HF's own generate keeps a window
    gen = captured(model, (1, 2, 4))
    for batch in (1, 3, 6):  # at a bucket, padded, above every bucket (eager)
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, ref), (family, batch)
    assert gen.stats()["eager_runs"] == {}


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_the_window_changes_these_models_tokens(family):
    # The control: the same weights with a window longer than the request make other
    # tokens, so equal tokens above mean the window was applied.
    windowed, wide = build(family), build(family, window=64)
    wide.load_state_dict(windowed.state_dict())
    ids, mask = prompts(3, seed=3)
    a = hf_generate(windowed, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    b = hf_generate(wide, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert not torch.equal(a, b)
    gen = captured(wide, (1, 4))
    assert torch.equal(
        gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD), b
    )


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_compiled_decode_step_traces_the_sliding_mask_whole(family):
    # compile_options with dynamo's eager backend: the step (HF's sliding-window mask
    # over our full-length layers included) traces fullgraph and runs as traced.
    import torch._dynamo

    torch._dynamo.reset()
    model = build(family)
    gen = captured(model, (1, 2, 4), compile_options={"backend": "eager", "fullgraph": True})
    for batch in (1, 3):
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, ref), (family, batch)
    torch._dynamo.reset()
