"""The core graph helper: ``make_graphed_callables`` and its building blocks.

canonicalize -> schedule -> warmup -> capture -> autograd wrapper, one module each.
"""

from .api import make_graphed_callables
from .grad_targets import GradTargets, prepare_grad_targets
from .graphed import GraphedCallable
from .hooks import HOOK_GROUPS, CaptureTimeHooks, canonicalize_capture_time_hooks
from .schedule import Entry, Layout, Step, assign_buffer_slots, build_layout, build_schedule
from .stack import GraphedStack, graph_stack

__all__ = [
    "HOOK_GROUPS",
    "CaptureTimeHooks",
    "Entry",
    "GradTargets",
    "GraphedCallable",
    "GraphedStack",
    "Layout",
    "Step",
    "assign_buffer_slots",
    "build_layout",
    "build_schedule",
    "canonicalize_capture_time_hooks",
    "graph_stack",
    "make_graphed_callables",
    "prepare_grad_targets",
]
