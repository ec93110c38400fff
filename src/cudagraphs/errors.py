"""One error hierarchy for the whole package.

Bad arguments raise the built-in ``ValueError`` / ``TypeError``; everything that goes
wrong while capturing or replaying raises a subclass of :class:`CudaGraphsError`, with
the underlying cause chained (``raise ... from exc``).
"""

from __future__ import annotations


class CudaGraphsError(RuntimeError):
    """Base class of every error this package raises on purpose (besides bad arguments)."""


class CudaGraphCaptureError(CudaGraphsError):
    """A capture failed. The allocator and the current stream were restored first, so
    the next capture (in the same pool too) can proceed."""


class CudaGraphInputError(CudaGraphsError, ValueError):
    """A replay received inputs that do not match what was captured."""


class GraphReleasedError(CudaGraphsError):
    """A graph was used after ``reset()`` / ``close()`` released it."""


class CaptureTimeHookError(CudaGraphsError):
    """A capture-time hook broke its contract (for example it returned a value)."""
