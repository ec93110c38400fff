"""Prefill graphs on the GPU (serving/hf/prefill.py): prompts left-padded to a length
bucket replay a graph of the model's kernels, and the greedy tokens stay HF's in fp32
(padding changes the rounding only); prompts no bucket holds prefill eagerly, counted
by cause; the MoE experts' float32 grouped GEMM, which syncs the host, is captured
with the decode steps' experts."""

import pytest
import torch

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from helpers.hf_gpu import EOS, MAX_CACHE_LEN, NEW, PAD, build, hf_static, prompts  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_prefills_replay_their_length_buckets_graph_and_keep_hfs_greedy_tokens_in_fp32(family):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(family, torch.float32)
    gen = GraphedGenerator(
        model,
        (1, 2, 4, 8),
        max_cache_len=MAX_CACHE_LEN,
        require_all_buckets=True,
        prefill_lengths=(16, 32),
    )
    gen.capture()
    graphs = gen.stats()["prefill_graphs"]
    assert set(graphs) == {"16", "32"}
    assert all(not g["dropped"] and len(g["captured"]) == 4 for g in graphs.values())
    for batch, longest in ((4, 12), (3, 16), (1, 20), (2, 40)):
        ids, mask = prompts(batch, seed=batch, longest=longest)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, hf_static(model, ids, mask)), (batch, longest)
    stats = gen.stats()
    # 12 and 16 in the 16 bucket, 20 in the 32 one; 40 is longer than every bucket.
    assert stats["prefills"] == {"graphs": 3, "longer": 1}
    replays = stats["prefill_graphs"]
    assert replays["16"]["replays"]["bucket(bs=4)"] == 2  # 4 rows, and 3 on 4
    assert replays["32"]["replays"]["bucket(bs=1)"] == 1
    assert stats["eager_runs"] == {}
    gen.close()


def test_a_request_after_a_graphed_prefill_starts_from_its_own_prompt():
    # The counters are zeroed inside the graph: a short request after a long one
    # writes from position 0, and its tokens are its own.
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    gen = GraphedGenerator(model, (1, 2, 4), max_cache_len=MAX_CACHE_LEN, prefill_lengths=(16,))
    gen.capture()
    short, short_mask = prompts(2, seed=5, longest=6)
    alone = gen.generate(short, short_mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ids, mask = prompts(4, seed=6, longest=16)
    gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    again = gen.generate(short, short_mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(again, alone)
    assert torch.equal(alone, hf_static(model, short, short_mask))
    assert gen.stats()["prefills"] == {"graphs": 3}
    gen.close()


def test_a_prompt_whose_padded_request_does_not_fit_the_cache_prefills_eagerly():
    model = build("llama", torch.bfloat16)
    gen = GraphedGenerator(model, (1, 2), max_cache_len=40, prefill_lengths=(32,))
    gen.capture()
    ids, mask = prompts(1, seed=1, longest=12)  # 12 + 28 - 1 fits 40; 32 + 28 - 1 does not
    out = gen.generate(ids, mask, max_new_tokens=28, eos_token_id=EOS, pad_token_id=PAD)
    assert out.shape[1] <= 12 + 28
    assert gen.stats()["prefills"] == {"no_room": 1}
    gen.close()
