"""FSDP2 (``torch.distributed.fsdp.fully_shard``) around partial-graph targets.

Outside forward and backward, an FSDP2 module's parameters are sharded DTensors.
Inside, after FSDP's pre-forward hook, they are plain unsharded ``nn.Parameter`` s:
the same objects every step, but with storage that FSDP frees at reshard and
allocates again at the next unshard (a new address each time; measured with gloo on
the CPU, torch 2.13). A graph therefore cannot read them in place. For targets under
FSDP2 the manager passes the unsharded parameters as ordinary graph inputs instead:
copied into the graph's static buffers at each call (one fused copy), with their
gradients returned to autograd, which accumulates them into the unsharded
parameters' ``.grad`` for FSDP's reduce-scatter. The static buffers hold one
unsharded copy of each target's parameters: for the attention modules of a large
model that is memory FSDP would otherwise not keep.
"""

from __future__ import annotations

from torch import nn

__all__ = ["fsdp_managed_modules"]


def fsdp_managed_modules(part: nn.Module) -> set[int]:
    """Ids of the modules of ``part`` whose parameters FSDP2 shards (every module
    inside a ``fully_shard`` ed one); empty when FSDP2 is unavailable or unused."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return set()
    return {
        id(inner)
        for module in part.modules()
        if isinstance(module, FSDPModule)
        for inner in module.modules()
    }
