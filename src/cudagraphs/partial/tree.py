"""A model's module tree the way target selection must see it: activation-checkpoint
wrappers unwrapped (the wrapped module reported under the wrapper's name), a module
registered twice seen twice, qualified names joined and compared, and the parameters
a module's forward takes.

What this module does NOT do: it decides nothing about what a module is
(:mod:`.discovery`, :mod:`.scopes` and :mod:`.metadata` do).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from torch import nn

__all__ = [
    "children",
    "forward_parameters",
    "join_name",
    "named_modules",
    "names_overlap",
    "unwrap_checkpoint",
]


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
    # The module's own child table (nn.Module._modules, a torch private), not
    # named_children(): that one keeps a memo of the children seen and yields a module
    # registered twice (a tied layer) once, which is exactly what target selection
    # must see and reject. No public torch API yields every child slot.
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


def names_overlap(a: str, b: str) -> bool:
    """Whether qualified names ``a`` and ``b`` are the same module or one lies in the
    other (dot-separated: ``layers.1`` does not hold ``layers.10``)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def forward_parameters(module: nn.Module) -> list[inspect.Parameter]:
    """The parameters of ``module.forward`` (empty when it has no signature)."""
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


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
