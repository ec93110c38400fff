"""Optimizer state packed after a partial capture, on a GPU: the state of the model's
optimizer that stepped while recording moves into one buffer per dtype, the eager
twin's optimizer (stepping in the same recording) is left alone, and training stays
bitwise equal to eager while the graphs replay."""

import copy

import pytest
import torch

from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import train_both

pytestmark = pytest.mark.cuda


def _storages(opt) -> set[tuple[torch.dtype, int]]:
    return {
        (t.dtype, t.untyped_storage().data_ptr())
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.is_cuda
    }


@pytest.mark.parametrize("fused", [True, False])
def test_packed_state_trains_equal_to_eager(fused):
    model = tiny("llama").cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=fused)
    gen = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, 128, (2, 16), device="cuda", generator=gen) for _ in range(5)]
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
    try:
        train_both(model, ref, mgr, batches, (opt, ref_opt))
        stats = mgr.stats()
        assert stats["replayed"] > 0 and stats["fallbacks"] == 0, stats
        assert stats["compacted_state_bytes"] > 0, stats
        packed, unpacked = _storages(opt), _storages(ref_opt)
        # One storage per dtype for the model's optimizer, one per tensor for the twin.
        assert len(packed) == len({dtype for dtype, _ in packed})
        assert len(unpacked) > len({dtype for dtype, _ in unpacked})
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
        for s, u in zip(opt.state.values(), ref_opt.state.values()):
            for key in s:
                assert torch.equal(s[key], u[key]), key
    finally:
        mgr.close()
