"""Upstream code on cudagraphs' helper: torch's ``torch.cuda.make_graphed_callables``
(and, where installed, Transformer Engine's) replaced by ours, so that their own test
suites and call sites run against it unchanged.

* torch's helper takes ``(callables, sample_args, num_warmup_iters=3,
  allow_unused_input=False, pool=None)``, ``pool`` fifth where ours (Transformer
  Engine's order) has ``sample_kwargs``; it is replaced by :func:`torch_signature_helper`,
  which takes torch's order and calls ours by keyword.
* Transformer Engine's ``make_graphed_callables`` has our signature already; it is
  replaced by ours as it is, in ``transformer_engine.pytorch`` and
  ``transformer_engine.pytorch.graph``, and only where Transformer Engine imports:
  nothing here makes code believe it is installed.

:func:`swap_make_graphed_callables` does the swap and returns what undoes it;
:mod:`cudagraphs.pytest_plugin` does it for a whole pytest run.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..core import make_graphed_callables

__all__ = [
    "HelperSwap",
    "swap_make_graphed_callables",
    "swapped_make_graphed_callables",
    "torch_signature_helper",
]

logger = logging.getLogger(__name__)

#: Where torch's helper is looked up: by its users (``torch.cuda.make_graphed_callables``)
#: and in its defining module (``from torch.cuda.graphs import ...``).
TORCH_SITES = ("torch.cuda", "torch.cuda.graphs")
#: Where Transformer Engine's helper is looked up, when Transformer Engine imports.
TE_SITES = ("transformer_engine.pytorch", "transformer_engine.pytorch.graph")


def torch_signature_helper(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
) -> Any:
    """``cudagraphs.make_graphed_callables`` behind ``torch.cuda.make_graphed_callables``'s
    signature (torch 2.x: ``pool`` is the fifth positional parameter)."""
    return make_graphed_callables(
        callables,
        sample_args,
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input,
        pool=pool,
    )


@dataclass
class HelperSwap:
    """The attributes a swap replaced, to put back: ``(module, name, original)``.

    ``sites`` names each replaced ``module.attribute``; ``te_status`` says what was done
    about Transformer Engine (``"swapped"``, ``"not installed"``, or why it was left).
    """

    replaced: list[tuple[Any, str, Any]] = field(default_factory=list)
    te_status: str = "not installed"

    @property
    def sites(self) -> list[str]:
        return [f"{module.__name__}.{name}" for module, name, _ in self.replaced]

    def restore(self) -> None:
        """Put every original back (idempotent)."""
        while self.replaced:
            module, name, original = self.replaced.pop()
            setattr(module, name, original)


def _replace(swap: HelperSwap, module_name: str, helper: Callable[..., Any]) -> None:
    module = importlib.import_module(module_name)
    original = getattr(module, "make_graphed_callables", None)
    if original is None:
        return
    swap.replaced.append((module, "make_graphed_callables", original))
    module.make_graphed_callables = helper


def _swap_transformer_engine(swap: HelperSwap) -> None:
    # find_spec first: importing a missing top-level package is the only way to ask
    # otherwise, and it must not leave a half-imported module behind.
    if importlib.util.find_spec("transformer_engine") is None:
        return
    try:
        for site in TE_SITES:
            _replace(swap, site, make_graphed_callables)
    except Exception as exc:  # a broken TE install (CUDA mismatch): leave it alone, say why
        swap.te_status = f"left alone: importing it failed ({type(exc).__name__}: {exc})"
        logger.warning("cudagraphs: Transformer Engine's helper not swapped: %s", swap.te_status)
        return
    swap.te_status = "swapped"


def swap_make_graphed_callables(*, transformer_engine: bool = True) -> HelperSwap:
    """Replace torch's ``make_graphed_callables`` (and Transformer Engine's, where it
    imports and ``transformer_engine`` is true) by cudagraphs'.

    Returns:
        A :class:`HelperSwap`; its ``restore()`` puts the originals back. Code that
        bound the helper to a name of its own before the swap (``from torch.cuda import
        make_graphed_callables`` at import) keeps the original: swap before importing it.
    """
    swap = HelperSwap()
    try:
        for site in TORCH_SITES:
            _replace(swap, site, torch_signature_helper)
        if transformer_engine:
            _swap_transformer_engine(swap)
    except BaseException:
        swap.restore()
        raise
    return swap


@contextmanager
def swapped_make_graphed_callables(*, transformer_engine: bool = True) -> Iterator[HelperSwap]:
    """:func:`swap_make_graphed_callables` for the duration of a ``with`` block."""
    swap = swap_make_graphed_callables(transformer_engine=transformer_engine)
    try:
        yield swap
    finally:
        swap.restore()
