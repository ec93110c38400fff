"""Partial graphs for training (issue in progress): graph the fixed-shape pieces of
each transformer block (attention, the MoE router) inside an eager training loop.

Available now: structural target discovery and the per-call replay contract. The
manager that records, captures and replays builds on them.
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

__all__ = [
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
