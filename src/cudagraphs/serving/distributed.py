"""Rank agreement for bucketed runners.

A graph that holds a collective must be replayed by every rank or by none: if one
rank replays while another runs the step eagerly, their collectives interleave
differently and the job hangs. So ranks agree on which buckets were captured (MIN over
one flag per bucket, in config order, after every rank walked every bucket) and, when
a step's batch differs across ranks, on the padded batch size (MAX).

Without an initialized process group every function returns the local answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["agree_on_batch_size", "agree_on_captured", "is_distributed"]


def is_distributed(group: object | None = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _device_for(group: object | None) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo takes CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_captured(local_ok: Sequence[bool], group: object | None = None) -> list[bool]:
    """Per bucket (in config order, the same on every rank), whether every rank
    captured it. A bucket any rank dropped is dropped everywhere.

    Every rank must call this once per startup with the same number of buckets, after
    walking every bucket (also after a local failure), or the collective hangs.
    """
    flags = [bool(x) for x in local_ok]
    if not is_distributed(group):
        return flags
    t = torch.tensor(flags, dtype=torch.int32, device=_device_for(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(x) for x in t.tolist()]


def agree_on_batch_size(local_batch_size: int, group: object | None = None) -> int:
    """The largest batch size of this step across ranks; every rank pads to it so all
    pick the same bucket (or all run eagerly)."""
    if not is_distributed(group):
        return int(local_batch_size)
    t = torch.tensor([int(local_batch_size)], dtype=torch.int64, device=_device_for(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
