"""PartialCudaGraphManager with the real capture backend on a GPU: training steps of
tiny Hugging Face models equal eager."""

import copy

import pytest
import torch

from cudagraphs.moe_kernels import GroupedMMProbe
from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import loss_of, step_both_and_compare, token_batches, train_both

ATTN_ROUTER = ("attention", "moe_router")

pytestmark = pytest.mark.cuda


def tiny_cuda(kind):
    return tiny(kind).cuda()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_training_steps_equal_eager(kind):
    model = tiny_cuda(kind)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batches = token_batches(1, 5)
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
    try:
        train_both(model, ref, mgr, batches, (opt, ref_opt))
        stats = mgr.stats()
        assert stats["replayed"] > 0 and stats["fallbacks"] == 0, stats
        # The core's graphs replay from the contract's tensors (one flatten per call).
        assert all(v.replay_checked is not None for e in mgr.recordings for v in e.variants)
        loss_of(model, torch.randint(0, 128, (2, 24), device="cuda")).backward()
        assert mgr.stats()["fallback_shape"] > 0
    finally:
        mgr.close()


def test_with_activation_checkpointing_losses_and_grads_equal_eager():
    # Hugging Face checkpointing recomputes each layer in backward, so a target runs
    # twice per step; the manager must stay correct (replay or counted fallback).
    model = tiny_cuda("llama")
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = token_batches(2, 3)
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], activation_checkpointing=True, speed_check=False, scopes=ATTN_ROUTER
    )
    mgr.start_recording()
    try:
        for i, ids in enumerate(batches):
            step_both_and_compare(model, ref, ids, i)
            model.zero_grad()
            ref.zero_grad()
            if i == 0:
                mgr.capture()
                replayed_at_capture = mgr.stats()["replayed"]
        stats = mgr.stats()
        # Graphs were captured and then used: every later call, the recompute in
        # backward included, replayed (an eager fallback would equal eager trivially).
        assert stats["captured"] > 0 and stats["fallbacks"] == 0, stats
        # Two steps after capture, each target replayed in the forward and again in the
        # backward's recompute.
        assert stats["replayed"] - replayed_at_capture == 2 * len(mgr.recordings) * 2, stats
        assert mgr.activation_checkpointing  # one pool per graph: a recompute is safe
    finally:
        mgr.close()


def test_dropout_in_graphed_attention_draws_fresh_masks_and_eager_rng_still_works():
    model = tiny("llama")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model = model.cuda().train()
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
    mgr.start_recording()
    try:
        loss_of(model, ids).backward()
        mgr.capture()
        losses = [loss_of(model, ids) for _ in range(3)]
        for loss in losses:
            loss.backward()
        assert mgr.stats()["replayed"] > 0 and mgr.stats()["fallbacks"] == 0, mgr.stats()
        assert len({loss.item() for loss in losses}) == 3, f"same dropout masks: {losses}"
        # An eager fallback (new sequence length) draws from the same generator.
        loss_of(model, torch.randint(0, 128, (2, 24), device="cuda")).backward()
        assert mgr.stats()["fallback_shape"] > 0
    finally:
        mgr.close()


def test_fsdp2_world_size_1_training_equals_eager(tmp_path):
    # FSDP2 re-allocates unsharded parameters at every unshard: the graphs get them as
    # copied inputs, fetched at each call (cudagraphs.partial.fsdp).
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        models = []
        for _ in range(2):
            model = tiny_cuda("llama")
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            models.append(model)
        model, ref = models
        batches = token_batches(4, 4)
        mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
        assert all(e.fsdp for e in mgr.recordings)
        mgr.start_recording()
        try:
            for i, ids in enumerate(batches):
                loss, ref_loss = loss_of(model, ids), loss_of(ref, ids)
                loss.backward()
                ref_loss.backward()
                assert torch.equal(loss, ref_loss), f"step {i}: loss differs"
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                    assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), (
                        f"step {i}: grad of {name} differs"
                    )
                model.zero_grad()
                ref.zero_grad()
                if i == 0:
                    del loss, ref_loss
                    mgr.capture()
            stats = mgr.stats()
            assert stats["replayed"] > 0 and stats["fallbacks"] == 0, stats
        finally:
            mgr.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_the_default_speed_check_runs_on_the_gpu_and_training_stays_equal(kind, monkeypatch):
    from cudagraphs.partial.speed import SpeedCheck

    verdicts = []
    measure = SpeedCheck.measure

    def spy(self, graph, eager):
        verdicts.append(measure(self, graph, eager))
        return verdicts[-1]

    monkeypatch.setattr(SpeedCheck, "measure", spy)
    model = tiny_cuda(kind)
    ref = copy.deepcopy(model)
    batches = token_batches(5, 4)
    mgr = PartialCudaGraphManager.from_model_parts([model])  # speed_check=True
    try:
        train_both(model, ref, mgr, batches)
        assert len(verdicts) == len(mgr.recordings), "one verdict per training target"
        assert all(v.graph_ms > 0 and v.eager_ms > 0 for v in verdicts)
        stats = mgr.stats()
        off = stats.get("off_slower_than_eager", 0)
        assert off == sum(v.slower for v in verdicts), (stats, verdicts)
        assert stats["fallbacks"] == 0, stats
    finally:
        mgr.close()


