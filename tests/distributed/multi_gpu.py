"""Multi-GPU checks (issue 7): one process per GPU, NCCL, file rendezvous.

    PYTHONPATH=src:tests python tests/distributed/multi_gpu.py --out DIR [--nprocs N]

N defaults to every visible GPU. Each rank runs every check and writes
``DIR/rank{r}.json``; rank 0 also writes ``DIR/multi_gpu-<N>gpu.json`` with the
verdict of every check across ranks. Exit status 0 when every check passed on every
rank, 1 otherwise, 2 without enough GPUs.

Checks (each written for any number of ranks; with one rank they run degenerate:
the collectives are identities, nothing can disagree):

* ``allreduce_program``: a ``CudaGraphProgram`` whose function all-reduces; 20 replays
  with new inputs equal the sum over ranks.
* ``allreduce_core``: the same through ``make_graphed_callables`` (forward only).
* ``serving_agreement``: a ``GraphRunner`` whose bucket 8 fails to capture on the
  last rank only (a host sync inside capture); every rank drops it, nobody hangs
  (bounded by the process-group timeout), and every rank replays the same bucket.
* ``partial_fsdp2``: partial graphs (real capture) on a tiny HF Llama sharded with
  FSDP2 ``fully_shard`` across the ranks; 5 AdamW steps equal eager bitwise.

* ``train_step_allreduce``: ``graph_train_step`` of a block stack with its in-graph
  gradient all-reduce (on by default with more than one rank; asked for with one) and
  clipping, each rank
  on its own batches; 20 steps equal, bitwise, the eager loop that calls
  ``all_reduce_gradients``, clips and steps the same prepared AdamW; the parameters
  end equal on every rank.

* ``pipeline_order``: every rank is one pipeline stage holding one chunk of two
  layers graphed with ``make_graphed_callables(..., _order=...)`` for 3 microbatches
  (all forwards, then all backwards); activations and gradients cross stages by
  send/recv outside the graphs. Parameter gradients over 2 iterations, and every
  gradient sent upstream, equal an eager run of the same schedule bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 20
TIMEOUT_S = 120


def _ok(failures: list[str], **extra: object) -> dict:
    return {"ok": not failures, "failures": failures, **extra}


def check_allreduce_program(rank: int, world: int) -> dict:
    from cudagraphs import CudaGraphProgram

    def reduce_twice(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y

    example = torch.zeros(1024, device="cuda")
    program = CudaGraphProgram.capture(reduce_twice, example_inputs=(example,))
    failures = []
    try:
        for step in range(STEPS):
            x = torch.full((1024,), float(step), device="cuda") + rank
            want = 2 * (world * step + world * (world - 1) / 2)
            got = program.replay(x, synchronize=True)
            if not torch.all(got == want):
                failures.append(f"replay {step}: {got[0].item()} != {want}")
    finally:
        program.close()
    return _ok(failures, staging=program.staging)


def check_allreduce_core(rank: int, world: int) -> dict:
    from cudagraphs import make_graphed_callables

    def reduce_twice(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y

    graphed = make_graphed_callables(reduce_twice, (torch.zeros(1024, device="cuda"),))
    failures = []
    for step in range(STEPS):
        x = torch.full((1024,), float(step), device="cuda") + rank
        want = 2 * (world * step + world * (world - 1) / 2)
        got = graphed(x)
        torch.cuda.synchronize()
        if not torch.all(got == want):
            failures.append(f"call {step}: {got[0].item()} != {want}")
    graphed.reset()
    return _ok(failures)


def check_serving_agreement(rank: int, world: int) -> dict:
    from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec

    failing_rank = world - 1

    def forward(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if rank == failing_rank and x.shape[0] == 8 and torch.cuda.is_current_stream_capturing():
            x.sum().item()  # a host sync: the capture of bucket 8 fails on this rank
        return x * scale + 1.0

    specs = [
        InputSpec("x", (64, 16), torch.float32),
        InputSpec("scale", (64, 1), torch.float32, pad_value=0),
    ]
    runner = GraphRunner(forward, specs, BucketConfig(), device="cuda", require_all_buckets=False)

    def dummy(bucket):
        return {
            "x": torch.zeros(bucket.rows, 16, device="cuda"),
            "scale": torch.ones(bucket.rows, 1, device="cuda"),
        }

    runner.capture(dummy)
    n = 3 + rank  # a different batch per rank; agreement pads all to the largest
    g = torch.Generator().manual_seed(rank)
    inputs = {
        "x": torch.randn(n, 16, generator=g).cuda(),
        "scale": torch.rand(n, 1, generator=g).cuda(),
    }
    out = runner.run(inputs)
    want = inputs["x"] * inputs["scale"] + 1.0
    failures = []
    if not torch.equal(out[:n], want):
        failures.append("runner output differs from eager")
    stats = runner.stats()
    dropped = sorted(stats["dropped"])
    replayed = sorted(b for b, k in stats["replays"].items() if k)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"dropped": dropped, "replayed": replayed})
    if any(g != gathered[0] for g in gathered):
        failures.append(f"ranks disagree: {gathered}")
    if world > 1 and dropped != ["bucket(bs=8)"]:
        failures.append(f"expected bucket 8 dropped everywhere, got {dropped}")
    runner.close()
    return _ok(failures, dropped=dropped, replayed=replayed)


def check_partial_fsdp2(rank: int, world: int) -> dict:
    from cudagraphs.partial import PartialCudaGraphManager
    from helpers.partial_fsdp import sharded_llama, step

    model, ref = sharded_llama("cuda"), sharded_llama("cuda")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
    gen = torch.Generator().manual_seed(10 + rank)
    failures = []
    mgr.start_recording()
    try:
        for i in range(5):
            ids = torch.randint(0, 128, (2, 16), generator=gen).cuda()
            if not torch.equal(step(model, ids), step(ref, ids)):
                failures.append(f"step {i}: loss")
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                if p.grad is not None and not torch.equal(
                    p.grad.full_tensor(), q.grad.full_tensor()
                ):
                    failures.append(f"step {i}: grad of {n}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            if i == 0:
                mgr.capture()
        stats = mgr.stats()
    finally:
        mgr.close()
    if stats["fallbacks"]:
        failures.append(f"fallbacks: {stats}")
    return _ok(failures, stats=stats)


def check_train_step_allreduce(rank: int, world: int) -> dict:
    import copy

    import cudagraphs
    from cudagraphs.models import BlockConfig, make_block_stack

    def stack_step(blocks):
        def step(x):
            for b in blocks:
                x = b(x)
            loss = x.float().pow(2).mean()
            loss.backward()
            return loss

        return step

    blocks = make_block_stack(2, BlockConfig(64, 4, 128), device="cuda", seed=3)
    ref = copy.deepcopy(blocks)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    cudagraphs.prepare_optimizer(ref_opt)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [torch.randn(2, 16, 64, generator=gen).cuda().bfloat16() for _ in range(STEPS)]
    # all_reduce=None (the default) turns the reduction on with more than one rank;
    # asked for explicitly, one rank captures the NCCL call too.
    step = cudagraphs.graph_train_step(
        stack_step(blocks),
        batches[0],
        optimizer=opt,
        max_grad_norm=0.5,
        all_reduce=None if world > 1 else True,
    )
    failures = []
    if not step.stats.all_reduce:
        failures.append("the step does not all-reduce with torch.distributed initialized")
    ref_step, ref_params = stack_step(ref), list(ref.parameters())
    for i, x in enumerate(batches):
        loss = step(x).clone()
        for p in ref_params:
            p.grad = None
        ref_loss = ref_step(x).detach()
        cudagraphs.all_reduce_gradients(ref_params)
        torch.nn.utils.clip_grad_norm_(ref_params, 0.5, foreach=True)
        ref_opt.step()
        if not torch.equal(loss, ref_loss):
            failures.append(f"step {i}: loss")
    for (n, p), q in zip(blocks.named_parameters(), ref_params):
        if not torch.equal(p, q):
            failures.append(f"parameter {n} differs from the eager loop")
        theirs = p.detach().clone()
        dist.broadcast(theirs, 0)
        if not torch.equal(p, theirs):
            failures.append(f"parameter {n} differs from rank 0's")
    step.reset()
    return _ok(failures, graphs=step.stats.graphs)


PIPE_BATCH, PIPE_HIDDEN, PIPE_MICROBATCHES, PIPE_LAYERS = 4, 64, 3, 2


def _pipe_layer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(PIPE_HIDDEN, PIPE_HIDDEN), torch.nn.Tanh()).cuda()


def _pipe_iteration(layer_of, rank: int, world: int, iteration: int) -> list[torch.Tensor]:
    """One pipeline iteration of this stage; returns the gradients it sent upstream
    (or, on stage 0, the gradients of its inputs)."""
    shape = (PIPE_BATCH, PIPE_HIDDEN)
    inputs, outputs = [], []
    for m in range(PIPE_MICROBATCHES):
        if rank == 0:
            g = torch.Generator().manual_seed(1000 * iteration + m)
            x = torch.randn(*shape, generator=g).cuda()
        else:
            x = torch.empty(*shape, device="cuda")
            dist.recv(x, rank - 1)
        x.requires_grad_()
        h = x
        for i in range(PIPE_LAYERS):
            h = layer_of(m, i)(h)
        inputs.append(x)
        outputs.append(h)
        if rank < world - 1:
            dist.send(h.detach().contiguous(), rank + 1)
    sent = []
    for m in range(PIPE_MICROBATCHES):
        if rank == world - 1:
            outputs[m].float().pow(2).mean().backward()
        else:
            grad = torch.empty(*shape, device="cuda")
            dist.recv(grad, rank + 1)
            outputs[m].backward(grad)
        sent.append(inputs[m].grad.detach().clone())
        if rank > 0:
            dist.send(inputs[m].grad.contiguous(), rank - 1)
    return sent


def check_pipeline_order(rank: int, world: int) -> dict:
    import copy

    from cudagraphs import make_graphed_callables

    layers = [_pipe_layer(100 * rank + i) for i in range(PIPE_LAYERS)]
    eager = copy.deepcopy(layers)
    order = [1] * PIPE_MICROBATCHES + [-1] * PIPE_MICROBATCHES  # one chunk per stage
    samples = tuple(
        (torch.randn(PIPE_BATCH, PIPE_HIDDEN, device="cuda", requires_grad=True),)
        for _ in range(PIPE_MICROBATCHES * PIPE_LAYERS)
    )
    graphed = make_graphed_callables(tuple(layers), samples, _order=order)

    def graphed_layer(m: int, i: int):
        return graphed[m * PIPE_LAYERS + i]  # chunk-major, then microbatch, then layer

    failures = []
    for iteration in range(2):  # parameter gradients accumulate over both
        got = _pipe_iteration(graphed_layer, rank, world, iteration)
        want = _pipe_iteration(lambda m, i: eager[i], rank, world, iteration)
        failures += [
            f"iteration {iteration}, microbatch {m}: gradient sent upstream"
            for m, (a, b) in enumerate(zip(got, want))
            if not torch.equal(a, b)
        ]
    for i, (layer, ref) in enumerate(zip(layers, eager)):
        for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
            if not torch.equal(p.grad, q.grad):
                failures.append(f"layer {i}.{name}: accumulated gradient")
    return _ok(failures, order=order)


CHECKS = {
    "allreduce_program": check_allreduce_program,
    "allreduce_core": check_allreduce_core,
    "serving_agreement": check_serving_agreement,
    "partial_fsdp2": check_partial_fsdp2,
    "pipeline_order": check_pipeline_order,
    "train_step_allreduce": check_train_step_allreduce,
}


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method="file://" + init_file,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
        device_id=torch.device("cuda", rank),
    )
    results = {}
    try:
        for name, check in CHECKS.items():
            try:
                results[name] = check(rank, world)
            except Exception as exc:
                results[name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--nprocs", type=int, default=None)
    p.add_argument("--commit", default="")
    args = p.parse_args(argv)
    available = torch.cuda.device_count()
    world = args.nprocs or available
    if world < 1 or world > available:
        print(f"multi_gpu: needs {world or 1} GPUs, {available} visible", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    init_file = tempfile.mktemp(prefix="cudagraphs-rdzv-")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, init_file, str(out))) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=len(CHECKS) * TIMEOUT_S + 60)
    hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    ranks = []
    for r in range(world):
        f = out / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    verdict = {name: all(rk is not None and rk[name]["ok"] for rk in ranks) for name in CHECKS}
    report = {
        "world_size": world,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "commit": args.commit,
        "hung_ranks": hung,
        "exit_codes": [proc.exitcode for proc in procs],
        "checks": verdict,
        "ranks": ranks,
    }
    (out / f"multi_gpu-{world}gpu.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"world_size": world, "checks": verdict, "hung_ranks": hung}))
    return 0 if all(verdict.values()) and not hung else 1


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    sys.exit(main())
