"""The work of one :meth:`~.manager.PartialCudaGraphManager.capture`: which recorded calls
to graph, graphing them group by group through a backend, and the backends.

Separate from :mod:`.manager` so that the manager holds the life cycle and its
documentation, and this module the capture transaction of each group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch

from ..capturing import capture_scope
from ..core.sharing import BufferSharing
from ..diagnostics import WarnOnce
from ..errors import CudaGraphsStateError, CudaGraphsValueError, TargetSelectionError
from ..memory import release_unused_cache
from ..settings import DISABLE_ENV, graphs_disabled
from .chaining import group_sharing
from .entry import PartialGraphEntry
from .recording import Recorder, capture_groups, capture_modes
from .speed import SpeedCheck, measure_group

__all__ = [
    "TargetsBackend",
    "calls_to_capture",
    "capture_calls",
    "read_disabled",
    "release_cached",
]

#: How a manager turns recorded calls into graphed callables:
#: ``backend(callables, sample_args, sample_kwargs) -> graphed callables`` (one each).
#: (Serving's bucket backend, ``cudagraphs.serving.graphs.BucketBackend``, is another
#: contract: one graph per call.)
TargetsBackend = Callable[[tuple, tuple, list], Sequence[Callable[..., Any]]]


def _default_backend(
    callables: tuple,
    sample_args: tuple,
    sample_kwargs: list,
    sharing: BufferSharing | None = None,
) -> Sequence[Any]:
    from ..core import make_graphed_callables

    # Lent gradients (.core.lent_grads), not owned copies: an owned copy is eager
    # memory that cannot take the place of the graphed targets' activations, dead in
    # the pool by then, as eager gradients do; up to a copy of every graphed parameter's
    # gradient beside the pool (issue 36). The pool's settle moves any still lent
    # before a replay could overwrite it, so accumulation and hooks stay exact.
    result = make_graphed_callables(
        callables,
        sample_args,
        sample_kwargs=sample_kwargs,
        clone_param_grads_on_return=False,
        _buffer_sharing=sharing,
    )
    return result if isinstance(result, tuple) else (result,)


def _eager_backend(callables: tuple, sample_args: tuple, sample_kwargs: list) -> Sequence[Any]:
    """The backend under ``CUDAGRAPHS_DISABLE=1``: each adapter is its own "graph",
    called with the arguments a graph would get (parameters first) and run eagerly."""
    del sample_args, sample_kwargs
    return list(callables)


def release_cached(active: bool) -> int:
    """Before and after a manager's captures on CUDA (``active``): give the memory the
    caching allocator keeps cached and no tensor uses back to the driver
    (:func:`~cudagraphs.memory.release_unused_cache`); returns the bytes.

    Why: the eager steps before a capture cached a working set that held the graphed
    targets' activations too; from the capture on those live in the graphs' pools,
    so the cache is larger than eager code needs, and kept it would sit beside the
    pools. The next step's eager allocations come from the driver once
    (``docs/memory.md`` has the measured cost)."""
    if not (active and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    return release_unused_cache(torch.cuda.current_device(), "partial graphs capture")


def read_disabled(fixed: bool | None) -> bool:
    """``CUDAGRAPHS_DISABLE`` now (:func:`~cudagraphs.settings.graphs_disabled`), which
    must equal ``fixed``: what a manager's first capture read (``None`` before it).

    Raises:
        CudaGraphsStateError: the flag changed since the first capture.
        CudaGraphsValueError: the flag is not a boolean.
    """
    disabled = graphs_disabled()
    if fixed is not None and disabled != fixed:
        was, now = ("disabled", "enabled") if fixed else ("enabled", "disabled")
        raise CudaGraphsStateError(
            f"{DISABLE_ENV} changed since this manager's first capture() (graphs were "
            f"{was} then, {now} now); one manager does not mix graphed and eager "
            f"targets. Fixes: 1. set {DISABLE_ENV} before the first capture() and keep "
            "it; 2. close() this manager and build a new one."
        )
    return disabled


def calls_to_capture(
    entries: Sequence[PartialGraphEntry], recorder: Recorder, logger: logging.Logger
) -> list[tuple[PartialGraphEntry, int]]:
    """The recorded calls not graphed yet, as ``(entry, variant index)`` in the real
    forward order ``recorder`` saw, leaving out targets turned off; a target called
    with an object holding tensors (a KV cache) is turned off here, said on ``logger``.

    Raises:
        TargetSelectionError: a target ran more than once in one recorded forward (or,
            without model parts, while recording).
        CudaGraphsStateError: nothing was recorded.
    """
    repeated = [e.name for e in entries if e.repeated]
    if repeated:
        where = (
            "within one forward of the model"
            if recorder.clock is not None
            else "while recording (this manager was built without its model parts, so "
            "forwards cannot be told apart and gradient accumulation looks the same; "
            "build it with from_model_parts to record several micro-batches)"
        )
        raise TargetSelectionError(
            f"{repeated} ran more than once {where}; one graph cannot stand for "
            "several calls of one forward (the second replay would overwrite the "
            "first one's outputs and saved activations). Fix: leave these modules "
            "out of the targets (scopes= without their scope, or an include= that "
            "does not name them)."
        )
    _turn_off_stateful(recorder.order, logger)
    todo = [
        (entry, i)
        for entry in recorder.order
        for i, variant in enumerate(entry.variants)
        if variant.graph is None and entry.off_reason is None
    ]
    if not todo and not any(e.variants for e in entries):
        raise CudaGraphsStateError(
            "nothing was recorded, so there is nothing to capture. Fix: call "
            "start_recording(), run one training step (forward and backward), then "
            "capture()."
        )
    return todo


def holds_tensors(value: Any, depth: int = 3) -> bool:
    """Whether a non-tensor argument holds tensors in its attributes, or in lists,
    tuples and dicts of them, ``depth`` levels down: state such as a KV cache object."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0 or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return False
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        items = getattr(value, "__dict__", {}).values()
    return any(holds_tensors(v, depth - 1) for v in items)


