"""Process-wide switches read from the environment, parsed one way everywhere.

* ``CUDAGRAPHS_DISABLE``: every layer runs eagerly through its usual code path
  (argument checks and per-call validation included, capture skipped), for comparing
  graphed against eager results while debugging.
* ``CUDAGRAPHS_REQUIRE_ALL_BUCKETS``: a serving bucket dropped at startup is an error.

A flag is read when it matters (at capture), never cached in a module global, so a
test or a debugging session can change it between captures. Values: ``1``, ``true``,
``yes``, ``on`` and ``0``, ``false``, ``no``, ``off`` in any case; unset or empty is
the default; anything else is an error that names the variable.
"""

from __future__ import annotations

import os

from .errors import CudaGraphsValueError

__all__ = ["DISABLE_ENV", "STRICT_BUCKETS_ENV", "env_flag", "graphs_disabled"]

DISABLE_ENV = "CUDAGRAPHS_DISABLE"
STRICT_BUCKETS_ENV = "CUDAGRAPHS_REQUIRE_ALL_BUCKETS"

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


def graphs_disabled() -> bool:
    """Whether ``CUDAGRAPHS_DISABLE`` asks every layer to run eagerly."""
    return env_flag(DISABLE_ENV)
