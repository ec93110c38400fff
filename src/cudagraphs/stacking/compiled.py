"""A module compiled with its projection groups stacked: :func:`compile_stacked`.

Why a wrapper around ``torch.compile``: the compiled code reads each group's weights
as one span of memory (:mod:`.gemms`), which holds only while every grouped
``Parameter`` stays where :func:`~.weights.stack_projections` put it. dynamo guards a
parameter's shape, stride, dtype and device, not where it lies, so a weight moved
since (``module.to()``, ``param.data = ...``) would be read from memory it no longer
owns. The wrapper checks that before every call it makes in Python: a few data
pointers, and nothing at all when the call is replayed by a CUDA graph.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import CudaGraphsStateError, CudaGraphsTypeError, CudaGraphsValueError
from .gemms import can_add_pass, with_stacked_projections
from .weights import StackedGroups, stack_projections

__all__ = ["StackedCompiled", "compile_stacked"]

logger = logging.getLogger(__name__)


class StackedCompiled:
    """``module`` compiled by :func:`compile_stacked`; call it as the module. Other
    attributes are the module's (``.parameters()``, ``.train()``, ``.config``).

    Attributes:
        module: the module (its grouped weights re-pointed at their rows).
        groups: the projection groups laid back to back.
        compiled: what ``torch.compile`` returned.
        compile_options: the keywords it was given, the pass in their inductor options.
    """

    def __init__(
        self,
        module: nn.Module,
        groups: StackedGroups,
        compiled: Any,
        compile_options: Mapping[str, Any],
    ) -> None:
        self.module = module
        self.groups = groups
        self.compiled = compiled
        self.compile_options = dict(compile_options)
        self._unstacked: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        moved = self._unstacked or self.groups.moved()
        if moved:
            raise CudaGraphsStateError(
                f"compile_stacked: {', '.join(moved[:4])}{' ...' if len(moved) > 4 else ''} "
                f"({len(moved)} in all) no longer lie where their projection group was "
                "laid, and the compiled code reads each group as one span. Fix: keep the "
                "weights in place (move the module to its device and dtype before "
                "compile_stacked; load weights with load_state_dict, which copies in "
                "place), or call compile_stacked on the module again"
            )
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Everything else is the module's (``.parameters()``, ``.train()``, ``.config``),
        # as for the wrapper ``torch.compile`` returns. Only reached for names the
        # wrapper lacks; before ``module`` is set (a copy being made), Python's own
        # lookup answers, without recursing.
        module = self.__dict__.get("module")
        if module is None:
            return object.__getattribute__(self, name)
        return getattr(module, name)

    def unstack(self) -> None:
        """Give every grouped weight memory of its own again; the compiled code is not
        called after (its calls are refused)."""
        self._unstacked = [f"{n}.weight" for group in self.groups.names for n in group]
        self.groups.unstack()

    def __repr__(self) -> str:
        return (
            f"StackedCompiled({type(self.module).__name__}, "
            f"{len(self.groups.names)} projection groups)"
        )


def compile_stacked(module: nn.Module, **compile_options: Any) -> StackedCompiled:
    """``torch.compile(module, **compile_options)`` with each projection group made one
    GEMM, forward and backward: sibling ``nn.Linear`` weights (q/k/v, gate/up) are laid
    back to back now (:func:`~.weights.stack_projections`, in place: the same
    ``Parameter`` objects, so optimizers built before or after keep working), and an
    inductor post-grad pass merges their GEMMs (:mod:`.gemms`).

    Call it once the module is on its device and in its dtype. Use the result where
    the compiled module would be called: inside ``graph_train_step``'s ``step_fn`` or a
    plain loop. It is no ``nn.Module`` (its ``state_dict`` and hooks are the module's,
    unprefixed), so ``graph_stack``, which takes modules, refuses it with the fix.

    Raises:
        CudaGraphsTypeError: ``module`` not an ``nn.Module``.
        CudaGraphsValueError: ``compile_options`` that do not compile through inductor
            (its default backend) or bring a ``post_grad_custom_pre_pass`` of their own.
    """
    if not isinstance(module, nn.Module):
        raise CudaGraphsTypeError(
            f"compile_stacked takes an nn.Module, got {type(module).__name__}: pass the "
            "model (or layer) itself, not a compiled wrapper or a function"
        )
    if not can_add_pass(compile_options):
        raise CudaGraphsValueError(
            "compile_stacked needs compile options that compile through inductor "
            "(torch.compile's default backend) without a post_grad_custom_pre_pass of "
            f"their own, got {compile_options!r}: its inductor pass makes each "
            "projection group one GEMM. Fix: drop the backend (or the pass), or use "
            "torch.compile itself"
        )
    groups = stack_projections(module)
    options = with_stacked_projections(compile_options)
    if not groups.groups:
        logger.info("compile_stacked: %s has no projection group", type(module).__name__)
    return StackedCompiled(module, groups, torch.compile(module, **options), options)
