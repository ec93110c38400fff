"""What ``include`` and ``model_parts`` accept, normalized once: ``include`` to a
predicate ``(name, module) -> bool``, ``model_parts`` to a list of modules. Each wrong
type is a :class:`~cudagraphs.errors.CudaGraphsTypeError` that names the argument.

What this module does NOT do: it does not choose targets (:mod:`.discovery` does).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from ..errors import CudaGraphsTypeError

__all__ = ["Predicate", "Selector", "as_model_parts", "include_predicate"]

#: What ``include`` accepts: one glob pattern, a list or tuple of them, or a predicate.
Selector = str | Sequence[str] | Callable[[str, nn.Module], bool]
Predicate = Callable[[str, nn.Module], bool]


def include_predicate(include: Selector | None) -> Predicate | None:
    """``include`` as a predicate ``(name, module) -> bool`` (``None`` stays ``None``).

    A plain string is one glob pattern (``"model.layers.*.mlp"``), not a sequence of
    one-character patterns; a list or tuple holds patterns; a callable is used as it
    is. Patterns match qualified names with :func:`fnmatch.fnmatchcase`.

    Raises:
        CudaGraphsTypeError: ``include`` is none of these, or a list / tuple holds
            something other than a string (naming ``include[i]``).
    """
    if include is None:
        return None
    if isinstance(include, str):
        patterns: tuple[str, ...] = (include,)
    elif isinstance(include, (list, tuple)):
        for i, pattern in enumerate(include):
            if not isinstance(pattern, str):
                raise CudaGraphsTypeError(
                    f"include[{i}] must be a glob pattern (str), got "
                    f"{type(pattern).__name__} {pattern!r}"
                )
        patterns = tuple(include)
    elif callable(include):
        return include
    else:
        raise CudaGraphsTypeError(
            "include must be a glob pattern (str), a list or tuple of patterns, or a "
            f"predicate (name, module) -> bool; got {type(include).__name__} {include!r}"
        )

    def matches(name: str, module: nn.Module) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    return matches


def as_model_parts(model_parts: Any) -> list[nn.Module]:
    """``model_parts`` as a list of modules: one ``nn.Module`` (a ``ModuleList``
    included: it is one module) or an iterable of them.

    Raises:
        CudaGraphsTypeError: neither, naming ``model_parts`` or ``model_parts[i]``.
    """
    if isinstance(model_parts, nn.Module):
        return [model_parts]
    if isinstance(model_parts, (str, bytes)) or not isinstance(model_parts, Iterable):
        raise CudaGraphsTypeError(
            "model_parts must be an nn.Module or a sequence of them (pipeline stages), "
            f"got {type(model_parts).__name__}"
        )
    parts = list(model_parts)
    for i, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise CudaGraphsTypeError(
                f"model_parts[{i}] must be an nn.Module, got {type(part).__name__} {part!r}"
            )
    return parts