def _turn_off_stateful(entries: Sequence[PartialGraphEntry], logger: logging.Logger) -> None:
    # An object holding tensors (a KV cache) is state the call reads and changes: the
    # warmup and capture runs would change the recorded object (a cache grows by one
    # step per run), and a graph cannot follow the next step's object. The target runs
    # eagerly for good, said once per target.
    for entry in entries:
        if entry.off_reason is not None:
            continue
        kinds = sorted(
            {
                type(value).__name__
                for i, variant in enumerate(entry.contracts.variants)
                if entry.variants[i].graph is None
                for _, value in variant.controls
                if holds_tensors(value)
            }
        )
        if kinds:
            entry.turn_off("stateful_argument")
            logger.warning(
                "partial graphs: %s is called with %s object(s) holding tensors (state "
                "the call changes, such as a KV cache), which no graph can follow; it "
                "runs eagerly (stats()['off_stateful_argument']). Fix: for training, "
                "call the model with use_cache=False (or set model.config.use_cache = "
                "False).",
                entry.name,
                ", ".join(kinds),
            )


def capture_calls(
    todo: list[tuple[PartialGraphEntry, int]],
    backend: TargetsBackend,
    *,
    disabled: bool,
    pooled: bool,
    speed_check: SpeedCheck | bool,
    targets: int,
    warn_once: WarnOnce,
    logger: logging.Logger,
) -> list:
    """Graph ``todo`` through ``backend`` (the eager backend when ``disabled``, said
    once through ``warn_once`` with the manager's number of ``targets``), in the groups
    :func:`~.recording.capture_groups` makes (one pool per call when ``pooled``:
    activation checkpointing), and say how many on ``logger``.

    Returns:
        The speed verdicts of the groups (:func:`~.speed.measure_group`).

    Raises:
        CudaGraphsValueError: the backend returned the wrong number of callables.
    """
    if disabled:
        warn_once(
            "disabled",
            "partial graphs are disabled (%s=1): the %d target(s) of this manager run "
            "eagerly through the same recording, contract matching and counting, and "
            "no graph is captured; stats()['disabled'] is 1. Unset %s to graph them.",
            DISABLE_ENV,
            targets,
            DISABLE_ENV,
        )
    verdicts: list = []
    if todo:
        backend = _eager_backend if disabled else backend
        for group in capture_groups(todo, pooled):
            verdicts += _capture_group(group, backend, disabled, speed_check)
        logger.info(
            "partial graphs: %s %d call(s)%s",
            "prepared eagerly (disabled)" if disabled else "captured",
            len(todo),
            ", one pool each (activation checkpointing)" if pooled else "",
        )
    return verdicts


def _capture_group(
    group: list[tuple[PartialGraphEntry, int]],
    backend: Any,
    disabled: bool,
    speed_check: SpeedCheck | bool,
) -> list:
    callables, sample_args, sample_kwargs = [], [], []
    for entry, i in group:
        variant = entry.variants[i]
        args, kwargs = variant.args, variant.kwargs
        callables.append(entry.adapter())
        sample_args.append((tuple(entry.capture_params(i)), *args))
        sample_kwargs.append(kwargs)
    first = group[0][0].contracts.variants[group[0][1]]
    modules = [entry.target.module for entry, _ in group]
    scope = nullcontext() if disabled else capture_scope()
    modes = capture_modes(first.grad_enabled, first.training, modules, first.autocast)
    if backend is _default_backend:
        # Ours shares buffers between the group's graphs (.chaining); a backend of the
        # user's gets the documented three arguments.
        backend = partial(_default_backend, sharing=group_sharing(group))
    with modes:
        with scope:
            graphed = list(backend(tuple(callables), tuple(sample_args), sample_kwargs))
        if len(graphed) != len(group):
            raise CudaGraphsValueError(
                f"capture_backend returned {len(graphed)} callable(s) for "
                f"{len(group)} call(s) ({[e.name for e, _ in group]}); it must "
                "return one graphed callable per call, in order"
            )
        measure = not disabled and len(graphed) == len(group)
        verdicts = measure_group(speed_check, group, graphed) if measure else []
    for (entry, i), g in zip(group, graphed):
        entry.variants[i].captured(g, tuple(entry.capture_params(i)))
    return verdicts
