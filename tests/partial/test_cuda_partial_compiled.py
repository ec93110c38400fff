"""Partial graphs over compiled targets on the GPU: with ``compile_options={}`` each
target's graph records inductor's kernels (forward and backward), replays, and trains
bit for bit like the same targets compiled and run eagerly."""

import copy

import pytest
import torch

from cudagraphs.compile_watch import CompileWatch
from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import step_both_and_compare

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_like_ours(ref, model, mgr):
    """Compile in ``ref`` the forward of each module that ``mgr`` graphs in ``model``."""
    names = {id(m): n for n, m in model.named_modules()}
    for rec in mgr.recordings:
        sub = ref.get_submodule(names[id(rec.target.module)])
        sub.forward = torch.compile(sub.forward)


def test_compiled_targets_replay_and_train_like_their_compiled_eager_forwards():
    model = tiny("llama").cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    batches = [torch.randint(0, 128, (2, 16), device="cuda", generator=gen) for _ in range(5)]
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False, compile_options={})
    try:
        mgr.start_recording()
        for i, ids in enumerate(batches):
            if i == 1:  # ours recorded step 0 eagerly; from step 1 on it replays compiled
                compile_like_ours(ref, model, mgr)
            step_both_and_compare(model, ref, ids, i)
            opt.step()
            ref_opt.step()
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            if i == 0:
                watch = CompileWatch.start()
                mgr.capture()
                report = watch.finish()
                assert report.frames and report.seconds > 0, "the capture compiled nothing"
                assert report.graph_breaks == 0, report
        stats = mgr.stats()
        assert stats["captured"] == 2 and stats["fallbacks"] == 0, stats
        assert stats["replayed"] == 4 * 2, stats
    finally:
        mgr.close()
