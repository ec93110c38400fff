"""NeMo Automodel's partial CUDA graphs on cudagraphs' helper, as one call::

    from cudagraphs.integrations.nemo_automodel import use_cudagraphs

    use_cudagraphs()  # before PartialCudaGraphManager.capture()

NeMo Automodel's ``PartialCudaGraphManager`` (``nemo_automodel.components.cuda_graphs.
partial``, 0.7) captures its targets with Transformer Engine's
``make_graphed_callables``, which it looks up when it captures, through the module's
``_get_make_graphed_callables()``; without Transformer Engine that lookup raises
"Partial CUDA graphs require a working Transformer Engine PyTorch installation".
:func:`use_cudagraphs` replaces that one lookup: it still returns Transformer Engine's
helper where that loads, and cudagraphs' where it does not (or always, with
``force=True``). cudagraphs' helper takes Transformer Engine's parameters, including
the ``enabled=(False,)`` NeMo passes to keep quantization off.

What it does not do: it adds nothing to ``sys.modules`` and no import finder, so
``importlib.util.find_spec("transformer_engine")`` and every library that probes for
Transformer Engine (transformers, accelerate, NeMo itself) still see what is
installed. It changes no other part of NeMo.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core import make_graphed_callables
from ..errors import MissingDependencyError, UnsupportedModelError

__all__ = ["NEMO_PARTIAL_MODULE", "NemoHelperSwap", "use_cudagraphs"]

logger = logging.getLogger(__name__)

NEMO_PARTIAL_MODULE = "nemo_automodel.components.cuda_graphs.partial"
#: The function of that module through which the manager finds its graph helper.
LOOKUP = "_get_make_graphed_callables"


@dataclass
class NemoHelperSwap:
    """What :func:`use_cudagraphs` replaced; ``restore()`` puts it back (idempotent).
    Also a context manager that restores on exit."""

    module: Any
    original: Callable[[], Callable[..., Any]] | None

    def restore(self) -> None:
        if self.original is not None:
            setattr(self.module, LOOKUP, self.original)
            self.original = None

    def __enter__(self) -> NemoHelperSwap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def _lookup(original: Callable[[], Callable[..., Any]], force: bool) -> Callable[[], Any]:
    def get_make_graphed_callables() -> Callable[..., Any]:
        if not force:
            try:
                helper = original()
            except RuntimeError as exc:  # NeMo's "no working Transformer Engine"
                logger.info("NeMo partial graphs capture with cudagraphs: %s", exc)
            else:
                logger.info("NeMo partial graphs capture with Transformer Engine's helper")
                return helper
        return make_graphed_callables

    get_make_graphed_callables.__doc__ = (
        "cudagraphs.make_graphed_callables "
        + ("always" if force else "where Transformer Engine's does not load")
        + " (cudagraphs.integrations.nemo_automodel.use_cudagraphs)"
    )
    return get_make_graphed_callables


def use_cudagraphs(*, force: bool = False) -> NemoHelperSwap:
    """Make NeMo Automodel's partial CUDA graphs capture with cudagraphs'
    ``make_graphed_callables`` where Transformer Engine is absent or does not load, or
    always with ``force=True``.

    Call it before the manager's ``capture()``; calling it again replaces the earlier
    choice.

    Returns:
        A :class:`NemoHelperSwap` whose ``restore()`` gives NeMo its own lookup back.

    Raises:
        MissingDependencyError: NeMo Automodel is not installed.
        UnsupportedModelError: this NeMo Automodel has no ``_get_make_graphed_callables``
            in its partial-graph module (the versions this was written for, 0.7, have
            it); nothing was changed.
    """
    try:
        module = importlib.import_module(NEMO_PARTIAL_MODULE)
    except ImportError as exc:
        raise MissingDependencyError(
            f"cudagraphs.integrations.nemo_automodel needs NeMo Automodel ({NEMO_PARTIAL_MODULE} "
            f"did not import: {exc}). Fix: pip install nemo-automodel (0.7 is supported)."
        ) from exc
    current = getattr(module, LOOKUP, None)
    if not callable(current):
        version = getattr(importlib.import_module("nemo_automodel"), "__version__", "unknown")
        raise UnsupportedModelError(
            f"NeMo Automodel {version}: {NEMO_PARTIAL_MODULE} has no {LOOKUP}(), through which "
            "its partial-graph manager finds its graph helper (0.7 has it); nothing was "
            "changed. Fixes: 1. install nemo-automodel 0.7; 2. pass cudagraphs."
            "make_graphed_callables wherever this version takes its helper."
        )
    original = getattr(current, "__wrapped__", current)  # a second call wraps NeMo's own
    replacement = _lookup(original, force)
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, LOOKUP, replacement)
    return NemoHelperSwap(module=module, original=original)
