"""A TEST-ONLY stand-in for Transformer Engine, with FP8 off.

Why it exists: Megatron-Core's per-layer graph helper (``TECudaGraphHelper`` in
``megatron/core/transformer/cuda_graphs.py``, 0.19.2) only runs when its
``from transformer_engine.pytorch... import ...`` block succeeds, and it calls
``transformer_engine.pytorch.graph.make_graphed_callables``. To run Megatron's own
helper on ``cudagraphs.make_graphed_callables`` without Transformer Engine, something
must answer those imports. This module does, inside one ``with`` block of a test or
benchmark process, and takes everything back out on exit.

Why it must never ship in ``src/``: while it is installed, any code that asks
"is Transformer Engine installed?" (``import transformer_engine``,
``importlib.util.find_spec``) is told yes. That is only acceptable in a process that
installed it on purpose.

What it fakes (exactly the names the helper's import chain touches, and nothing else):

* ``transformer_engine.__version__``: the version Megatron's ``is_te_min_version``
  branches on (:data:`TE_VERSION` by default).
* ``transformer_engine.pytorch.graph``: ``make_graphed_callables`` (cudagraphs'
  unless another is given), ``set_capture_start`` / ``set_capture_end`` /
  ``is_graph_capturing`` (a flag kept on the :class:`StandIn`; cudagraphs'
  ``capture_scope`` drives it, as it drives Transformer Engine's), and
  ``save_fp8_tensors`` / ``restore_fp8_tensors``, which have nothing to save with FP8
  off.
* ``transformer_engine.pytorch.fp8.FP8GlobalStateManager``: FP8 off, calibration off.
* ``transformer_engine.pytorch.distributed.is_fp8_activation_recompute_enabled``:
  ``False``.
* ``transformer_engine.pytorch.module.base.TransformerEngineBaseModule``: a class no
  module derives from, so ``isinstance(m, TransformerEngineBaseModule)`` is false
  for every layer.
* ``transformer_engine.pytorch.utils.make_weak_ref``: raises; only Megatron's
  ``cuda_graph_impl="local"`` path calls it, and that path is not served here.

Anything else (``transformer_engine.pytorch.Linear``, ``fp8_autocast``, a submodule
not listed) is missing: ``from ... import`` raises ``ImportError`` and attribute
access raises ``AttributeError`` naming this file. The fake packages have an empty
``__path__``, so an installed Transformer Engine on disk is never half-imported
underneath them.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STANDIN_MARKER", "TE_MODULES", "TE_VERSION", "StandIn", "te_standin"]

#: The Transformer Engine version the stand-in reports. Megatron-Core 0.19.2's graph
#: helper branches on 1.10, 1.14, 2.6, 2.7 and 2.10 (kwargs and ``reset()``); 2.20
#: is the TE release whose ``make_graphed_callables`` cudagraphs mirrors.
TE_VERSION = "2.20.0"

#: Every module the stand-in installs, parents first.
TE_MODULES = (
    "transformer_engine",
    "transformer_engine.pytorch",
    "transformer_engine.pytorch.graph",
    "transformer_engine.pytorch.fp8",
    "transformer_engine.pytorch.distributed",
    "transformer_engine.pytorch.module",
    "transformer_engine.pytorch.module.base",
    "transformer_engine.pytorch.utils",
)

#: Attribute set on every fake module, so code (and tests) can tell it from the real one.
STANDIN_MARKER = "__cudagraphs_te_standin__"

_PACKAGES = {
    "transformer_engine",
    "transformer_engine.pytorch",
    "transformer_engine.pytorch.module",
}


class _FakeModule(types.ModuleType):
    """A module that names this file when something asks it for a name it lacks."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.__name__}.{name} is not provided by the test stand-in for Transformer "
            f"Engine (tests/helpers/te_standin.py), which fakes only what Megatron-Core's "
            f"TE graph helper imports, with FP8 off"
        )


