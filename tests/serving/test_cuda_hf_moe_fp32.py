"""GraphedGenerator on the GPU over a tiny OLMoE (2 layers, hidden 64, 4 experts) with
transformers' default grouped_mm experts: in float32 every bucket captures (decoding
with batched_mm, as HF's generate does on a GPU), every decode step replays, greedy
tokens equal HF's static-cache generate and the model is left on grouped_mm; where
HF's generate would not switch, capture() ends in the UnsupportedModelError naming the
fixes before any bucket; bfloat16 and float32 batched_mm models replay as loaded."""

import pytest
import torch

from cudagraphs.errors import UnsupportedModelError
from cudagraphs.moe_kernels import GroupedMMProbe
from cudagraphs.serving.hf import GraphedGenerator, experts
from helpers.moe_models import FIXES, moe

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

from helpers.hf_gpu import hf_static  # noqa: E402

MAX_CACHE_LEN = 64
NEW = 16
PAD = 1
SIZES = (1, 2, 4, 8)


def prompts(batch, seed, longest=10):
    """Left-padded prompts of lengths longest, longest-1, ... (cycling), ids >= 3."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, longest), generator=gen)
    mask = torch.ones(batch, longest, dtype=torch.long)
    for row in range(batch):
        ids[row, : row % 3] = PAD
        mask[row, : row % 3] = 0
    return ids.cuda(), mask.cuda()


def captured(model):
    gen = GraphedGenerator(model, SIZES, max_cache_len=MAX_CACHE_LEN, require_all_buckets=True)
    gen.capture(progress=False)
    return gen


def assert_replays_equal_hf(gen, model, batch):
    ids, mask = prompts(batch, seed=batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=PAD)
    assert torch.equal(
        ours,
        hf_static(model, ids, mask, NEW, pad=PAD, max_cache_len=MAX_CACHE_LEN, eos_token_id=[]),
    ), f"batch {batch}"
    stats = gen.stats()
    assert stats["eager_runs"] == {}, stats
    assert stats["replays"][f"bucket(bs={batch})"] == NEW - 1


def float32_syncs():
    return not GroupedMMProbe().on_device(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("batch", [1, 4])
def test_float32_grouped_mm_decodes_with_batched_mm_as_hf_and_replays(batch):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = moe("olmoe", device="cuda").eval()
    gen = captured(model)
    assert len(gen.stats()["captured"]) == len(SIZES)
    assert_replays_equal_hf(gen, model, batch)
    assert model.get_experts_implementation() == {"": "grouped_mm"}, "prefill stays as loaded"
    switched = {"": "batched_mm"} if float32_syncs() else None
    assert gen.stats()["decode_experts"] == switched


def test_without_hfs_decode_switch_capture_ends_in_the_named_fixes(monkeypatch):
    if not float32_syncs():
        pytest.skip("this torch runs float32 grouped GEMMs on the device: nothing to refuse")
    monkeypatch.setattr(experts, "hf_decodes_with_batched_mm", lambda model: False)
    model = moe("olmoe", device="cuda").eval()
    gen = GraphedGenerator(model, SIZES, max_cache_len=MAX_CACHE_LEN)
    with pytest.raises(UnsupportedModelError) as err:
        gen.capture(progress=False)
    text = str(err.value)
    assert text.startswith("GraphedGenerator(OlmoeForCausalLM): the MoE experts at model.layers.0")
    assert "float32 on cuda:0" in text and all(fix in text for fix in FIXES), text
    assert gen.kv is None and gen.stats()["captured"] == [], "no bucket was captured"


@pytest.mark.parametrize(
    "dtype, implementation",
    [(torch.bfloat16, None), (torch.float32, "batched_mm")],
    ids=["bfloat16_grouped_mm", "float32_batched_mm"],
)
def test_the_fixed_models_replay_as_loaded(dtype, implementation):
    torch.backends.cuda.matmul.allow_tf32 = False
    if implementation is None and not GroupedMMProbe().on_device(
        torch.zeros(1, device="cuda", dtype=dtype)
    ):
        pytest.skip("torch's bfloat16 grouped GEMM is not on the device on this GPU")
    model = moe("olmoe", dtype, implementation, device="cuda").eval()
    gen = captured(model)
    assert gen.stats()["decode_experts"] is None, "nothing to switch"
    assert_replays_equal_hf(gen, model, 2)
