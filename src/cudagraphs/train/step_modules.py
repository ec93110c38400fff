"""The modules a train step function can be seen to run, for the checks
``graph_train_step`` makes before capture (:func:`check_step_experts`).

``graph_train_step`` gets a function, not a model. The models it trains are found
where Python keeps what a function refers to: its closure cells, defaults and the
globals it names, a bound method's object, a ``functools.partial``'s function and
arguments, a callable object's attributes; one level further into plain containers
and objects (``trainer.model``), and into the functions found there. Only modules
holding a parameter of the optimizer count: the step trains those, so it runs them.

What this module does NOT do: run ``step_fn`` or hook anything (a global module hook
would change what a ``torch.compile``'d step guards on), or find a model the function
reaches only through a call (``get_model()``): such a model is not checked, and a
capture that fails on it says so through the capture error.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import torch
from torch import nn

from ..moe_kernels import check_grouped_mm_experts

__all__ = ["check_step_experts", "step_modules"]

_DEPTH = 3  # references followed from step_fn: closure -> object -> attribute
_LIMIT = 10_000  # values looked at in all: the walk stays cheap on any program
_ITEMS = 64  # entries read per container (a model sits near the top, not in a dataset)


def step_modules(
    step_fn: Callable[..., Any], params: Iterable[torch.Tensor]
) -> list[tuple[str, nn.Module]]:
    """The outermost modules ``step_fn`` refers to (see the module docs) that hold one
    of ``params``, each named by how ``step_fn`` reaches it (``"model"``,
    ``"self.model"``, ``"trainer.model"``). Borrows everything; modifies nothing."""
    wanted = {id(p) for p in params}
    found: dict[int, tuple[str, nn.Module]] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [("step_fn", step_fn, 0)]
    while stack and len(seen) < _LIMIT:
        name, value, depth = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, nn.Module):
            if any(id(p) in wanted for p in value.parameters()):
                found.setdefault(id(value), (name, value))
            continue
        if depth < _DEPTH:
            stack.extend((n, v, depth + 1) for n, v in _references(name, value))
    return _outermost(list(found.values()))


def check_step_experts(step_fn: Callable[..., Any], params: Iterable[torch.Tensor]) -> None:
    """Refuse, before capture, a step that runs MoE experts whose grouped GEMM would
    sync the host (:func:`~cudagraphs.moe_kernels.check_grouped_mm_experts` over
    :func:`step_modules`).

    Raises:
        UnsupportedModelError: naming the experts, the cause and the fixes.
    """
    check_grouped_mm_experts(step_modules(step_fn, params), "graph_train_step")


def _references(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """What ``value`` refers to, each with a name saying how it was reached."""
    if isinstance(value, functools.partial):
        yield name, value.func
        yield from ((f"{name}.args[{i}]", a) for i, a in enumerate(value.args))
        yield from ((f"{name}.{k}", v) for k, v in value.keywords.items())
    elif inspect.ismethod(value):
        yield "self", value.__self__
        yield name, value.__func__
    elif isinstance(value, types.FunctionType):
        yield from _function_references(value)
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from ((f"{name}[{i}]", v) for i, v in enumerate(islice(value, _ITEMS)))
    elif isinstance(value, dict):
        yield from ((f"{name}[{k!r}]", v) for k, v in islice(value.items(), _ITEMS))
    elif _plain_object(value):
        yield from ((f"{name}.{k}", v) for k, v in islice(vars(value).items(), _ITEMS))
        call = inspect.getattr_static(type(value), "__call__", None)
        if isinstance(call, types.FunctionType):
            yield name, call


def _function_references(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    code = fn.__code__
    for cell_name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield cell_name, cell.cell_contents
        except ValueError:  # a cell not yet bound
            continue
    for i, default in enumerate(fn.__defaults__ or ()):
        yield f"{fn.__name__}.__defaults__[{i}]", default
    yield from (fn.__kwdefaults__ or {}).items()
    names = set(_global_names(code))
    yield from ((n, v) for n, v in fn.__globals__.items() if n in names)


def _global_names(code: types.CodeType) -> Iterator[str]:
    # Nested functions and lambdas name globals in their own code objects.
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _plain_object(value: Any) -> bool:
    # Instances of user classes; not modules, classes, functions or tensors, whose
    # attributes hold no model a step trains.
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (type, types.ModuleType, torch.Tensor, torch.optim.Optimizer))
        and not callable(getattr(value, "__get__", None))
    )


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    inner = {id(m) for _, module in found for m in module.modules() if m is not module}
    return [(name, module) for name, module in found if id(module) not in inner]