class FP8GlobalStateManager:
    """Transformer Engine's FP8 state, as the stand-in has it: FP8 is off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def is_fp8_calibration() -> bool:
        return False

    @staticmethod
    def is_first_fp8_module() -> bool:
        return False


class TransformerEngineBaseModule:
    """No module derives from this: no layer is a Transformer Engine module."""


def is_fp8_activation_recompute_enabled() -> bool:
    return False


def make_weak_ref(tensor: Any) -> Any:
    raise NotImplementedError(
        "make_weak_ref is not provided by the test stand-in for Transformer Engine: only "
        "Megatron's cuda_graph_impl='local' path calls it, and the stand-in serves "
        "cuda_graph_impl='transformer_engine' (TECudaGraphHelper)"
    )


def save_fp8_tensors(modules: Any, fp8_recipe: Any = None) -> None:
    """With FP8 off there are no FP8 tensors to save (Transformer Engine returns
    ``None`` for a recipe without delayed scaling, too)."""
    return None


def restore_fp8_tensors(modules: Any, fp8_tensors: Any) -> None:
    if fp8_tensors is not None:
        raise ValueError("the stand-in saved no FP8 tensors (FP8 is off); got some to restore")


@dataclass
class StandIn:
    """The installed stand-in: what it reports and what was asked of it.

    Attributes:
        version: ``transformer_engine.__version__``.
        make_graphed_callables: what ``transformer_engine.pytorch.graph`` hands out.
        capturing: Transformer Engine's capture flag (``is_graph_capturing()``).
        capture_starts: how often ``set_capture_start()`` was called.
        modules: the fake modules by name.
    """

    version: str
    make_graphed_callables: Callable[..., Any]
    capturing: bool = False
    capture_starts: int = 0
    modules: dict[str, types.ModuleType] = field(default_factory=dict)

    def set_capture_start(self) -> None:
        self.capturing = True
        self.capture_starts += 1

    def set_capture_end(self) -> None:
        self.capturing = False

    def is_graph_capturing(self) -> bool:
        return self.capturing


def _module(name: str) -> _FakeModule:
    module = _FakeModule(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name in _PACKAGES)
    if name in _PACKAGES:
        module.__path__ = []  # submodules not listed here are not found (no real TE beneath)
    setattr(module, STANDIN_MARKER, True)
    return module


def _build(standin: StandIn) -> dict[str, types.ModuleType]:
    mods = {name: _module(name) for name in TE_MODULES}
    mods["transformer_engine"].__version__ = standin.version
    graph = mods["transformer_engine.pytorch.graph"]
    graph.make_graphed_callables = standin.make_graphed_callables
    graph.set_capture_start = standin.set_capture_start
    graph.set_capture_end = standin.set_capture_end
    graph.is_graph_capturing = standin.is_graph_capturing
    graph.save_fp8_tensors = save_fp8_tensors
    graph.restore_fp8_tensors = restore_fp8_tensors
    mods["transformer_engine.pytorch.fp8"].FP8GlobalStateManager = FP8GlobalStateManager
    mods[
        "transformer_engine.pytorch.distributed"
    ].is_fp8_activation_recompute_enabled = is_fp8_activation_recompute_enabled
    mods[
        "transformer_engine.pytorch.module.base"
    ].TransformerEngineBaseModule = TransformerEngineBaseModule
    mods["transformer_engine.pytorch.utils"].make_weak_ref = make_weak_ref
    # `import transformer_engine.pytorch as te` and `te.pytorch.graph` read these.
    for name in TE_MODULES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(mods[parent], child, mods[name])
    return mods


def _te_keys() -> set[str]:
    return {
        k for k in sys.modules if k == "transformer_engine" or k.startswith("transformer_engine.")
    }


@contextlib.contextmanager
def te_standin(
    version: str = TE_VERSION, make_graphed_callables: Callable[..., Any] | None = None
) -> Iterator[StandIn]:
    """Install the stand-in into ``sys.modules`` for the ``with`` block.

    Args:
        version: the ``transformer_engine.__version__`` to report.
        make_graphed_callables: what ``transformer_engine.pytorch.graph`` provides;
            ``cudagraphs.make_graphed_callables`` by default (a test may pass a
            recording wrapper around it).

    Yields:
        The :class:`StandIn`.

    On exit (also on error) every ``transformer_engine*`` entry of ``sys.modules`` is
    what it was on entry: entries that were there (a real Transformer Engine already
    imported) come back, entries added inside the block are removed. Code that bound
    a name from the stand-in inside the block keeps that object; the caller undoes
    such bindings (see ``tests/helpers/megatron_case.py``).

    Raises:
        RuntimeError: a stand-in is installed already (they do not nest).
    """
    current = sys.modules.get("transformer_engine")
    if current is not None and getattr(current, STANDIN_MARKER, False):
        raise RuntimeError("the Transformer Engine stand-in is installed already; it does not nest")
    if make_graphed_callables is None:
        from cudagraphs import make_graphed_callables as ours

        make_graphed_callables = ours
    standin = StandIn(version=version, make_graphed_callables=make_graphed_callables)
    before = {k: sys.modules[k] for k in _te_keys()}
    try:
        standin.modules = _build(standin)
        sys.modules.update(standin.modules)
        yield standin
    finally:
        for key in _te_keys() - before.keys():
            del sys.modules[key]
        sys.modules.update(before)
