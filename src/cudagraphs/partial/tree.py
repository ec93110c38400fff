"""Walking a model's module tree the way target selection must see it: activation-
checkpoint wrappers unwrapped (the wrapped module reported under the wrapper's name),
and a module registered twice seen twice.

What this module does NOT do: it decides nothing about what a module is
(:mod:`.discovery` and :mod:`.metadata` do).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["children", "join_name", "named_modules", "unwrap_checkpoint"]


def unwrap_checkpoint(module: nn.Module) -> nn.Module:
    """The module beneath any nesting of activation-checkpoint wrappers."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def children(module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``(name, child)`` for each child slot of ``module`` that holds a module, a
    checkpoint-wrapped child unwrapped and reported under the wrapper's name."""
    # _modules, not named_children(): the latter skips a module registered twice (a
    # tied layer), which is exactly what target selection must see and reject.
    for name, child in module._modules.items():
        if child is None:
            continue
        if hasattr(child, "_checkpoint_wrapped_module"):
            # The wrapper's own child name is an implementation detail; report the
            # wrapped module under the wrapper's name.
            yield name, unwrap_checkpoint(child)
        else:
            yield name, child


def join_name(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` alone under an empty prefix."""
    return f"{prefix}.{name}" if prefix else name


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module beneath ``model`` (not ``model`` itself) with its qualified name,
    in module order (depth first, children in registration order)."""
    out, stack = [], [("", model)]
    while stack:
        name, module = stack.pop()
        if name:
            out.append((name, module))
        for child_name, child in reversed(list(children(module))):
            stack.append((join_name(name, child_name), child))
    return out
