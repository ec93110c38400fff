"""Partial graphs for training: graph the fixed-shape pieces of each transformer block
(attention, the MoE router) inside an eager training loop.

The manager records one eager iteration, captures through the core
``make_graphed_callables`` and replays calls that match the recorded contract, with
counted eager fallback. Parameters are explicit graph inputs: read in place, or under
FSDP2 copied in at each call (:mod:`.fsdp`).
"""

from .contract import CallContract, ContractSet, FallbackCounter
from .discovery import (
    DiscoveredBlock,
    Target,
    TargetSelectionError,
    discover_blocks,
    find_attention,
    find_moe,
    model_label,
    select_targets,
    unwrap_checkpoint,
)
from .manager import CaptureBackend, PartialCudaGraphManager, PartialGraphEntry

__all__ = [
    "CaptureBackend",
    "PartialCudaGraphManager",
    "PartialGraphEntry",
    "CallContract",
    "ContractSet",
    "DiscoveredBlock",
    "FallbackCounter",
    "Target",
    "TargetSelectionError",
    "discover_blocks",
    "find_attention",
    "find_moe",
    "model_label",
    "select_targets",
    "unwrap_checkpoint",
]
