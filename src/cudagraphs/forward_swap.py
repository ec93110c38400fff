"""Put another callable in place of a module's ``forward`` and take it back.

The core (a module passed to ``make_graphed_callables``) and the partial graphs (each
target) both replace ``forward`` on the instance, so that ``module(...)`` still runs
the module's hooks and then the replacement. Taking it back must leave the instance
exactly as it was: a forward the instance held of its own (a wrapper someone set, a
``functools.partial``) is put back; otherwise the instance attribute is removed, so
the class's forward shows through again (and later changes to the class apply).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ForwardSwap", "swap_forward"]


@dataclass
class ForwardSwap:
    """One replaced ``forward``: the original (what an eager run calls) and whether
    the instance held a forward of its own."""

    module: nn.Module
    original: Callable[..., Any]
    had_instance_forward: bool
    restored: bool = False

    def restore(self) -> None:
        """Put the original forward back (idempotent)."""
        if self.restored:
            return
        if self.had_instance_forward:
            self.module.forward = self.original
        else:
            self.module.__dict__.pop("forward", None)
        self.restored = True


def swap_forward(module: nn.Module, replacement: Callable[..., Any]) -> ForwardSwap:
    """Make ``replacement`` the instance's ``forward``; the returned record restores it."""
    swap = ForwardSwap(module, module.forward, "forward" in module.__dict__)
    module.forward = replacement
    return swap
