"""What the arguments of target selection accept, normalized once: ``include`` to a
predicate ``(name, module) -> bool``, ``model_parts`` to a list of modules, and the
retired switches (``attention=``, ``router=``, ``pipeline_parallel``) refused with the
argument to use instead. Each wrong type is a
:class:`~cudagraphs.errors.CudaGraphsTypeError` that names the argument.

What this module does NOT do: it does not choose targets (:mod:`.planning` does).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from ..errors import CudaGraphsTypeError
from .vocabulary import SCOPES

__all__ = [
    "RETIRED",
    "Predicate",
    "Selector",
    "as_model_parts",
    "include_predicate",
    "refuse_retired",
]

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


class _Retired:
    """The default of a retired argument: any other value means the caller passed it."""

    def __repr__(self) -> str:
        return "<retired>"


#: The default of every retired argument (see :func:`refuse_retired`).
RETIRED: Any = _Retired()


def refuse_retired(where: str, **given: Any) -> None:
    """Refuse the retired arguments passed to ``where`` (those not left at
    :data:`RETIRED`), all at once, each with what to pass instead.

    ``attention=`` / ``router=`` picked the attention modules and the MoE routers;
    ``scopes=`` names every scope instead. ``pipeline_parallel`` was never read: each
    model part is graphed on its own.

    Raises:
        CudaGraphsTypeError: any of them was passed.
    """
    passed = {name: value for name, value in given.items() if value is not RETIRED}
    if not passed:
        return
    why, fixes = [], []
    if "attention" in passed or "router" in passed:
        why.append("attention= and router= are retired: scopes= says what is graphed")
        fixes += _switch_fixes(
            bool(passed.get("attention", True)), bool(passed.get("router", True))
        )
    if "pipeline_parallel" in passed:
        why.append("pipeline_parallel is retired: each model part is graphed on its own")
        fixes.append("drop pipeline_parallel")
    named = " and ".join(f"{name}={value!r}" for name, value in passed.items())
    if len(fixes) == 1:
        listed = f"Fix: {fixes[0]}."
    else:
        listed = "Fixes: " + "; ".join(f"{i}. {fix}" for i, fix in enumerate(fixes, 1)) + "."
    raise CudaGraphsTypeError(f"{where} got {named}; {'; '.join(why)}. {listed}")


def _switch_fixes(attention: bool, router: bool) -> list[str]:
    # What the two switches graphed, as scopes; and the widest scopes without what a
    # switch turned off ("layer" holds attention and router, "moe" the router).
    if attention and router:
        return [
            "drop them: scopes=None graphs each layer as widely as is graph-safe",
            "scopes=('attention', 'moe_router') graphs the attention and router alone",
        ]
    same = tuple(s for s, on in (("attention", attention), ("moe_router", router)) if on)
    off = (
        {"layer"}
        | (set() if attention else {"attention"})
        | (set() if router else {"moe_router", "moe"})
    )
    wide = tuple(s for s in SCOPES if s not in off)
    return [
        f"scopes={same!r} graphs what the switches chose"
        + ("" if same else ", with include= naming the modules to graph"),
        f"scopes={wide!r} graphs every scope without what they turned off",
    ]
