"""Every error the package raises, and the one mismatch record they report.

Each class derives from :class:`CudaGraphsError` *and* from the built-in exception a
caller would expect (``ValueError`` for a bad value, ``TypeError`` for a wrong type,
``RuntimeError`` for a failure while running, ``NotImplementedError``), so both
``except CudaGraphsError`` and ``except ValueError`` catch what they should. The
underlying cause, where there is one, is chained (``raise ... from exc``).

Messages say what was wrong, where (the argument, tree path, module name or bucket)
and the fix.

A mismatch between what was captured and what a call passed is reported the same way
by every layer (the core's input check, program signatures, partial-graph contracts,
serving inputs): one :class:`Mismatch` per difference, all of them at once, rendered
by :func:`describe_mismatches`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CaptureTimeHookError",
    "ChainedInputError",
    "CudaCallError",
    "CompiledCaptureError",
    "CudaGraphCaptureError",
    "CudaGraphInputError",
    "CudaGraphOutputError",
    "CudaGraphsError",
    "CudaGraphsKeyError",
    "CudaGraphsStateError",
    "CudaGraphsTypeError",
    "CudaGraphsValueError",
    "GraphReleasedError",
    "KeptGradientViewError",
    "KeptOutputViewError",
    "Mismatch",
    "MissingDependencyError",
    "UnsupportedModelError",
    "UnsupportedTorchError",
    "NoCudaDeviceError",
    "ProgramClosedError",
    "QuantizationNotSupportedError",
    "SignatureMismatchError",
    "TargetSelectionError",
    "UncapturedGradientError",
    "describe_mismatches",
]


@dataclass(frozen=True)
class Mismatch:
    """One difference between what was captured and what a call passed.

    ``path`` locates the value (``args[0]``, ``inputs[1]['x']``, ``inputs['tokens']``),
    ``field`` names the property that differs (``shape``, ``dtype``, ``type``, ...).
    """

    path: str
    field: str
    expected: Any
    received: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.field} expected {self.expected!r}, received {self.received!r}"


def describe_mismatches(what: str, mismatches: Sequence[Mismatch], fix: str = "") -> str:
    """The one report format: a headline, one line per mismatch, then the fix."""
    lines = "\n  ".join(str(m) for m in mismatches)
    text = f"{what} in {len(mismatches)} place(s):\n  {lines}"
    return f"{text}\n{fix}" if fix else text


class CudaGraphsError(Exception):
    """Base class of every error this package raises."""


class CudaGraphsValueError(CudaGraphsError, ValueError):
    """An argument has a value the package cannot use (the message names it)."""


class CudaGraphsTypeError(CudaGraphsError, TypeError):
    """An argument has a type the package cannot use (the message names it)."""


class CudaGraphsKeyError(CudaGraphsError, KeyError):
    """A name looked up in a registry is not there (the message lists what is)."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class CudaGraphsStateError(CudaGraphsError, RuntimeError):
    """A method was called at the wrong point of an object's life cycle (``run``
    before ``capture``, ``capture`` with nothing recorded, use after ``close``)."""


class NoCudaDeviceError(CudaGraphsStateError):
    """The work needs a CUDA device and torch reports none usable here."""


class MissingDependencyError(CudaGraphsError, ImportError):
    """An optional dependency a feature needs is not installed (the message names the
    package and the extra that brings it)."""


class UnsupportedModelError(CudaGraphsError, ValueError):
    """A model lacks what a feature needs (a static KV cache of full-attention layers,
    graph-safe experts); the message names what is missing and what to use instead."""


class UnsupportedTorchError(CudaGraphsError, ImportError):
    """The installed torch lacks a private API cudagraphs relies on (raised at import
    by :mod:`cudagraphs.torch_private`, naming the torch version and the API)."""


class CudaCallError(CudaGraphsError, RuntimeError):
    """A CUDA runtime or driver call made outside torch failed (the message names the
    call and its status)."""


