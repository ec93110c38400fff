"""One GEMM per projection group: the weights laid back to back (:mod:`.weights`) and
an inductor pass that reads them so, forward and backward (:mod:`.gemms`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CudaGraphsTypeError, CudaGraphsValueError
from .compiled import StackedCompiled, compile_stacked
from .gemms import can_add_pass, stack_graph, stacked_projections_pass, with_stacked_projections
from .weights import (
    ProjectionGroup,
    StackedGroups,
    forwards_set,
    plan_projections,
    stack_projections,
)

__all__ = [
    "ProjectionGroup",
    "StackedCompiled",
    "StackedGroups",
    "check_stack_projections",
    "compile_stacked",
    "forwards_set",
    "plan_projections",
    "stack_graph",
    "stack_projections",
    "stacked_projections_pass",
    "with_stacked_projections",
]


def check_stack_projections(value: Any, compile_options: Mapping[str, Any] | None) -> bool:
    """Whether a generator stacks its projections: ``None`` (the default) when it
    compiles through inductor with no post-grad pass of the caller's own; ``True``
    requires that; ``False`` never.

    Raises:
        CudaGraphsTypeError: ``value`` not a bool or ``None``.
        CudaGraphsValueError: ``True`` without ``compile_options`` that compile through
            inductor and leave its ``post_grad_custom_pre_pass`` free.
    """
    if value is not None and not isinstance(value, bool):
        raise CudaGraphsTypeError(
            f"stack_projections must be True, False or None, got {type(value).__name__}: "
            "pass None (the default: on when compiling through inductor) or False"
        )
    possible = compile_options is not None and can_add_pass(compile_options)
    if value is True and not possible:
        raise CudaGraphsValueError(
            "stack_projections=True needs compile_options that compile through inductor "
            "(its default backend) without a post_grad_custom_pre_pass of their own, got "
            f"compile_options={None if compile_options is None else dict(compile_options)!r}"
            ": an inductor pass makes each group one GEMM. Fix: pass such compile_options "
            "(e.g. {'fullgraph': True}) or leave stack_projections at None"
        )
    return possible and value is not False
