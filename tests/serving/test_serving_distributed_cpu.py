"""Rank agreement on captured buckets and padded batch sizes: two gloo processes on the
CPU (file rendezvous, no fixed port), and the local answer without a process group."""

import pytest
import torch.distributed as dist

from cudagraphs.serving import agree_on_batch_size, agree_on_captured, is_distributed
from helpers.spawn import run_ranks

WORLD_SIZE = 2


def _worker(rank):
    local = [True, True, rank != 1, True]  # rank 1 failed bucket index 2
    return {
        "distributed": is_distributed(),
        "captured": agree_on_captured(local),
        "batch_size": agree_on_batch_size(3 if rank == 0 else 5),
        "all_ok": agree_on_captured([True, True, True]),
        "empty": agree_on_captured([]),
        "runner": _runner_on_rank(rank),
    }


def _runner_on_rank(rank):
    """A runner whose bucket 8 fails to capture on rank 1 only; batches of 3 (rank 0)
    and 5 (rank 1) must replay the same bucket on both ranks."""
    from cudagraphs.serving import Bucket
    from helpers.serving_runner import batch, dummy, eager_backend, make_runner

    backend = eager_backend(fail_on=[Bucket(8)] if rank == 1 else [])
    runner = make_runner(backend=backend, require_all_buckets=False)
    runner.capture(dummy)
    runner.run(batch(3 if rank == 0 else 5))
    stats = runner.stats()
    return {
        "dropped": sorted(stats["dropped"]),
        "replayed": sorted(b for b, n in stats["replays"].items() if n),
    }


@pytest.mark.spawns
def test_two_gloo_ranks_agree(tmp_path):
    results = run_ranks(_worker, WORLD_SIZE, tmp_path)
    for r in results:
        assert r["distributed"] is True
        assert r["captured"] == [True, True, False, True]
        assert r["batch_size"] == 5
        assert r["all_ok"] == [True, True, True]
        assert r["empty"] == []
        # rank 1's failed bucket is dropped everywhere; both pad to 5 and use bucket 16
        assert r["runner"] == {"dropped": ["bucket(bs=8)"], "replayed": ["bucket(bs=16)"]}
    assert results[0] == results[1]


def test_without_process_group_returns_local_answer():
    assert not dist.is_initialized()
    assert is_distributed() is False
    assert agree_on_captured([True, False, True]) == [True, False, True]
    assert agree_on_captured([1, 0]) == [True, False]
    assert agree_on_captured([]) == []
    assert agree_on_batch_size(3) == 3
    assert isinstance(agree_on_batch_size(7), int)
