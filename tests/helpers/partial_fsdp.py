"""FSDP2 (``fully_shard``) models for the partial-graph tests: a tiny HF Llama sharded
layer by layer, one training step, its full gradients, an eager capture backend that
keeps its samples, and the worker of the two-rank gloo test (a helper module, so that
spawned ranks import it without importing a test module)."""

import torch
from torch.distributed import fsdp

from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny


def eager_backend(callables, sample_args, sample_kwargs):
    """A capture backend that graphs nothing: the callables run eagerly. Appends each
    capture's ``sample_args`` to ``eager_backend.samples`` (cleared by the caller)."""
    eager_backend.samples.append(sample_args)
    return list(callables)


eager_backend.samples = []


def sharded_llama(device="cpu"):
    """A tiny HF Llama with each decoder layer and the whole model ``fully_shard``-ed
    over the current process group (which the caller initialises)."""
    model = tiny("llama").to(device)
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def step(model, ids):
    """Forward and backward of the mean squared logits; returns the detached loss."""
    loss = model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
    loss.backward()
    return loss.detach()


def full_grads(model):
    """Every gradient of a sharded model, gathered whole, by parameter name."""
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def two_rank_worker(rank):
    """One rank of the two-rank test: each rank trains on its own batches (data
    parallel) while FSDP2 shards every layer across both ranks; the graphed (eager
    backend) and the reference model must agree. Returns what ``helpers.spawn``
    collects: the mismatches, the manager's stats and the rows of the local shard."""
    model, ref = sharded_llama(), sharded_llama()
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=eager_backend)
    gen = torch.Generator().manual_seed(10 + rank)
    mismatches = []
    mgr.start_recording()
    try:
        for i in range(3):
            ids = torch.randint(0, 128, (2, 8), generator=gen)
            if not torch.equal(step(model, ids), step(ref, ids)):
                mismatches.append(f"step {i}: loss")
            got, want = full_grads(model), full_grads(ref)
            mismatches += [
                f"step {i}: grad of {n}" for n in want if not torch.equal(got[n], want[n])
            ]
            model.zero_grad()
            ref.zero_grad()
            if i == 0:
                mgr.capture()
        stats = mgr.stats()
    finally:
        mgr.close()
    shard = next(model.parameters()).to_local().shape[0]
    return {"mismatches": mismatches, "stats": stats, "local_rows": shard}
