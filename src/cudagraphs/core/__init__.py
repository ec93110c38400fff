"""The core graph helper: ``make_graphed_callables`` and its building blocks.

canonicalize -> schedule -> warmup -> capture -> autograd wrapper, one module each.
"""

from .api import make_graphed_callables
from .hooks import HOOK_GROUPS, CaptureTimeHooks, canonicalize_capture_time_hooks
from .runtime import GraphedCallable
from .schedule import Entry, Layout, Step, assign_buffer_slots, build_layout, build_schedule

__all__ = [
    "HOOK_GROUPS",
    "CaptureTimeHooks",
    "Entry",
    "GraphedCallable",
    "Layout",
    "Step",
    "assign_buffer_slots",
    "build_layout",
    "build_schedule",
    "canonicalize_capture_time_hooks",
    "make_graphed_callables",
]
