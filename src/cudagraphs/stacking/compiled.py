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

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..errors import CudaGraphsStateError, CudaGraphsTypeError, CudaGraphsValueError
from ..torch_private import storage_key
from .gemms import can_add_pass, with_stacked_projections
from .weights import StackedGroups, plan_projections, stack_projections

__all__ = ["StackedCompiled", "compile_stacked"]

logger = logging.getLogger(__name__)


class StackedCompiled:
    """``module`` compiled by :func:`compile_stacked`; call it as the module. Other
    attributes are the module's (``.parameters()``, ``.train()``, ``.config``).

    Attributes:
        module: the module (its grouped weights re-pointed at their rows).
        groups: the projection groups laid back to back.
        compiled: what ``torch.compile`` returned.
        compile_options: the keywords ``torch.compile`` was given, the pass in their
            inductor options.
        requested: the keywords :func:`compile_stacked` was given.
    """

    def __init__(
        self,
        module: nn.Module,
        groups: StackedGroups,
        compiled: Any,
        compile_options: Mapping[str, Any],
        requested: Mapping[str, Any],
    ) -> None:
        self.module = module
        self.groups = groups
        self.compiled = compiled
        self.compile_options = dict(compile_options)
        self.requested = dict(requested)
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
        shared = _arguments_sharing_rows(args, kwargs)
        if shared:
            raise CudaGraphsValueError(
                f"compile_stacked: arguments {shared[0]} and {shared[1]} share one "
                "storage, one of them 1-D or 2-D: the compiled code would read them as "
                "a projection group's adjacent rows, and keep reading them so in calls "
                "where they are not (dynamo does not guard where its inputs lie). Fix: "
                "pass tensors of memory of their own (.clone()), or hold such weights as "
                "the module's parameters"
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
        called after (its calls are refused, however often this is called)."""
        if not self._unstacked:
            self._unstacked = [f"{n}.weight" for group in self.groups.names for n in group]
        self.groups.unstack()

    def __deepcopy__(self, memo: dict[int, Any]) -> StackedCompiled:
        # A copy of the module gives every weight memory of its own, which the compiled
        # code would not read as one span: the copy is stacked and compiled anew.
        module = copy.deepcopy(self.module, memo)
        return compile_stacked(module, **self.requested)

    def __repr__(self) -> str:
        return (
            f"StackedCompiled({type(self.module).__name__}, "
            f"{len(self.groups.names)} projection groups)"
        )


def _arguments_sharing_rows(args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """Two floating-point tensor arguments on one storage, one of them 1-D or 2-D and
    the other starting it (what the pass reads as a group's rows and their base), by
    their place in the call; None if there are none. Costs a pass over the
    arguments' leaves, and nothing when a graph replays the call."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for prefix, tree in (("args", args), ("kwargs", kwargs)):
        for path, leaf in tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
                key = storage_key(leaf)
                by_storage.setdefault(key, []).append((prefix + keystr(path), leaf))
    for tensors in by_storage.values():
        distinct = {id(t): (name, t) for name, t in tensors}
        if len(distinct) < 2:
            continue
        rows = [(n, t) for n, t in distinct.values() if t.dim() in (1, 2)]
        bases = [(n, t) for n, t in distinct.values() if t.storage_offset() == 0]
        for name, tensor in rows:
            for base_name, base in bases:
                if base is not tensor:
                    return base_name, name
    return None


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
    # Which groups will form is known before anything moves: the options are checked
    # (torch.compile reads them at once, and traces only at the first call) while the
    # module is still as it was.
    layout = tuple(plan_projections(module))
    try:
        options = with_stacked_projections(compile_options, layout)
        compiled = torch.compile(module, **options)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CudaGraphsValueError(
            f"compile_stacked: torch.compile refused compile_options={compile_options!r}: "
            f"{exc}. Fix: pass torch.compile's own keywords (mode, dynamic, fullgraph, "
            "options with inductor's settings); the module was not changed"
        ) from exc
    groups = stack_projections(module)
    if not groups.groups:
        logger.info("compile_stacked: %s has no projection group", type(module).__name__)
    return StackedCompiled(module, groups, compiled, options, compile_options)
