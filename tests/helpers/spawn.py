"""Run a worker on several gloo ranks in spawned processes (file rendezvous, no fixed
port) and collect what each rank wrote, for the CPU tests of distributed logic."""

import json
import os
import sys
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(worker, rank, world_size, init_file, out_dir):
    try:
        dist.init_process_group(
            "gloo",
            init_method="file://" + init_file,
            rank=rank,
            world_size=world_size,
            # Generous: a worker's first imports (transformers, on a cold clean clone)
            # can hold one rank back for many seconds while the other already waits
            # in a collective. The parent's join timeout bounds the whole run.
            timeout=timedelta(seconds=300),
        )
        result = worker(rank)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        # Tear down together: a rank that closes its gloo connections while its peer
        # still has work in flight can abort the peer.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        # The parent reports this, so a failing rank says why in the test output.
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # Leave without the interpreter's teardown: spawned children otherwise run C++
    # static destructors while gloo's background threads may still be joinable, and
    # under load that aborts a rank whose work is done ("terminate called without an
    # active exception", seen in CI). Everything this rank reports is written above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, world_size, tmp_path, timeout_s=60):
    """Run ``worker(rank) -> JSON-able result`` on ``world_size`` gloo ranks; return the
    results in rank order. Fails the test when a rank hangs or exits with an error."""
    ctx = mp.get_context("spawn")
    init_file = str(tmp_path / "rendezvous")
    procs = [
        ctx.Process(target=_entry, args=(worker, rank, world_size, init_file, str(tmp_path)))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {
        rank: (tmp_path / f"rank{rank}.error").read_text()
        for rank in range(world_size)
        if (tmp_path / f"rank{rank}.error").exists()
    }
    assert not hung, f"ranks {hung} did not finish within {timeout_s}s; errors: {errors}"
    assert [p.exitcode for p in procs] == [0] * world_size, (
        f"exit codes {[p.exitcode for p in procs]}; errors: {errors}"
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
