"""Partial graphs over compiled targets on the GPU: with ``compile_options={}`` each
target's graph records inductor's kernels (forward and backward), replays, and trains
bit for bit like the same targets compiled and run eagerly."""

import copy

import pytest
import torch

from cudagraphs.compile_watch import CompileWatch
from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import token_batches, train_both

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


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
    batches = token_batches(4, 5)
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False, compile_options={})

    def capture():
        watch = CompileWatch.start()
        mgr.capture()
        report = watch.finish()
        assert report.frames and report.seconds > 0, "the capture compiled nothing"
        assert report.graph_breaks == 0, report
        # Ours recorded step 0 eagerly; from step 1 on it replays compiled, and so does
        # the reference.
        compile_like_ours(ref, model, mgr)

    try:
        train_both(model, ref, mgr, batches, (opt, ref_opt), capture)
        stats = mgr.stats()
        assert stats["captured"] == 2 and stats["fallbacks"] == 0, stats
        assert stats["replayed"] == 4 * 2, stats
        # The captures' set-up, with the compile apart from the rest of the warmup.
        assert stats["compiled_frames"] >= 1, stats
        assert 0 < stats["compile_ms"] <= stats["warmup_ms"], stats
        assert stats["capture_ms"] > 0, stats
    finally:
        mgr.close()
