"""Partial graphs for training (issue in progress): graph the fixed-shape pieces of
each transformer block (attention, the MoE router) inside an eager training loop.

The manager records, captures and replays with counted eager fallback; its capture
path (the core ``make_graphed_callables``) has not yet run on a GPU in this form.
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
