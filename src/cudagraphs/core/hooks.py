"""capture_time_hooks: canonicalized once, then run by name.

These are graph-construction hooks, not ``nn.Module`` hooks: each is ``fn(module) ->
None``, runs outside any capture context around a callable's warmup and capture
passes, and never runs on replay. Typical use: unshard FSDP parameters before a
forward is captured and reshard them after, or update CPU-side state.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CaptureTimeHookError, CudaGraphsTypeError, CudaGraphsValueError

__all__ = ["HOOK_GROUPS", "CaptureTimeHooks", "canonicalize_capture_time_hooks"]

#: The accepted keys of one callable's ``capture_time_hooks`` entry, in run order.
HOOK_GROUPS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")

HookFn = Callable[[Any], None]


@dataclass(frozen=True)
class CaptureTimeHooks:
    """The hooks of one callable, each group an ordered tuple of ``(hook_id, fn)``."""

    forward_pre_hooks: tuple[tuple[Hashable, HookFn], ...] = ()
    forward_hooks: tuple[tuple[Hashable, HookFn], ...] = ()
    backward_pre_hooks: tuple[tuple[Hashable, HookFn], ...] = ()
    backward_hooks: tuple[tuple[Hashable, HookFn], ...] = ()
    callable_index: int = field(default=0, compare=False)

    def run(self, group: str, module: Any) -> None:
        """Run every hook of ``group`` (a name from :data:`HOOK_GROUPS`) on ``module``.

        Raises:
            CaptureTimeHookError: a hook returned something other than ``None``
                (hooks cannot replace inputs, outputs or gradients).
        """
        for hook_id, fn in getattr(self, group):
            result = fn(module)
            if result is not None:
                raise CaptureTimeHookError(
                    f"capture_time_hooks[{self.callable_index}][{group!r}][{hook_id!r}] "
                    f"returned {type(result).__name__}; capture-time hooks must return None "
                    "(they cannot replace inputs, outputs or gradients)"
                )


def _canonical_group(entry_index: int, group: str, hooks: Any) -> tuple:
    if hooks is None:
        return ()
    if not isinstance(hooks, Mapping):
        raise CudaGraphsTypeError(
            f"capture_time_hooks[{entry_index}][{group!r}] must be a dict "
            f"{{hook_id: fn(module)}}, got {type(hooks).__name__}"
        )
    for hook_id, fn in hooks.items():
        if not callable(fn):
            raise CudaGraphsTypeError(
                f"capture_time_hooks[{entry_index}][{group!r}][{hook_id!r}] is not callable "
                f"(got {type(fn).__name__}); each hook is fn(module) -> None"
            )
    return tuple(hooks.items())


def canonicalize_capture_time_hooks(
    capture_time_hooks: Sequence[Mapping[str, Mapping[Hashable, HookFn]] | None] | None,
    num_callables: int,
) -> list[CaptureTimeHooks]:
    """Validate ``capture_time_hooks`` and give every callable a full set of groups.

    Args:
        capture_time_hooks: ``None``, or one entry per callable: ``None`` or a dict with
            any of :data:`HOOK_GROUPS`, each ``{hook_id: fn(module) -> None}``.
        num_callables: how many callables were passed to ``make_graphed_callables``.

    Returns:
        One :class:`CaptureTimeHooks` per callable (empty groups where none were given).

    Raises:
        ValueError: wrong number of entries, or an unknown group name.
        TypeError: an entry, a group or a hook of the wrong type.
    """
    if capture_time_hooks is None:
        return [CaptureTimeHooks(callable_index=i) for i in range(num_callables)]
    if isinstance(capture_time_hooks, (Mapping, str)) or not isinstance(
        capture_time_hooks, Sequence
    ):
        raise CudaGraphsTypeError(
            "capture_time_hooks must be a list with one entry (None or a dict) per callable, "
            f"got {type(capture_time_hooks).__name__}"
        )
    if len(capture_time_hooks) != num_callables:
        raise CudaGraphsValueError(
            f"capture_time_hooks has {len(capture_time_hooks)} entries but there are "
            f"{num_callables} callables; pass one entry (None or a dict) per callable"
        )
    result = []
    for i, entry in enumerate(capture_time_hooks):
        if entry is None:
            entry = {}
        if not isinstance(entry, Mapping):
            raise CudaGraphsTypeError(
                f"capture_time_hooks[{i}] must be None or a dict, got {type(entry).__name__}"
            )
        unknown = sorted(str(k) for k in entry if k not in HOOK_GROUPS)
        if unknown:
            raise CudaGraphsValueError(
                f"capture_time_hooks[{i}] has unknown key(s) {unknown}; "
                f"allowed keys are {list(HOOK_GROUPS)}"
            )
        groups = {g: _canonical_group(i, g, entry.get(g)) for g in HOOK_GROUPS}
        result.append(CaptureTimeHooks(**groups, callable_index=i))
    return result
