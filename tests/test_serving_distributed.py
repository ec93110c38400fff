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
        }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


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
    assert results[0] == results[1]


def test_without_process_group_returns_local_answer():
    assert not dist.is_initialized()
    assert is_distributed() is False
    assert agree_on_captured([True, False, True]) == [True, False, True]
    assert agree_on_captured([1, 0]) == [True, False]
    assert agree_on_captured([]) == []
    assert agree_on_batch_size(3) == 3
    assert isinstance(agree_on_batch_size(7), int)
