"""PartialCudaGraphManager with the real capture backend on a GPU: training steps of
tiny Hugging Face models equal eager."""

import copy

import pytest
import torch

from cudagraphs.partial import PartialCudaGraphManager

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

from _hf_models import tiny  # noqa: E402


def tiny_cuda(kind):
    return tiny(kind).cuda()


def loss_of(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_training_steps_equal_eager(kind):
    model = tiny_cuda(kind)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 128, (2, 16), device="cuda", generator=gen) for _ in range(5)]
    mgr = PartialCudaGraphManager.from_model_parts([model])
    mgr.start_recording()
    try:
        for i, ids in enumerate(batches):
            loss, ref_loss = loss_of(model, ids), loss_of(ref, ids)
            loss.backward()
            ref_loss.backward()
            assert torch.equal(loss, ref_loss), f"step {i}: loss differs"
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if p.grad is not None or q.grad is not None:
                    assert torch.equal(p.grad, q.grad), f"step {i}: grad of {name} differs"
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            if i == 0:
                mgr.capture()
        stats = mgr.stats()
        assert stats["replayed"] > 0 and stats["fallbacks"] == 0, stats
        loss_of(model, torch.randint(0, 128, (2, 24), device="cuda")).backward()
        assert mgr.stats()["fallback_shape"] > 0
    finally:
        mgr.close()
