"""The capture phase: from the recorded calls to graphs, one
:meth:`~.manager.PartialCudaGraphManager.capture` at a time.

1. :func:`calls_to_capture`: the recorded calls not graphed yet, in the real forward
   order; a target called twice in one forward is refused, one called with state (a
   KV cache) turned off.
2. :func:`capture_model_first`: whole model parts (:mod:`.model_scope`) are captured
   first; the targets inside a part graphed whole are turned off.
3. :func:`capture_calls`: the rest, in groups (:func:`capture_groups`: training calls
   together, each inference mode and autocast state apart, one call per group under
   activation checkpointing), each group under the modes it was recorded in
   (:func:`capture_modes`) through a backend: the core's ``make_graphed_callables``
   by default, with the buffers of chained calls shared (:mod:`.chaining`). What is
   graphed for a target is :func:`graphed_function`: its forward with the parameters
   as explicit inputs. Each group's graphs are timed against eager right after
   (:mod:`.speed`).

Each captured variant keeps its graph (:meth:`~.recording.RecordedVariant.captured`)
and, where the core's graph flattens its call as the contract does, a replay from the
call's tensors alone (:func:`replay_from_tensors`).

What this module does NOT do: it installs no forward (the manager installs the
:class:`~.replay.TargetDispatcher` after a capture) and records nothing.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import core
from ..capture_state import capture_scope
from ..core.graphed import GraphedCallable
from ..core.sharing import BufferSharing
from ..diagnostics import WarnOnce
from ..errors import (
    CudaGraphCaptureError,
    CudaGraphOutputError,
    CudaGraphsStateError,
    CudaGraphsValueError,
    TargetSelectionError,
)
from ..memory import KEEP_CACHE_ENV, place_cublas_workspaces, release_unused_cache
from ..optimizer_state import compact_before_capture, optimizers_of
from ..settings import DISABLE_ENV, env_flag, graphs_disabled
from ..torch_private import clear_cublas_workspaces, recompile_limit_at_least
from .chaining import group_sharing
from .contract import AutocastState, flatten_call
from .model_scope import CHECKPOINT_REFUSAL, opaque_output_fix, opaque_outputs, refused_message
from .recording import Call, Recorder, TargetRecording
from .speed import SpeedCheck, measure_group, turn_off_slower
from .vocabulary import MODEL_KIND, OffReason

__all__ = [
    "TargetCompile",
    "TargetsBackend",
    "calls_to_capture",
    "capture_calls",
    "capture_groups",
    "capture_model_first",
    "capture_modes",
    "eager_backend",
    "eager_code_remains",
    "graphed_function",
    "holds_tensors",
    "place_workspaces",
    "read_disabled",
    "release_cached",
    "replay_from_tensors",
    "unreached_outputs",
]

#: How a manager turns recorded calls into graphed callables:
#: ``backend(callables, sample_args, sample_kwargs) -> graphed callables`` (one each).
#: (Serving's bucket backend, ``cudagraphs.serving.graphs.BucketBackend``, is another
#: contract: one graph per call.)
TargetsBackend = Callable[[tuple, tuple, list], Sequence[Callable[..., Any]]]


def _core_backend(
    callables: tuple,
    sample_args: tuple,
    sample_kwargs: list,
    sharing: BufferSharing,
    unreached: dict[int, frozenset[int]] | None = None,
    owned: frozenset[int] = frozenset(),
) -> Sequence[Any]:
    # Lent gradients (.core.lent_grads), not owned copies: an owned copy is eager
    # memory that cannot take the place of the graphed targets' activations, dead in
    # the pool by then, as eager gradients do; up to a copy of every graphed parameter's
    # gradient beside the pool. The pool's settle moves any still lent before a replay
    # could overwrite it, so accumulation and hooks stay exact.
    result = core.make_graphed_callables(
        callables,
        sample_args,
        sample_kwargs=sample_kwargs,
        clone_param_grads_on_return=False,
        _buffer_sharing=sharing,
        _unreached_outputs=unreached or None,
        # Whole model parts: their outputs reach the caller's code (see .replay).
        _owned_outputs=owned,
        # The manager gives the cache back around all of its captures and places the
        # eager workspaces only where eager model code remains (place_workspaces).
        _release_cache=False,
    )
    return result if isinstance(result, tuple) else (result,)


def eager_backend(callables: tuple, sample_args: tuple, sample_kwargs: list) -> Sequence[Any]:
    """The backend under ``CUDAGRAPHS_DISABLE=1``: each graphed function is its own
    "graph", called with the arguments a graph would get (parameters first) and run
    eagerly."""
    del sample_args, sample_kwargs
    return list(callables)


def release_cached(active: bool, *, drop_workspaces: bool = False) -> int:
    """Before and after a manager's captures on CUDA (``active``): give the memory the
    caching allocator keeps cached and no tensor uses back to the driver
    (:func:`~cudagraphs.memory.release_unused_cache`); returns the bytes.
    ``drop_workspaces`` (before the captures): first drop torch's cuBLAS workspaces
    (:func:`~cudagraphs.torch_private.clear_cublas_workspaces`), so that their
    blocks go back too.

    Why: the eager steps before a capture cached a working set that held the graphed
    targets' activations too; from the capture on those live in the graphs' pools,
    so the cache is larger than eager code needs, and kept it would sit beside the
    pools. The eager workspaces (one per thread: the step's and autograd's backward
    thread) were cut out of that working set's large blocks, and each pins its whole
    segment through the captures, the peak of reserved memory, when the graphs'
    streams no longer use them; :func:`place_workspaces` makes them again after the
    captures, where eager matmuls remain. The next step's eager allocations come
    from the driver once (``docs/memory.md`` has the measured cost)."""
    if not (active and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    if drop_workspaces and not env_flag(KEEP_CACHE_ENV):
        # Freed on their streams: the release's synchronize orders them.
        clear_cublas_workspaces()
    return release_unused_cache(torch.cuda.current_device(), "partial graphs capture")


def eager_code_remains(recordings: Sequence[TargetRecording]) -> bool:
    """Whether model code still runs eagerly beside the graphs after a capture: false
    only where whole model parts were recorded and every one of them holds a graph
    (the ``"model"`` scope: the step's forward and backward are graphs, and the eager
    code left is the optimizer's)."""
    wholes = [r for r in recordings if r.target.kind == MODEL_KIND]
    return not wholes or any(r.off_reason is not None or not r.graphs() for r in wholes)


def place_workspaces(active: bool, recordings: Sequence[TargetRecording]) -> bool:
    """After a manager's captures and the release of the unused cache (``active``,
    on CUDA, not under ``CUDAGRAPHS_KEEP_CACHE=1``), where eager model code remains
    (:func:`eager_code_remains`): make the eager cuBLAS workspaces now
    (:func:`~cudagraphs.memory.place_cublas_workspaces` says why), so the next
    backward does not cut its workspace out of the loss's blocks. Returns whether it
    did."""
    if not (active and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    if env_flag(KEEP_CACHE_ENV):
        return False
    if not eager_code_remains(recordings):
        return False
    place_cublas_workspaces(torch.cuda.current_device())
    return True


def compact_stepped(
    active: bool,
    optimizers: Sequence[torch.optim.Optimizer],
    recordings: Sequence[TargetRecording],
) -> tuple[int, int]:
    """Before a manager's captures, after the release of the unused cache (``active``,
    on CUDA, not under ``CUDAGRAPHS_KEEP_CACHE=1`` nor ``CUDAGRAPHS_COMPACT_STATE=0``):
    pack the fragmented state of ``optimizers`` (those that stepped while recording)
    that update a parameter of one of the targets of ``recordings``, on the current
    device, and give its old segments back
    (:func:`~cudagraphs.optimizer_state.compact_fragmented`: why and what moves);
    returns the bytes moved and the bytes given back."""
    if not (active and optimizers and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0, 0
    params = [p for r in recordings for p in r.target.module.parameters()]
    owned = optimizers_of(optimizers, params)
    return compact_before_capture(owned, torch.cuda.current_device(), "partial graphs capture")


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


# ---- 1. which calls ------------------------------------------------------------------


def calls_to_capture(
    recordings: Sequence[TargetRecording], recorder: Recorder, logger: logging.Logger
) -> list[Call]:
    """The recorded calls not graphed yet, as ``(recording, variant index)`` in the
    real forward order ``recorder`` saw, leaving out targets turned off; a target
    called with an object holding tensors (a KV cache) is turned off here, said on
    ``logger``.

    Raises:
        TargetSelectionError: a target ran more than once in one recorded forward (or,
            without model parts, while recording).
        CudaGraphsStateError: nothing was recorded.
    """
    repeated = [r.name for r in recordings if r.repeated]
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
        (rec, i)
        for rec in recorder.order
        for i, variant in enumerate(rec.variants)
        if variant.graph is None and rec.off_reason is None
    ]
    if not todo and not any(r.variants for r in recordings):
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


def _turn_off_stateful(recordings: Sequence[TargetRecording], logger: logging.Logger) -> None:
    # An object holding tensors (a KV cache) is state the call reads and changes: the
    # warmup and capture runs would change the recorded object (a cache grows by one
    # step per run), and a graph cannot follow the next step's object. The target runs
    # eagerly for good, said once per target.
    for rec in recordings:
        if rec.off_reason is not None:
            continue
        kinds = sorted(
            {
                type(value).__name__
                for i, variant in enumerate(rec.contracts.variants)
                if rec.variants[i].graph is None
                for _, value in variant.controls
                if holds_tensors(value)
            }
        )
        if kinds:
            rec.turn_off("stateful_argument")
            logger.warning(
                "partial graphs: %s is called with %s object(s) holding tensors (state "
                "the call changes, such as a KV cache), which no graph can follow; it "
                "runs eagerly (stats()['off_stateful_argument']). Fix: for training, "
                "call the model with use_cache=False (or set model.config.use_cache = "
                "False).",
                rec.name,
                ", ".join(kinds),
            )


# ---- 2. whole model parts first --------------------------------------------------------


def capture_model_first(
    todo: list[Call],
    recordings: Sequence[TargetRecording],
    capture: Callable[[list[Call]], list],
    *,
    activation_checkpointing: bool,
    logger: logging.Logger,
) -> list[Call]:
    """Capture the whole-part calls of ``todo`` first (through ``capture``, which
    graphs a list of calls and returns their speed verdicts), then turn off the
    targets inside each part graphed whole.

    A part refused here (activation checkpointing, a failed capture, an opaque output,
    a graph slower than eager: :mod:`.model_scope`, :mod:`.speed`) is turned off with
    the reason, said at WARNING, and its layers stay in the calls to capture.

    Returns:
        The calls left to capture, in ``todo``'s order.
    """
    whole = [call for call in todo if call[0].target.kind == MODEL_KIND]
    if not whole:
        return todo
    parts = list({id(rec): rec for rec, _ in whole}.values())  # in order, once each
    for part in parts:
        calls = [call for call in whole if call[0] is part]
        if activation_checkpointing:
            refuse_whole_part(part, "model_activation_checkpointing", CHECKPOINT_REFUSAL, logger)
            continue
        try:
            # Judged before the layers are dropped: a part slower whole keeps them.
            turn_off_slower(capture(calls), logger)
        except (CudaGraphCaptureError, CudaGraphOutputError) as exc:
            refuse_whole_part(part, "model_capture_failed", f"{type(exc).__name__}: {exc}", logger)
            continue
        opaque = sorted({name for g in part.graphs() for name in opaque_outputs(g)})
        if opaque and part.off_reason is None:
            refuse_whole_part(part, "model_opaque_output", opaque_output_fix(opaque), logger)
    inside: set[int] = set()
    for part in parts:
        modules = {id(m) for m in part.target.module.modules()}
        for other in recordings:
            if other is part or id(other.target.module) not in modules:
                continue
            if part.off_reason is None and part.graphs() and other.off_reason is None:
                other.turn_off("in_model_graph")
                inside.add(id(other))
            elif part.off_reason is not None and other.off_reason == "in_model_graph":
                # Refused at a later capture (a new variant): the layers an earlier graph
                # of the part stood for are targets again, recorded afresh next time.
                other.start_afresh()
    return [c for c in todo if c[0].target.kind != MODEL_KIND and id(c[0]) not in inside]


def refuse_whole_part(
    part: TargetRecording, reason: OffReason, why: str, logger: logging.Logger
) -> None:
    """Turn off a whole model part for ``reason`` and say why at WARNING."""
    part.turn_off(reason)
    logger.warning("%s", refused_message(part.name, reason, why))


# ---- 3. the groups and their capture ----------------------------------------------------


def capture_groups(todo: Sequence[Call], one_pool_per_call: bool) -> list[list[Call]]:
    """The recorded calls to capture together (one backend call, one pool, replayed in
    capture order), in order.

    Training calls (grad on, training flag set) form the first group. Inference
    variants (grad off or eval mode) are captured apart, one group per mode, in pools
    of their own: they run between steps, in an order of their own, and must not
    reuse the training graphs' memory. Calls recorded under different autocast
    states are captured apart too (one state per capture). With
    ``one_pool_per_call`` (activation checkpointing: a recompute replays a forward
    after later graphs ran) every call is a group of its own.
    """
    by_mode: dict[tuple[bool, bool, AutocastState], list[Call]] = {}
    for rec, i in todo:
        v = rec.contracts.variants[i]
        by_mode.setdefault((v.grad_enabled, v.training, v.autocast), []).append((rec, i))
    groups: list[list[Call]] = []
    # Training first; otherwise in the order the modes were first recorded.
    for mode in sorted(by_mode, key=lambda m: m[:2] != (True, True)):
        calls = by_mode[mode]
        groups += [[call] for call in calls] if one_pool_per_call else [calls]
    return groups


@contextmanager
def capture_modes(
    grad_enabled: bool,
    training: bool,
    modules: Sequence[nn.Module],
    autocast: AutocastState = (),
) -> Iterator[None]:
    """Grad mode, autocast state and the training flag of ``modules`` as they were
    when a variant was recorded.

    A module already in that mode is left alone (submodules may hold a mode of their
    own, such as frozen norms in eval); one that is not is switched with
    ``train(training)``, as ``model.eval()`` did, and every flag is restored after.
    Autocast is entered with its weight cache off: cast weights cached during capture
    would be freed and replayed stale (the core refuses the cache for that reason),
    and the cache changes no value, only how often weights are cast.
    """
    saved = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            if module.training != training:
                module.train(training)
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad_enabled))
            for device, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
            yield
    finally:
        for m, flag in saved:
            m.training = flag


