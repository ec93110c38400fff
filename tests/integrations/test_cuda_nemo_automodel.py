"""NeMo Automodel's own PartialCudaGraphManager (from its wheel, unmodified) capturing
with cudagraphs' helper on a real GPU: the steps equal eager's bit for bit, and they
replayed."""

import pytest
import torch

from cudagraphs.integrations.nemo_automodel import NEMO_PARTIAL_MODULE, use_cudagraphs
from helpers.hf_models import tiny

pytestmark = pytest.mark.cuda

nemo = pytest.importorskip(NEMO_PARTIAL_MODULE, reason="nemo-automodel is not installed")


def _trainer(model):
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=gen, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def test_nemo_partial_graphs_on_our_core_train_equal_to_eager():
    from types import SimpleNamespace

    graphed, eager = tiny("llama").cuda().train(), tiny("llama").cuda().train()
    graphed.backend = SimpleNamespace(cuda_graph=SimpleNamespace(modules=["attn"]))
    step, eager_step = _trainer(graphed), _trainer(eager)
    with use_cudagraphs():
        manager = nemo.PartialCudaGraphManager.from_model_parts([graphed])
        try:
            losses = [step()]  # recorded
            manager.capture()
            losses += [step() for _ in range(4)]
            eager_losses = [eager_step() for _ in range(5)]
            stats = manager.stats()
        finally:
            manager.close()
    assert stats["captured"] == 2 and stats["replayed"] >= 8 and stats["fallback"] == 0, stats
    for k, (a, b) in enumerate(zip(losses, eager_losses)):
        assert torch.equal(a, b), f"loss of step {k}"
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), f"{name} after 5 AdamW steps"
