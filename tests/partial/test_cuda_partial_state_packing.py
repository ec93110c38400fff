"""Optimizer state packed after a partial capture, on a GPU.

* ``compact_fragmented`` on state made in the holes between other tensors: it moves
  that state into one buffer per dtype, gives the freed segments back, keeps each
  tensor's identity and values, and the next fused AdamW steps equal an unpacked
  twin's bitwise;
* a manager recording a step of its model's optimizer and of an eager twin's: the
  twin's state is never touched, and training stays bitwise equal to eager while the
  graphs replay."""

import copy

import pytest
import torch

from cudagraphs.optimizer_state import compact_fragmented, freeable_segments, movable_state
from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import token_batches, train_both

pytestmark = pytest.mark.cuda


def _storages(opt) -> set[tuple[torch.dtype, int]]:
    return {
        (t.dtype, t.untyped_storage().data_ptr())
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.is_cuda
    }


def _linears(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    # 2.25 MiB weights: the caching allocator's 20 MiB segments hold several.
    return torch.nn.Sequential(*(torch.nn.Linear(768, 768, bias=False) for _ in range(8))).cuda()


def _step(model, opt, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    model(torch.randn(4, 768, device="cuda", generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_state_made_between_other_tensors_is_packed_and_steps_bitwise():
    model, twin = _linears(0), _linears(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3, fused=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Holes of the state's size between live spacers, then the first step: the state
    # lands in the holes; with the spacers gone its segments hold state and holes.
    spacers = [torch.empty(768 * 768, device="cuda") for _ in range(48)]
    # The peak packing stays under is this test's own: earlier tests' tensors may have
    # left a process peak no higher than what is reserved now.
    torch.cuda.reset_peak_memory_stats()
    del spacers[::2]
    _step(model, opt, 1)
    del spacers
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Copies on the host: device copies would fill the very holes packing frees.
    before = {id(t): (t, t.cpu()) for s in opt.state.values() for t in s.values()}
    reserved = torch.cuda.memory_reserved()
    device = torch.cuda.current_device()
    movable = {t.data_ptr(): t.untyped_storage().nbytes() for t in movable_state(opt, device)}
    plan = freeable_segments(torch.cuda.memory_snapshot(), movable)

    moved, released = compact_fragmented([opt], device, "test")

    assert moved > 0 and released > 0, (moved, released, len(movable), plan)
    assert torch.cuda.memory_reserved() < reserved
    for t, old in before.values():
        assert torch.equal(t.cpu(), old)
    assert {id(t) for s in opt.state.values() for t in s.values()} == set(before)
    # The moved state shares one storage per dtype now.
    packed = [s for s in _storages(opt) if s[0] == torch.float32]
    assert len(packed) < len(before)
    # The twin's state is made only now, where the packing could not see it.
    _step(twin, twin_opt, 1)
    for seed in (2, 3, 4):
        _step(model, opt, seed)
        _step(twin, twin_opt, seed)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fused", [True, False])
def test_a_manager_packs_its_own_optimizer_only_and_trains_equal_to_eager(fused):
    model = tiny("llama").cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=fused)
    batches = token_batches(3, 5)
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
    try:
        train_both(model, ref, mgr, batches, (opt, ref_opt))
        stats = mgr.stats()
        assert stats["replayed"] > 0 and stats["fallbacks"] == 0, stats
        # The twin's optimizer stepped inside the recording too: its state is one
        # storage per tensor still.
        unpacked = _storages(ref_opt)
        assert len(unpacked) == sum(
            isinstance(t, torch.Tensor) and t.is_cuda
            for s in ref_opt.state.values()
            for t in s.values()
        )
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
        for s, u in zip(opt.state.values(), ref_opt.state.values()):
            for key in s:
                assert torch.equal(s[key], u[key]), key
    finally:
        mgr.close()
