"""The demo decoder behind a GraphRunner: greedy tokens equal eager for every bucket
and for padded batch sizes (eager stand-in for capture on the CPU; the same check runs
with real graphs on the GPU)."""

import pytest
import torch

from cudagraphs.models import DecoderConfig, TinyDecoder, greedy_decode
from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec
from helpers.serving_runner import eager_backend

CFG = DecoderConfig(
    vocab=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, max_seq=16, max_batch=64
)


def decoder():
    torch.manual_seed(0)
    return TinyDecoder(CFG).eval()


def runner_for(model, device="cpu", backend=None):
    specs = [
        InputSpec("tokens", (CFG.max_batch,), torch.long),
        InputSpec("positions", (CFG.max_batch,), torch.long),
    ]
    return GraphRunner(
        lambda tokens, positions: model(tokens, positions),
        specs,
        BucketConfig(),
        device=device,
        capture_backend=backend,
    )


def dummy(bucket, device="cpu"):
    return {
        "tokens": torch.zeros(bucket.rows, dtype=torch.long, device=device),
        "positions": torch.zeros(bucket.rows, dtype=torch.long, device=device),
    }


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 33, 64])
@torch.no_grad()
def test_greedy_tokens_equal_eager(batch):
    model = decoder()
    prompts = torch.randint(
        0, CFG.vocab, (batch, 4), generator=torch.Generator().manual_seed(batch)
    )
    want = greedy_decode(model, prompts, new_tokens=6)
    model.k_cache.zero_()
    model.v_cache.zero_()
    runner = runner_for(model, backend=eager_backend())
    runner.capture(dummy)
    model.k_cache.zero_()
    model.v_cache.zero_()
    got = greedy_decode(
        lambda t, p: runner.run({"tokens": t, "positions": p}), prompts, new_tokens=6
    )
    assert torch.equal(got, want)
    assert sum(runner.stats()["replays"].values()) == 4 + 6 - 1
