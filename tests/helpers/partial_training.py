"""Training steps of a partial-graph model beside its eager copy: a pass-through
capture backend, the loss the tests train on, and the comparisons of every loss and
gradient, bitwise (on the CPU with the eager backend, or on a GPU with real graphs)."""

import torch


def token_batches(seed, n, shape=(2, 16), vocab=128):
    """``n`` batches of token ids on the GPU, drawn from a generator seeded ``seed``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, vocab, shape, device="cuda", generator=gen) for _ in range(n)]


def backend(callables, sample_args, sample_kwargs):
    """A capture backend that graphs nothing: the callables run eagerly."""
    return list(callables)


def loss_of(model, ids):
    """The mean squared logits of an HF model on ``ids`` (no KV cache)."""
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


def train_and_compare(model, ref, mgr, steps=3):
    """Record step 0, capture after it, train ``steps`` random (2, 8) batches; every
    loss and gradient of ``model`` must equal ``ref``'s. Returns ``mgr.stats()``."""
    gen = torch.Generator().manual_seed(0)
    mgr.start_recording()
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 8), generator=gen)
        loss, ref_loss = loss_of(model, ids), loss_of(ref, ids)
        loss.backward()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), f"step {step}: loss"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name}"
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if step == 0:
            mgr.capture()
    return mgr.stats()


def step_both_and_compare(model, ref, ids, step):
    """Forward + backward of both models on ``ids``; losses and grads must be equal."""
    loss, ref_loss = loss_of(model, ids), loss_of(ref, ids)
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss), f"step {step}: loss differs"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is not None or q.grad is not None:
            assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name} differs"


def train_both(model, ref, mgr, batches, optimizers=(), capture=None):
    """Record the first batch, capture after it (``capture()``, by default
    ``mgr.capture``), then train on the rest; both models step alike (``optimizers``:
    one per model, stepped after each batch) and every loss and gradient must be
    equal."""
    mgr.start_recording()
    for i, ids in enumerate(batches):
        step_both_and_compare(model, ref, ids, i)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if i == 0:
            (capture or mgr.capture)()
