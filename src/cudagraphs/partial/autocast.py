"""The autocast state a call runs under: recorded with each contract, compared on every
call, and written out in mismatch reports.

Separate from :mod:`.contract` because recording (:mod:`.recording`) enters the same
state at capture, and it needs only this, not the contract.
"""

from __future__ import annotations

import torch

__all__ = ["AutocastState", "autocast_state"]

#: Device types whose autocast state a call is recorded under.
_AUTOCAST_DEVICES = ("cuda", "cpu")
AutocastState = tuple[tuple[str, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """The autocast regions in effect now: ``(device type, dtype)`` for each enabled
    one, empty when none. A graph bakes in the kernels autocast picked at capture (a
    bf16 matmul, say), so a call under another state must not replay it: Trainer and
    accelerate train in mixed precision by wrapping the model's forward in autocast,
    while ``capture()`` runs outside that forward and must enter the same state."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


def _autocast_text(state: AutocastState) -> str:
    if not state:
        return "off"
    return ", ".join(f"{device}: {str(dtype).removeprefix('torch.')}" for device, dtype in state)