@pytest.mark.parametrize(
    "kind, scopes",
    [
        ("llama", ("layer",)),
        ("qwen3_moe", ("layer",)),
        ("mixtral", ("layer",)),
        ("deepseek_v3", ("layer",)),
        ("qwen3_moe", ("attention", "moe")),
        ("deepseek_v3", ("attention", "moe", "mlp")),
        ("llama", ("attention", "mlp")),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, tuple) else v,
)
def test_wider_scopes_train_equal_to_eager_for_five_adamw_steps(kind, scopes):
    # MoE experts on grouped_mm (static shapes) in both models, in bfloat16, the dtype
    # torch's grouped GEMM runs on the device: the graphs must replay the kernels
    # eager runs, so every loss and gradient is bitwise equal.
    model = tiny(kind)
    if hasattr(model, "set_experts_implementation") and kind != "llama":
        model.set_experts_implementation("grouped_mm")
    model = model.to("cuda", torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batches = token_batches(7, 6)
    mgr = PartialCudaGraphManager.from_model_parts([model], scopes=scopes, speed_check=False)
    assert not mgr.narrowed and not mgr.skipped, (mgr.narrowed, mgr.skipped)
    try:
        train_both(model, ref, mgr, batches, (opt, ref_opt))
        stats = mgr.stats()
        assert stats["fallbacks"] == 0, stats
        assert stats["replayed"] == 5 * len(mgr.recordings), stats
    finally:
        mgr.close()


def test_whole_layers_with_activation_checkpointing_equal_eager():
    model = tiny_cuda("llama")
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = token_batches(8, 3)
    mgr = PartialCudaGraphManager.from_model_parts([model], scopes=("layer",), speed_check=False)
    try:
        train_both(model, ref, mgr, batches)
        assert mgr.stats()["fallbacks"] == 0 and mgr.stats()["replayed"] == 2 * 2
    finally:
        mgr.close()


def test_float32_grouped_mm_experts_narrow_where_torch_runs_them_on_the_host():
    # torch 2.11 has no float32 grouped GEMM kernel: it loops on the host over offsets
    # copied there, which no capture can hold. The layer narrows to attention + router
    # (said and counted) and trains equal to eager, instead of failing at capture.
    model = tiny("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    model = model.cuda()
    on_device = GroupedMMProbe().on_device(model.model.layers[0].mlp.experts.gate_up_proj)
    ref = copy.deepcopy(model)
    batches = token_batches(9, 3)
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], scopes=("layer",) + ATTN_ROUTER, speed_check=False
    )
    try:
        kinds = [e.target.kind for e in mgr.recordings]
        if on_device:  # a torch with a float32 kernel on this GPU: whole layers
            assert kinds == ["layer", "layer"] and not mgr.narrowed
        else:
            assert kinds == ["attention", "router"] * 2, kinds
            assert [b.reason for b in mgr.narrowed] == ["host_grouped_mm"] * 2
        train_both(model, ref, mgr, batches)
        stats = mgr.stats()
        assert stats["fallbacks"] == 0 and stats["replayed"] == 2 * len(mgr.recordings), stats
    finally:
        mgr.close()