_INNER = "inner"


class _ForwardOnly(nn.Module):
    """Runs a target's ``forward`` without the target's own module hooks.

    Why: at replay the real call goes through the target's ``__call__``, whose hooks
    run there, around the dispatching forward, once. Graphing them as well would run
    them twice, and FSDP2's are wrong to graph: when the target is itself a
    ``fully_shard`` unit, its pre-forward hook unshards and installs its own unsharded
    parameters over the ones ``functional_call`` binds, so the graph would not read
    its parameter inputs. Holding the target as a child keeps its parameters
    addressable (``inner.<name>``) for ``functional_call``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        setattr(self, _INNER, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The module's forward as it is now: while a dispatcher is installed, it
        # passes the call to the module's own forward (TargetDispatcher.passthrough).
        return getattr(self, _INNER).forward(*args, **kwargs)


#: Compiles kept for each target of a class in its code object's cache (dynamo's
#: default limit for a whole code object): its variants, training and inference.
COMPILES_PER_TARGET = 8


@dataclass
class TargetCompile:
    """How the targets' graphed functions are compiled: ``torch.compile``'s keywords
    (checked by :func:`~cudagraphs.compile_watch.check_compile_options`), and one
    function code object per target class, made on first use.

    Why one code object per class: dynamo keys its cache on a function's code object
    and holds at most ``recompile_limit`` entries there (8 by default); past that it
    runs the frame eagerly, said only in its own log, and a graph would record eager
    kernels under a compiled name. Every target's function has one source, so one
    shared code object would put every structure of a model, each variant and each
    inference mode in one cache. Per class, a model's decoder layers still share one
    compile (dynamo takes the modules as inputs), and another class (an attention, an
    MLP, another model's layers) fills a cache of its own.

    Targets of a class whose forward reads a value of its own instance (a layer index
    dynamo guards on) each compile apart in that one cache: while a target's function
    runs, dynamo's ``recompile_limit`` is at least :data:`COMPILES_PER_TARGET` for each
    target of its class, so that none of them is given up on and run eagerly.
    """

    options: dict[str, Any]
    codes: dict[type, types.CodeType] = field(default_factory=dict)
    #: Targets made per class so far.
    targets: dict[type, int] = field(default_factory=dict)

    def function(self, run: Callable[..., Any], cls: type) -> Callable[..., Any]:
        """``run`` over the code object of ``cls``, compiled (``.compiled``), called
        under the class's recompile limit."""
        code = self.codes.get(cls)
        if code is None:
            code = self.codes[cls] = run.__code__.replace(co_name=f"partial_{cls.__name__}")
        self.targets[cls] = self.targets.get(cls, 0) + 1
        fn = types.FunctionType(code, run.__globals__, run.__name__, None, run.__closure__)
        fn.__qualname__ = run.__qualname__
        compiled = torch.compile(fn, **self.options)
        targets = self.targets

        def limited(*args: Any, **kwargs: Any) -> Any:
            with recompile_limit_at_least(COMPILES_PER_TARGET * targets[cls]):
                return compiled(*args, **kwargs)

        limited.__qualname__ = run.__qualname__
        limited.compiled = compiled  # type: ignore[attr-defined]  # what torch.compile made
        return limited


def graphed_function(
    rec: TargetRecording, compiler: TargetCompile | None = None
) -> Callable[..., Any]:
    """The function graphed for a target: parameters first, as explicit inputs, then
    the recorded call. It runs the module with those tensors bound in place of its
    parameters, so the graph reads its inputs rather than captured state.

    With ``compiler`` it is that function ``torch.compile``d (:class:`TargetCompile`):
    the core's warmup compiles it (forward and, at the first backward, the backward),
    and the capture records inductor's kernels."""
    wrapper = _ForwardOnly(rec.target.module)
    names = [f"{_INNER}.{n}" for n in rec.param_names]

    def run(params: tuple, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(wrapper, dict(zip(names, params)), args, kwargs)

    run.__qualname__ = f"partial[{rec.name}]"
    if compiler is None:
        return run
    return compiler.function(run, type(rec.target.module))


def replay_from_tensors(
    graph: Any, params: tuple[torch.Tensor, ...], args: tuple | None, kwargs: dict | None
) -> Callable[[list], Any] | None:
    """The core graph's replay from a call's tensors alone
    (:meth:`~cudagraphs.core.graphed.GraphedCallable.replay_checked`), when the tensors
    the contract hands out follow the parameters in the graph's own order: exactly
    when the graph's input spec is that of ``(params, *args)`` with these keywords
    (checked once, here). ``None`` otherwise, and for any graph not the core's (a
    capture backend of the user's, or the eager one under ``CUDAGRAPHS_DISABLE``), which
    is called with the arguments."""
    if not isinstance(graph, GraphedCallable) or graph.graphs.eager_only or args is None:
        return None
    if graph.graphs.in_spec != flatten_call((tuple(params), *args), kwargs or {})[1]:
        return None
    return graph.replay_checked


def capture_calls(
    todo: list[Call],
    backend: TargetsBackend | None,
    *,
    disabled: bool,
    pooled: bool,
    speed_check: SpeedCheck | bool,
    targets: int,
    warn_once: WarnOnce,
    logger: logging.Logger,
    compiler: TargetCompile | None = None,
) -> list:
    """Graph ``todo`` through ``backend`` (``None``: the core's, sharing the buffers of
    chained calls; the eager backend when ``disabled``, said once through ``warn_once``
    with the manager's number of ``targets``), in the groups :func:`capture_groups`
    makes (one pool per call when ``pooled``: activation checkpointing), and say how
    many on ``logger``. ``compiler``: each target's function is compiled
    (:func:`graphed_function`).

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
        for group in capture_groups(todo, pooled):
            verdicts += _capture_group(
                group,
                eager_backend if disabled else backend,
                disabled,
                speed_check,
                compiler,
            )
        logger.info(
            "partial graphs: %s %d call(s)%s",
            "prepared eagerly (disabled)" if disabled else "captured",
            len(todo),
            ", one pool each (activation checkpointing)" if pooled else "",
        )
    return verdicts


def unreached_outputs(group: list[Call]) -> dict[int, frozenset[int]]:
    """Per call of ``group`` (by position), the outputs its recorded backwards never
    reached (:meth:`~.recording.RecordedVariant.unreached_outputs`: whole model parts
    only); calls with none are left out. The core captures their backward without
    those outputs, and a later backward that reaches one raises."""
    out = {}
    for j, (rec, i) in enumerate(group):
        positions = rec.variants[i].unreached_outputs()
        if positions:
            out[j] = positions
    return out


def _capture_group(
    group: list[Call],
    backend: TargetsBackend | None,
    disabled: bool,
    speed_check: SpeedCheck | bool,
    compiler: TargetCompile | None,
) -> list:
    functions, sample_args, sample_kwargs = [], [], []
    for rec, i in group:
        variant = rec.variants[i]
        functions.append(graphed_function(rec, compiler))
        sample_args.append((tuple(rec.capture_params(i)), *variant.args))
        sample_kwargs.append(variant.kwargs)
    first = group[0][0].contracts.variants[group[0][1]]
    modules = [rec.target.module for rec, _ in group]
    scope = nullcontext() if disabled else capture_scope()
    modes = capture_modes(first.grad_enabled, first.training, modules, first.autocast)
    with modes:
        with scope:
            if backend is None:
                # Ours shares buffers between the group's graphs (.chaining); a backend
                # of the user's gets the documented three arguments.
                sharing = group_sharing(group)
                graphed = list(
                    _core_backend(
                        tuple(functions),
                        tuple(sample_args),
                        sample_kwargs,
                        sharing,
                        unreached_outputs(group),
                        frozenset(
                            j for j, (rec, _) in enumerate(group) if rec.target.kind == MODEL_KIND
                        ),
                    )
                )
            else:
                graphed = list(backend(tuple(functions), tuple(sample_args), sample_kwargs))
        if len(graphed) != len(group):
            raise CudaGraphsValueError(
                f"capture_backend returned {len(graphed)} callable(s) for "
                f"{len(group)} call(s) ({[r.name for r, _ in group]}); it must "
                "return one graphed callable per call, in order"
            )
        verdicts = [] if disabled else measure_group(speed_check, group, graphed, functions)
    for (rec, i), g in zip(group, graphed):
        variant = rec.variants[i]
        params = tuple(rec.capture_params(i))
        variant.captured(g, replay_from_tensors(g, params, variant.args, variant.kwargs))
    return verdicts
