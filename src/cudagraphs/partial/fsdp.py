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

:func:`check_target_parameters` says which parameters a target's graph takes and
refuses those it cannot use: meta-device parameters, and DTensors that FSDP2 does not
manage (tensor parallelism).
"""

from __future__ import annotations

from torch import nn

from ..errors import CudaGraphsValueError, TargetSelectionError
from .vocabulary import Target

__all__ = ["check_target_parameters", "fsdp_managed_modules"]


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


def check_target_parameters(target: Target, fsdp: bool) -> list[tuple[str, nn.Parameter]]:
    """The ``(name, parameter)`` pairs of ``target`` that require grad: the graph's
    parameter inputs. ``fsdp``: whether FSDP2 manages the target.

    Raises:
        CudaGraphsValueError: a parameter is on the meta device (naming it).
        TargetSelectionError: a DTensor parameter outside FSDP2 (naming it).
    """
    params = [(n, p) for n, p in target.module.named_parameters() if p.requires_grad]
    for name, p in target.module.named_parameters():
        if p.is_meta:
            raise CudaGraphsValueError(
                f"{target.name}.{name} is on the meta device (not materialized), so a "
                "graph would have no storage to read. Fix: materialize the model "
                "(to_empty(device=...), then initialize or load weights) before "
                "from_model_parts."
            )
        if not fsdp and (type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor"):
            raise TargetSelectionError(
                f"{target.name}.{name} is a DTensor outside FSDP2 (tensor parallelism?); "
                "only FSDP2-sharded parameters (fully_shard) are supported. Fixes: "
                "1. leave this module out of the targets (scopes= without its scope, or "
                "an include= that does not name it); 2. shard it with fully_shard."
            )
    return params
