"""Rank agreement on captured buckets and padded batch sizes: two gloo processes on the
CPU (file rendezvous, no fixed port), and the local answer without a process group."""

import json
import os
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from cudagraphs.serving import agree_on_batch_size, agree_on_captured, is_distributed

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 60


def _worker(rank, init_file, out_dir):
    # Runs in a spawned process; everything it learns goes to out_dir/rank<r>.json.
    dist.init_process_group(
        "gloo",
        init_method="file://" + init_file,
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=30),
    )
    try:
        local = [True, True, rank != 1, True]  # rank 1 failed bucket index 2
        result = {
            "distributed": is_distributed(),
            "captured": agree_on_captured(local),
            "batch_size": agree_on_batch_size(3 if rank == 0 else 5),
            "all_ok": agree_on_captured([True, True, True]),
            "empty": agree_on_captured([]),
            "runner": _runner_on_rank(rank),
        }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _runner_on_rank(rank):
    """A runner whose bucket 8 fails to capture on rank 1 only; batches of 3 (rank 0)
    and 5 (rank 1) must replay the same bucket on both ranks."""
    from cudagraphs.serving import Bucket
    from test_serving_runner import batch, dummy, eager_backend, make_runner

    backend = eager_backend(fail_on=[Bucket(8)] if rank == 1 else [])
    runner = make_runner(backend=backend, require_all_buckets=False)
    runner.capture(dummy)
    runner.run(batch(3 if rank == 0 else 5))
    stats = runner.stats()
    return {
        "dropped": sorted(stats["dropped"]),
        "replayed": sorted(b for b, n in stats["replays"].items() if n),
    }


def test_two_gloo_ranks_agree(tmp_path):
    ctx = mp.get_context("spawn")
    init_file = str(tmp_path / "rendezvous")
    procs = [
        ctx.Process(target=_worker, args=(rank, init_file, str(tmp_path)))
        for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=JOIN_TIMEOUT_S)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish within {JOIN_TIMEOUT_S}s"
    assert [p.exitcode for p in procs] == [0] * WORLD_SIZE

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
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
