"""The "model" scope's GPU tests' kit: tiny HF models in bfloat16 on the GPU, batches
with a left-padded attention mask and labels, the HF loss, and training a graphed
model beside its eager copy with every loss and gradient compared bitwise."""

import torch

from helpers.hf_models import tiny


def bf16(kind):
    """A tiny HF model of family ``kind`` in bfloat16 on the GPU; the MoE families
    run their experts through grouped GEMM."""
    model = tiny(kind)
    if kind != "llama":
        model.set_experts_implementation("grouped_mm")
    return model.to("cuda", torch.bfloat16)


def batch(gen, rows=2, seq=16, pad=0):
    """ids, a left-padded attention mask (``pad`` masked positions in row 0) and
    labels (-100 where masked)."""
    ids = torch.randint(0, 128, (rows, seq), device="cuda", generator=gen)
    mask = torch.ones(rows, seq, dtype=torch.long, device="cuda")
    mask[0, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def hf_loss(model, ids, mask, labels, **kw):
    """The loss the HF model computes itself from ``labels``."""
    return model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss


def train_both(model, ref, mgr, batches, loss_fn, *, optimizers=True):
    """Record batch 0, capture after it, train on all; every loss and gradient equal."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)] if optimizers else []
    mgr.start_recording()
    for i, b in enumerate(batches):
        loss, ref_loss = loss_fn(model, *b), loss_fn(ref, *b)
        loss.backward()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), f"step {i}: loss {loss} vs {ref_loss}"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {i}: grad of {name}"
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if i == 0:
            mgr.capture()
