"""Whether graphs are being warmed up or captured: the state other code reads.

Code inside a graphed callable sometimes must behave differently while it is being
warmed up and captured (skip a host sync, a print, a data-dependent branch, or an
FP8 amax update that belongs outside the graph). Transformer Engine exposes that
state as ``transformer_engine.pytorch.graph.is_graph_capturing()``, and its layers
and Megatron-Core's schedules branch on it. :func:`is_graph_capturing` is ours:
true from the start of warmup to the end of capture in every layer of this package
(the core helper, ``graph_stack``, programs, partial graphs, the serving runner).

The state is a :class:`contextvars.ContextVar` depth counter rather than a global
flag: each thread (and async task) sees its own, nested scopes count, and leaving a
scope resets the counter to what it was on entry, also when the scope raises, so a
failed capture never leaves "capturing" set.

Transformer Engine's own flag: when ``transformer_engine.pytorch.graph`` is already
imported (a model using TE modules has imported it), the outermost scope calls its
``set_capture_start()`` on entry and ``set_capture_end()`` on exit (in ``finally``),
as TE's own ``make_graphed_callables`` does, unless TE reports it is capturing
already (an outer TE helper owns the flag then). Those two functions and
``is_graph_capturing()`` are the only TE functions used. TE is never imported here:
importing it loads its CUDA extensions, and code that branches on its flag has
imported it already.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["TE_GRAPH_MODULE", "capture_scope", "is_graph_capturing"]

logger = logging.getLogger(__name__)

#: The Transformer Engine module whose capture flag is kept in step with ours.
TE_GRAPH_MODULE = "transformer_engine.pytorch.graph"

# Nesting depth of capture scopes in this context (0: not capturing). A ContextVar,
# not a plain global: per thread and per async task, restored by token on exit.
_DEPTH: ContextVar[int] = ContextVar("cudagraphs_capture_depth", default=0)


def is_graph_capturing() -> bool:
    """Whether this thread is inside the warmup or capture of a cudagraphs graph.

    True from the first warmup iteration to the end of the last capture of
    :func:`~cudagraphs.make_graphed_callables`, :func:`~cudagraphs.graph_stack`,
    :meth:`~cudagraphs.CudaGraphProgram.capture`, a partial-graph manager's
    ``capture()`` and :meth:`~cudagraphs.serving.GraphRunner.capture`; false on
    replay and under ``CUDAGRAPHS_DISABLE=1`` (nothing is warmed up or captured).
    Use it to skip work that must not be captured or must not run during warmup.
    """
    return _DEPTH.get() > 0


def _te_graph() -> Any:
    module = sys.modules.get(TE_GRAPH_MODULE)
    if module is None:
        return None
    needed = ("set_capture_start", "set_capture_end", "is_graph_capturing")
    if not all(callable(getattr(module, name, None)) for name in needed):
        logger.debug("%s lacks %s; its capture flag is left alone", TE_GRAPH_MODULE, needed)
        return None
    return module


@contextlib.contextmanager
def capture_scope() -> Iterator[None]:
    """Mark warmup and capture: :func:`is_graph_capturing` is true inside (and
    Transformer Engine's flag, see module docs); everything is restored on exit,
    also when the body raises."""
    token = _DEPTH.set(_DEPTH.get() + 1)
    te = _te_graph() if token.old_value in (0, token.MISSING) else None
    owns_te = te is not None and not te.is_graph_capturing()
    try:
        if owns_te:
            te.set_capture_start()
        yield
    finally:
        try:
            if owns_te:
                te.set_capture_end()
        finally:
            _DEPTH.reset(token)
