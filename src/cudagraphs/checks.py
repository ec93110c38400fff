"""Argument checks shared by every layer: typed errors that name the argument.

Python's own errors for a wrong type (``'int' object is not iterable``, a comparison
between ``str`` and ``float``) say neither which argument was wrong nor what to pass;
these checks do, before any work starts.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from .errors import CudaGraphsTypeError, CudaGraphsValueError, NoCudaDeviceError

__all__ = [
    "check_bool",
    "check_callable",
    "check_device",
    "check_instance",
    "check_int",
    "check_number",
    "check_optimizers",
    "require_cuda",
]


def require_cuda(what: str) -> None:
    """Raise :class:`NoCudaDeviceError` unless torch can use a CUDA device.

    Called before the first CUDA call of every entry point that needs a device, so a
    machine without one gets this message instead of torch's (an ``AssertionError``
    "Torch not compiled with CUDA enabled", or a "dummy base class" error).
    """
    if torch.cuda.is_available():
        return
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    raise NoCudaDeviceError(
        f"{what} needs a CUDA device, and torch finds none usable here (torch "
        f"{torch.__version__}, {build}). Fixes: 1. run on a machine with an NVIDIA GPU "
        "and its driver; 2. install a CUDA build of torch; 3. check that "
        "CUDA_VISIBLE_DEVICES does not hide every GPU."
    )


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int (``bool`` refused: ``True`` is not a count).

    Raises:
        CudaGraphsTypeError: not an int.
        CudaGraphsValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CudaGraphsTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise CudaGraphsValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (``0``/``1`` refused: flags are spelled True/False).

    Raises:
        CudaGraphsTypeError: naming ``name`` and the value received.
    """
    if not isinstance(value, bool):
        raise CudaGraphsTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_number(name: str, value: Any) -> float | int:
    """``value`` if it is a real number (``bool`` refused).

    Raises:
        CudaGraphsTypeError: a string, a tensor or anything else that is not a number.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CudaGraphsTypeError(
            f"{name} must be a number (int or float), got {type(value).__name__} {value!r}"
        )
    return value


def check_callable(name: str, value: Any) -> Callable[..., Any]:
    """``value`` if it is callable.

    Raises:
        CudaGraphsTypeError: naming ``name`` and the type received.
    """
    if not callable(value):
        raise CudaGraphsTypeError(f"{name} must be callable, got {type(value).__name__} {value!r}")
    return value


def check_instance(name: str, value: Any, types: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is an instance of ``types``.

    Raises:
        CudaGraphsTypeError: naming ``name``, ``what`` it must be, and what it is.
    """
    if not isinstance(value, types):
        raise CudaGraphsTypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    return value


def check_optimizers(name: str, value: Any) -> tuple[torch.optim.Optimizer, ...]:
    """``value`` as a tuple of optimizers: one ``torch.optim.Optimizer`` or an iterable
    of them (a list, a tuple; empty for none).

    Raises:
        CudaGraphsTypeError: naming ``name``, and the position and type of the first
            entry that is not an optimizer.
    """
    if isinstance(value, torch.optim.Optimizer):
        return (value,)
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise CudaGraphsTypeError(
            f"{name} must be a torch.optim.Optimizer or a tuple of them, got "
            f"{type(value).__name__} {value!r}; pass for example {name}=(optimizer,)"
        )
    out = tuple(value)
    for i, o in enumerate(out):
        if not isinstance(o, torch.optim.Optimizer):
            raise CudaGraphsTypeError(
                f"{name}[{i}] must be a torch.optim.Optimizer, got {type(o).__name__} "
                f"{o!r}; pass the optimizers that update the graphed parameters"
            )
    return out


def check_device(name: str, device: Any) -> torch.device:
    """``device`` (a ``torch.device``, a str such as ``"cuda:0"`` or an index) as a
    ``torch.device``.

    Raises:
        CudaGraphsTypeError: another type.
        CudaGraphsValueError: a string torch does not parse as a device.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise CudaGraphsTypeError(
            f"{name} must be a torch.device or a str such as 'cuda', got "
            f"{type(device).__name__} {device!r}"
        )
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise CudaGraphsValueError(
            f"{name} {device!r} is not a device torch knows ({exc}); pass 'cuda', 'cuda:N' or 'cpu'"
        ) from exc
