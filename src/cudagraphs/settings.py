"""Process-wide switches read from the environment, parsed one way everywhere.

* ``CUDAGRAPHS_DISABLE``: every layer runs eagerly through its usual code path
  (argument checks and per-call validation included, capture skipped), for comparing
  graphed against eager results while debugging.
* ``CUDAGRAPHS_REQUIRE_ALL_BUCKETS``: a serving bucket dropped at startup is an error.
* ``CUDAGRAPHS_KEEP_CACHE``: never give unused cached device memory back to the driver
  around a capture (:func:`cudagraphs.memory.release_unused_cache`).
* ``CUDAGRAPHS_EXPANDABLE_POOLS`` (default on): graph pools grow as expandable
  segments (:func:`cudagraphs.graph_pool.pool_segments`); ``0`` makes them as the
  caching allocator's settings say.
* ``CUDAGRAPHS_EXPANDABLE_RECORDING`` (default on): a partial-graph recording step's
  eager allocations are made in expandable segments
  (:class:`cudagraphs.memory.RecordingSegments`); ``0`` leaves them to the caching
  allocator's settings.
* ``CUDAGRAPHS_COMPACT_STATE`` (default on): around a partial-graph capture, the
  scattered state of the optimizers that stepped while recording is packed into one
  buffer per dtype (:mod:`cudagraphs.optimizer_state`), before a
  ``graph_train_step`` capture its optimizer's, and before a
  ``make_graphed_callables`` / ``graph_stack`` capture that of the optimizers passed
  as ``optimizers=``; ``0`` leaves it where it is.
* ``CUDAGRAPHS_OWNED_GRADS``: how owned parameter gradients leave a backward replay:
  ``defer`` (the default: the graph memory itself, copied only when something still
  holds it at the next replay that could overwrite it:
  :mod:`cudagraphs.core.deferred_grads`) or ``copy`` (a copy of each at every
  replay, at that copy's memory and time). Owned outputs (partial graphs' ``"model"``
  scope: its loss and logits) follow the same switch.
* ``CUDAGRAPHS_CUDA_BINDING``: which binding makes the package's direct CUDA calls
  (:mod:`cudagraphs.cuda_binding`): ``auto`` (the default: ``cuda.bindings`` when it
  imports and reaches the driver, else ``ctypes``), ``cuda.bindings`` or ``ctypes``.

A flag is read when it matters (at capture), never cached in a module global, so a
test or a debugging session can change it between captures. Values: ``1``, ``true``,
``yes``, ``on`` and ``0``, ``false``, ``no``, ``off`` in any case; unset or empty is
the default; anything else is an error that names the variable.
"""

from __future__ import annotations

import os

from .errors import CudaGraphsValueError

__all__ = [
    "BINDING_ENV",
    "COMPACT_STATE_ENV",
    "DISABLE_ENV",
    "EXPANDABLE_POOLS_ENV",
    "EXPANDABLE_RECORDING_ENV",
    "OWNED_GRADS_ENV",
    "STRICT_BUCKETS_ENV",
    "compact_state",
    "env_choice",
    "env_flag",
    "expandable_pools",
    "expandable_recording",
    "graphs_disabled",
    "owned_grads_deferred",
]

DISABLE_ENV = "CUDAGRAPHS_DISABLE"
STRICT_BUCKETS_ENV = "CUDAGRAPHS_REQUIRE_ALL_BUCKETS"
BINDING_ENV = "CUDAGRAPHS_CUDA_BINDING"
EXPANDABLE_POOLS_ENV = "CUDAGRAPHS_EXPANDABLE_POOLS"
EXPANDABLE_RECORDING_ENV = "CUDAGRAPHS_EXPANDABLE_RECORDING"
COMPACT_STATE_ENV = "CUDAGRAPHS_COMPACT_STATE"
OWNED_GRADS_ENV = "CUDAGRAPHS_OWNED_GRADS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (see module docs).

    Raises:
        CudaGraphsValueError: the variable holds something else (naming it and the
            accepted values).
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CudaGraphsValueError(
        f"environment variable {name}={raw!r} is not a boolean; set it to one of "
        f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}, or unset it"
    )


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable ``name``, one of ``choices`` (compared without case
    or surrounding spaces); unset or empty gives ``default``.

    Raises:
        CudaGraphsValueError: any other value (naming the variable and the choices).
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    for choice in choices:
        if value == choice.lower():
            return choice
    raise CudaGraphsValueError(
        f"environment variable {name}={raw!r} is not one of {', '.join(choices)}; "
        "set it to one of them, or unset it"
    )


def graphs_disabled() -> bool:
    """Whether ``CUDAGRAPHS_DISABLE`` asks every layer to run eagerly."""
    return env_flag(DISABLE_ENV)


def expandable_pools() -> bool:
    """``CUDAGRAPHS_EXPANDABLE_POOLS`` now (default on)."""
    return env_flag(EXPANDABLE_POOLS_ENV, default=True)


def expandable_recording() -> bool:
    """``CUDAGRAPHS_EXPANDABLE_RECORDING`` now (default on)."""
    return env_flag(EXPANDABLE_RECORDING_ENV, default=True)


def compact_state() -> bool:
    """``CUDAGRAPHS_COMPACT_STATE`` now (default on)."""
    return env_flag(COMPACT_STATE_ENV, default=True)


def owned_grads_deferred() -> bool:
    """Whether ``CUDAGRAPHS_OWNED_GRADS`` is ``defer`` (the default) rather than ``copy``."""
    return env_choice(OWNED_GRADS_ENV, ("copy", "defer"), "defer") == "defer"
