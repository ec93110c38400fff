"""PartialCudaGraphManager over FSDP2 (fully_shard) models on the CPU: gloo with world
size 1 and an eager capture backend. The unsharded parameters are fetched at each call
and passed as ordinary (copied) graph inputs; losses and gradients equal FSDP eager."""

import pytest
import torch

from cudagraphs.partial import PartialCudaGraphManager, TargetSelectionError
from helpers.hf_models import tiny

pytest.importorskip("torch.distributed.fsdp")

from helpers.partial_fsdp import (  # noqa: E402  (after the skip: it imports fsdp)
    eager_backend,
    full_grads,
    sharded_llama,
    step,
    two_rank_worker,
)


def test_fsdp2_targets_replay_with_the_current_unsharded_parameters(process_group):
    model, ref = sharded_llama(), sharded_llama()
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=eager_backend)
    assert [e.fsdp for e in mgr.recordings] == [True, True]
    # Parameters are kept by name and read at each call: no sharded DTensor is held.
    assert all(e.param_names and e.params_at is None for e in mgr.recordings)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, 8), generator=gen) for _ in range(3)]
    eager_backend.samples.clear()
    mgr.start_recording()
    try:
        for i, ids in enumerate(batches):
            assert torch.equal(step(model, ids), step(ref, ids)), f"step {i}: loss"
            got, want = full_grads(model), full_grads(ref)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), f"step {i}: grad of {name}"
            model.zero_grad()
            ref.zero_grad()
            if i == 0:
                mgr.capture()
        # Captured with plain tensor samples of the unsharded parameters (copied
        # inputs, not parameters read in place), released after capture.
        (sample_args,) = eager_backend.samples
        params = sample_args[0][0]
        assert params and not any(isinstance(p, torch.nn.Parameter) for p in params)
        assert all(v.params == () and v.args is None for e in mgr.recordings for v in e.variants)
        stats = mgr.stats()
        assert stats["replayed"] == 4 and stats["fallbacks"] == 0, stats
    finally:
        mgr.close()


def test_dtensor_parameters_outside_fsdp2_are_refused(process_group):
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    model = tiny("llama")
    mesh = DeviceMesh("cpu", [0])
    attn = model.model.layers[0].self_attn
    attn.q_proj.weight = torch.nn.Parameter(
        distribute_tensor(attn.q_proj.weight.data, mesh, [Replicate()])
    )
    with pytest.raises(
        TargetSelectionError, match=r"self_attn\.q_proj\.weight is a DTensor outside FSDP2"
    ) as err:
        PartialCudaGraphManager.from_model_parts([model], capture_backend=eager_backend)
    assert isinstance(err.value, ValueError) and "fully_shard" in str(err.value)


def test_fsdp2_with_graphs_disabled_equals_eager_and_captures_nothing(process_group, monkeypatch):
    # CUDAGRAPHS_DISABLE=1: the same path (parameters fetched per call, passed to the
    # adapter first), with the adapter run eagerly in place of a graph.
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")

    def refusing_backend(callables, sample_args, sample_kwargs):
        raise AssertionError("a graphing backend ran under CUDAGRAPHS_DISABLE=1")

    model, ref = sharded_llama(), sharded_llama()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=refusing_backend)
    gen = torch.Generator().manual_seed(2)
    mgr.start_recording()
    try:
        for i in range(3):
            ids = torch.randint(0, 128, (2, 8), generator=gen)
            assert torch.equal(step(model, ids), step(ref, ids)), f"step {i}: loss"
            got, want = full_grads(model), full_grads(ref)
            for name in want:
                assert torch.equal(got[name], want[name]), f"step {i}: grad of {name}"
            model.zero_grad()
            ref.zero_grad()
            if i == 0:
                mgr.capture()
        stats = mgr.stats()
        assert stats["disabled"] == 1 and stats["captured"] == 0, stats
        assert stats["replayed"] == 4 and stats["fallbacks"] == 0, stats
    finally:
        mgr.close()


@pytest.mark.spawns
def test_fsdp2_across_two_gloo_ranks_equals_eager(tmp_path):
    from helpers.spawn import run_ranks

    results = run_ranks(two_rank_worker, 2, tmp_path, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches']}"
        assert r["stats"]["replayed"] == 4 and r["stats"]["fallbacks"] == 0, r["stats"]
    assert results[0]["local_rows"] == 64, "the embedding (128 rows) should be sharded in 2"


def test_a_whole_layer_that_is_an_fsdp2_unit_reads_the_parameters_it_is_given(process_group):
    # The graphed function of a target that is itself a fully_shard unit must not run
    # the unit's hooks: FSDP2's pre-forward hook would install its own unsharded
    # parameters over the inputs (the graph would then not read its parameter inputs,
    # which autograd refuses at warmup on a GPU). Probed here with zeroed parameters.
    depends = []

    def probing_backend(callables, sample_args, sample_kwargs):
        for fn, (params, *args), kwargs in zip(callables, sample_args, sample_kwargs):
            with torch.no_grad():
                real = fn(params, *args, **kwargs)
                zeroed = fn(tuple(torch.zeros_like(p) for p in params), *args, **kwargs)
            first = (
                (real[0] if isinstance(real, tuple) else real),
                (zeroed[0] if isinstance(zeroed, tuple) else zeroed),
            )
            depends.append(not torch.equal(*first))
        return list(callables)

    model = sharded_llama()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=probing_backend, scopes=("layer",)
    )
    assert [(e.target.kind, e.fsdp) for e in mgr.recordings] == [("layer", True)] * 2
    mgr.start_recording()
    try:
        step(model, torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3)))
        mgr.capture()
        assert depends == [True, True]
    finally:
        mgr.close()