class CudaGraphCaptureError(CudaGraphsError, RuntimeError):
    """A capture failed. The allocator and the current stream were restored first, so
    the next capture (in the same pool too) can proceed."""


class CompiledCaptureError(CudaGraphCaptureError):
    """``torch.compile`` compiled code where a capture needs code compiled before it
    (during the capture, or in the warmup step just before it), or nests CUDA graphs
    of its own in ours; the message names each frame, the guard that failed and the
    fix."""


class CudaGraphInputError(CudaGraphsError, ValueError):
    """A call passed inputs that do not match what was captured.

    ``mismatches`` holds one :class:`Mismatch` per difference found (empty where the
    problem is not a per-value difference, such as a replaced parameter).
    """

    def __init__(self, message: str, mismatches: Sequence[Mismatch] = ()) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches)

    def __reduce__(self) -> tuple:  # keep the record across pickling (multiprocessing)
        return (type(self), (str(self), self.mismatches))


class ChainedInputError(CudaGraphInputError):
    """A graph that reads an input in place from another graph's output (a decoder
    layer's hidden states from the layer before) was called with another tensor there;
    ``mismatches`` names each such input. Raised before anything is copied or
    replayed."""


class UncapturedGradientError(CudaGraphInputError):
    """A backward pass reached a replay whose graphs compute no gradient for an input
    (or parameter) that requires one: it was captured with sample inputs that did not
    require grad, or without a backward graph at all. Raised by the backward, so a
    forward-only use of such a call works and no gradient is ever silently short;
    ``mismatches`` names each input."""


class SignatureMismatchError(CudaGraphInputError):
    """A program payload differs from the captured signature; ``mismatches`` lists
    every difference. Raised before any byte of the program's buffer is written."""

    def __init__(self, what: str, mismatches: Sequence[Mismatch]) -> None:
        super().__init__(
            describe_mismatches(
                f"{what} differs from the captured signature",
                mismatches,
                "Nothing was copied. Pass values with the captured structure, shapes, "
                "strides and dtypes (devices may differ), or capture another program.",
            ),
            mismatches,
        )
        self.what = what

    def __reduce__(self) -> tuple:
        return (type(self), (self.what, self.mismatches))


class CudaGraphOutputError(CudaGraphsError, ValueError):
    """A captured function's outputs cannot be handed back correctly (for example an
    output without the row dimension a bucketed runner slices)."""


class GraphReleasedError(CudaGraphsError, RuntimeError):
    """A graph was used after ``reset()`` / ``close()`` released it."""


class KeptGradientViewError(CudaGraphsStateError):
    """An owned parameter gradient that a backward replay handed out as graph memory is
    still referenced, at a replay that would overwrite it, by a tensor this torch
    cannot move (a view, or a ``.grad`` kept after ``.grad`` was set to ``None``:
    ``cudagraphs.core.deferred_grads``). Raised before that replay."""


class KeptOutputViewError(CudaGraphsStateError):
    """An output that a forward replay handed out as graph memory (a whole model
    part's logits and loss under partial graphs' ``"model"`` scope) is still
    referenced, at the next replay that would overwrite it, by a tensor this torch
    cannot move: a view of it, or a ``.detach()`` of it (``cudagraphs.core.
    deferred_grads``). Raised before that replay."""


class ProgramClosedError(GraphReleasedError):
    """A program or pool was used after ``close()``."""


class QuantizationNotSupportedError(CudaGraphsError, NotImplementedError):
    """Transformer Engine's FP8/FP4 graphing was asked for (``enabled=True``,
    ``fp8_enabled=True``, ``calibrating=True``): graph quantized layers with Transformer
    Engine's own ``make_graphed_callables``."""


class CaptureTimeHookError(CudaGraphsError, RuntimeError):
    """A capture-time hook broke its contract (for example it returned a value)."""


class TargetSelectionError(CudaGraphsError, ValueError):
    """A partial-graph target cannot be graphed safely (the message names it and why)."""
