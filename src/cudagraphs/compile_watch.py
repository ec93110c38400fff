"""What ``torch.compile`` compiled while a phase ran: inductor's kernels inside our
graphs, checked before they are captured.

A compiled model or step can be warmed up and captured like eager code (its kernels
are recorded as any others), with three ways to go wrong that surface far from their
cause:

* a compile during capture: dynamo recompiles when a guard fails (a Python value the
  compiled code read has changed, a shape, grad mode), and compiling inside a stream
  capture either fails (autotuning and cache lookups sync with the device) or bakes
  a first-call path into the graph;
* a step that still compiles in the warmup step just before capture: the capture
  would then be the first run of code compiled for a state it may not see again;
* ``mode="reduce-overhead"``: torch's own CUDA graphs (cudagraph trees) inside ours;
* a frame dynamo gives up on (its recompile limit, most often): it runs eagerly, and
  the graph records eager kernels under a compiled name.

:class:`CompileWatch` collects dynamo's compilation records (``CompiledFrame``) made
between its start and its end; :func:`require_no_compile` turns records where there
must be none into a :class:`~cudagraphs.errors.CompiledCaptureError` that names each
frame, dynamo's reason and the fix; :func:`warn_failed_compiles` says each frame given
up; :func:`check_warmup` makes the checks of a warmup before a capture.
:func:`check_compile_options` says which ``torch.compile`` options may go inside our
graphs. Nothing is imported or read when dynamo was never
loaded: then nothing can have been compiled.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from .checks import check_instance
from .errors import CompiledCaptureError, CudaGraphsValueError
from .torch_private import (
    compilation_metrics,
    compile_backends,
    compile_modes,
    cudagraph_tree_functions,
    dynamo_loaded,
    inductor_records_graphs,
    mode_options,
)

__all__ = [
    "GRAPH_RECORDING_MODES",
    "CompileReport",
    "CompileWatch",
    "CompiledFrame",
    "check_compile_options",
    "check_warmup",
    "recompile_fix",
    "require_no_compile",
    "require_no_torch_graphs",
    "warn_failed_compiles",
]


@dataclass(frozen=True)
class CompiledFrame:
    """One frame dynamo compiled (one compilation record)."""

    name: str  # the function's name (its code object's)
    where: str  # "file:line" of the function
    compile_id: str  # dynamo's "frame/recompile" id
    seconds: float  # dynamo's time for the frame, the backward's compile included
    recompile_reason: str | None  # the guard that failed, for a recompile
    graph_breaks: int
    # Why dynamo gave the frame up (its fail type and the first line of its reason):
    # the frame then runs eagerly. None for a frame compiled.
    failure: str | None = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.where}, compile {self.compile_id})"


@dataclass(frozen=True)
class CompileReport:
    """The frames compiled during one phase, in the order dynamo compiled them."""

    frames: tuple[CompiledFrame, ...] = ()
    # Functions torch.compile's own CUDA graphs (mode="reduce-overhead") warmed up or
    # recorded during the phase.
    torch_graphs: int = 0

    @property
    def seconds(self) -> float:
        return sum(f.seconds for f in self.frames)

    @property
    def recompiles(self) -> tuple[CompiledFrame, ...]:
        return tuple(f for f in self.frames if f.recompile_reason)

    @property
    def graph_breaks(self) -> int:
        return sum(f.graph_breaks for f in self.frames)

    @property
    def failures(self) -> tuple[CompiledFrame, ...]:
        """Frames dynamo gave up on: they run eagerly."""
        return tuple(f for f in self.frames if f.failure)

    @property
    def compiled(self) -> tuple[CompiledFrame, ...]:
        """Frames dynamo compiled (not given up on)."""
        return tuple(f for f in self.frames if not f.failure)

    def __add__(self, other: CompileReport) -> CompileReport:
        return CompileReport(self.frames + other.frames, self.torch_graphs + other.torch_graphs)


class CompileWatch:
    """Collects what dynamo compiles between :meth:`start` and :meth:`finish`.

    Records are matched by their start time, so records made before the watch (an
    earlier compile of the same function) are never counted, and nothing else of
    dynamo's state is changed."""

    __slots__ = ("_device_index", "_since_us", "_trees")

    def __init__(self, since_us: int, device_index: int | None, trees: int) -> None:
        self._since_us = since_us
        self._device_index = device_index
        self._trees = trees

    @classmethod
    def start(cls, device_index: int | None = None) -> CompileWatch:
        """Watch from now; ``device_index``: also count the functions torch's CUDA-graph
        trees run on that device."""
        trees = cudagraph_tree_functions(device_index) if device_index is not None else 0
        return cls(time.time_ns() // 1000, device_index, trees)

    def finish(self) -> CompileReport:
        if not dynamo_loaded():
            return CompileReport()
        records = list(compilation_metrics())
        frames = _merged(
            _frame(m) for m in records if (getattr(m, "start_time_us", None) or 0) >= self._since_us
        )
        if any(f.failure and f.name == "?" for f in frames):  # rare: read every record
            frames = _named_failures(frames, [_frame(m) for m in records])
        trees = 0
        if self._device_index is not None:
            trees = cudagraph_tree_functions(self._device_index) - self._trees
        return CompileReport(tuple(frames), max(0, trees))


def _frame(record: Any) -> CompiledFrame:
    def number(name: str) -> float:
        value = getattr(record, name, None)
        return float(value) if value else 0.0

    filename = getattr(record, "co_filename", None) or "?"
    line = getattr(record, "co_firstlineno", None)  # the function's first line
    return CompiledFrame(
        name=str(getattr(record, "co_name", None) or "?"),
        where=f"{filename}:{line}" if line else str(filename),
        compile_id=str(getattr(record, "compile_id", None) or "?"),
        seconds=number("entire_frame_compile_time_s")
        + number("backward_cumulative_compile_time_us") / 1e6,
        recompile_reason=(getattr(record, "recompile_reason", None) or None),
        graph_breaks=int(number("num_graph_breaks")),
        failure=_failure(record),
    )


def _merged(frames: Iterable[CompiledFrame]) -> list[CompiledFrame]:
    """One frame per compile: a record without a code name whose compile id a named
    frame of the watch has is a later record of that compile, not a frame of its own
    (on the H100, a compile with an empty inductor cache logs a second, nameless record
    of 0 s under the frame's id; a warm one does not). Its seconds and graph breaks go
    to the named frame."""
    frames = list(frames)
    named = {f.compile_id: i for i, f in enumerate(frames) if f.name != "?"}
    out: list[CompiledFrame | None] = list(frames)
    for i, frame in enumerate(frames):
        owner = named.get(frame.compile_id)
        if frame.name != "?" or frame.compile_id == "?" or owner is None or frame.failure:
            continue
        kept = out[owner]
        out[owner] = replace(
            kept,
            seconds=kept.seconds + frame.seconds,
            graph_breaks=kept.graph_breaks + frame.graph_breaks,
        )
        out[i] = None
    return [f for f in out if f is not None]


def _named_failures(frames: list[CompiledFrame], every: list[CompiledFrame]) -> list[CompiledFrame]:
    """``frames`` with each nameless frame dynamo gave up on named after a record of
    the same frame (its compile id's part before ``/``) from any time: dynamo's record
    of a frame given up at its recompile limit carries no code name or file."""
    known = {}
    for f in every:
        if f.name != "?":
            known.setdefault(f.compile_id.split("/")[0], f)
    out = []
    for f in frames:
        named = known.get(f.compile_id.split("/")[0]) if f.failure and f.name == "?" else None
        out.append(f if named is None else replace(f, name=named.name, where=named.where))
    return out


def _failure(record: Any) -> str | None:
    kind = getattr(record, "fail_type", None)
    if not kind:
        return None
    reason = str(getattr(record, "fail_reason", None) or "").strip().splitlines()
    return f"{kind}: {reason[0]}" if reason else str(kind)


#: Words of dynamo's failed tensor guards (and of symbolic-shape guards): a shape.
SHAPE_GUARD_WORDS = ("size mismatch", "stride mismatch", "rank mismatch", ".size()", ".stride()")
#: Words of a failed guard on grad mode or autocast.
MODE_GUARD_WORDS = ("grad_mode", "global_state", "autocast")


def recompile_fix(reason: str) -> str:
    """What to change for a recompile whose failed guard is ``reason`` (dynamo's text).

    Only the guards are read, each line up to its ``#``: dynamo follows each with the
    source line that read the value, whose words (``dim=-1``, ``window_size``) say
    nothing of what changed."""
    guards = " ".join(line.split("#", 1)[0] for line in reason.lower().splitlines())
    if any(w in guards for w in SHAPE_GUARD_WORDS):
        return (
            "a tensor's shape or strides changed between steps: graphs have fixed shapes, "
            "so give every step inputs of one shape (pad them), or compile with "
            "dynamic=False so that each shape is compiled once and can be warmed up"
        )
    if any(w in guards for w in MODE_GUARD_WORDS):
        return (
            "grad mode or autocast differed from the warmup's: run warmup and capture "
            "under the same modes as the steps themselves"
        )
    if ".training ==" in guards:
        return (
            "a module's train/eval mode differed from the warmup's: call model.train() "
            "or model.eval() before warmup and capture, as the graphed steps run"
        )
    return (
        "the compiled code reads a Python value that changed between steps (a step "
        "counter, a float hyperparameter, an attribute): hold it in a device tensor "
        "updated in place, or keep it constant while graphed"
    )


def require_no_compile(
    report: CompileReport, phase: str, what: str, cause: BaseException | None = None
) -> None:
    """Raise when ``report`` holds any frame: ``phase`` (``"the capture"``, ``"the
    last warmup step"``) must compile nothing. ``cause``: the error the phase raised,
    chained to ours.

    Raises:
        CompiledCaptureError: naming every frame, its failed guard and the fix.
    """
    frames = report.compiled  # frames given up: see warn_failed_compiles
    if not frames:
        return
    lines = []
    for f in frames:
        if f.recompile_reason:
            reason = " ".join(f.recompile_reason.split())
            lines.append(f"- {f.label}: recompiled because {reason}; {recompile_fix(reason)}")
        else:
            lines.append(
                f"- {f.label}: compiled for the first time; warm up with more steps "
                "(each must run the compiled code as the graphed steps will)"
            )
    raise CompiledCaptureError(
        f"{what}: torch.compile compiled {len(frames)} frame(s) during {phase}, "
        "which must run code compiled before it:\n" + "\n".join(lines)
    ) from cause


def warn_failed_compiles(report: CompileReport, what: str, logger: logging.Logger) -> int:
    """Say at WARNING each frame of ``report`` that dynamo gave up on (it runs eagerly,
    so the graph records its eager kernels); returns how many.

    Why a warning: the graph stays correct, and dynamo gives frames up for reasons a
    user may accept; but a compiled step that silently is not compiled is what this
    package must not leave unsaid. The usual cause is dynamo's recompile limit: at most
    dynamo's ``config.recompile_limit`` (8) compiles per function, each shape,
    guarded Python value or module structure its own. A frame given up before the
    warmup (the limit already reached) leaves no record, and is not seen here.
    """
    failed = report.failures
    for f in failed:
        fix = (
            "fewer distinct shapes, guarded Python values or module structures through "
            "this function, or a larger recompile_limit in dynamo's config"
            if "recompile limit" in (f.failure or "").lower()
            else "the cause dynamo names (TORCH_LOGS=graph_breaks,recompiles)"
        )
        logger.warning(
            "%s: dynamo gave up compiling %s (%s): it runs eagerly, and the graph records "
            "its eager kernels. Fix: %s.",
            what,
            f.label,
            f.failure,
            fix,
        )
    return len(failed)


def check_warmup(
    total: CompileReport, last: CompileReport, what: str, last_phase: str, logger: logging.Logger
) -> None:
    """What a warmup before a capture must show: no CUDA-graph trees of torch's over the
    whole warmup (``total``), nothing compiled in its last iteration (``last``, called
    ``last_phase``), and every frame dynamo gave up on said (:func:`warn_failed_compiles`).

    Raises:
        CompiledCaptureError: as :func:`require_no_torch_graphs` and
            :func:`require_no_compile`.
    """
    require_no_torch_graphs(total, what)
    warn_failed_compiles(total, what, logger)
    require_no_compile(last, last_phase, what)


def require_no_torch_graphs(report: CompileReport, what: str) -> None:
    """Raise when torch.compile's own CUDA graphs ran during the phase of ``report``.

    Raises:
        CompiledCaptureError: naming the mode and the fix.
    """
    if report.torch_graphs:
        raise CompiledCaptureError(
            f"{what}: the compiled code runs torch.compile's own CUDA graphs "
            f'(mode="reduce-overhead": {report.torch_graphs} function(s) warmed up or '
            "recorded), which cannot be captured inside ours. Compile with "
            'mode="default" or mode="max-autotune-no-cudagraphs": our graph takes the '
            "place of torch's."
        )


#: torch.compile modes that turn on inductor's CUDA-graph trees.
GRAPH_RECORDING_MODES = ("reduce-overhead", "max-autotune")


def check_compile_options(where: str, options: Any) -> dict[str, Any] | None:
    """A copy of ``options`` (``None`` stays ``None``), keywords for ``torch.compile``,
    after checking that what they compile can be captured in our graphs.

    Inductor's fused kernels capture like any others. What cannot go in is inductor's
    own graph recording: the ``reduce-overhead`` and ``max-autotune`` modes (and
    ``options={"triton.cudagraphs": True}``) wrap the compiled code in CUDA-graph
    trees, which record graphs of their own on their own pool at the first calls:
    inside our capture that is a capture within a capture, and beside it a second
    copy of every graph.

    Raises:
        CudaGraphsTypeError: ``options`` not a mapping.
        CudaGraphsValueError: a keyword ``torch.compile`` does not take, a mode or
            backend name it does not know, a mode together with ``options`` (it takes
            one or the other), or a mode, option or backend that makes inductor or
            dynamo record CUDA graphs of their own.

    Keywords ``torch.compile`` does not take, and modes it does not know, are refused
    here rather than at the first compile, which runs inside a warmup (in a Trainer,
    after the first steps) and would fail again at every retry.
    """
    check_instance("compile_options", options, (Mapping, type(None)), "a mapping of keywords")
    if options is None:
        return None
    parameters = inspect.signature(torch.compile).parameters
    known = [k for k in parameters if k != "model"]
    # A torch.compile wrapped to take any keyword (a patch, a shim) says nothing of them.
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [] if takes_any else sorted(str(k) for k in options if k not in known)
    if unknown:
        raise CudaGraphsValueError(
            f"{where}: compile_options has {', '.join(map(repr, unknown))}, which "
            f"torch.compile does not take (its keywords: {', '.join(known)}). Fix: spell "
            "them as torch.compile does; inductor's own settings go in 'options'"
        )
    mode = options.get("mode")
    if mode is not None and mode not in compile_modes():
        raise CudaGraphsValueError(
            f"{where}: compile_options has mode={mode!r}, which torch.compile does not "
            f"know (its modes: {', '.join(compile_modes())}). Fix: leave 'mode' out, or "
            "use 'max-autotune-no-cudagraphs'"
        )
    inner = options.get("options")
    if mode is not None and inner is not None:
        merged = {**mode_options(mode), **inner} if isinstance(inner, Mapping) else None
        fix = (
            f"pass options={merged!r} without 'mode' (the mode's settings and yours)"
            if merged is not None
            else "leave 'mode' out and put its settings in 'options'"
        )
        raise CudaGraphsValueError(
            f"{where}: compile_options has both mode={mode!r} and 'options', and "
            f"torch.compile takes one or the other. Fix: {fix}"
        )
    backend = options.get("backend")
    if isinstance(backend, str) and backend not in compile_backends():
        raise CudaGraphsValueError(
            f"{where}: compile_options has backend={backend!r}, which torch.compile does "
            f"not know (its backends: {', '.join(compile_backends())}). Fix: leave "
            "'backend' out (inductor), or name one of those"
        )
    if options.get("backend") == "cudagraphs":
        raise CudaGraphsValueError(
            f"{where}: compile_options with backend='cudagraphs' make dynamo record CUDA "
            "graphs of its own (CUDA-graph trees); our graphs already record the "
            "kernels, and a recording inside their capture fails. Fix: leave 'backend' "
            "out (inductor's kernels), or use 'aot_eager' for the model's own kernels"
        )
    trees = isinstance(inner, Mapping) and bool(inner.get("triton.cudagraphs"))
    if mode in GRAPH_RECORDING_MODES or trees:
        said = f"mode={mode!r}" if mode in GRAPH_RECORDING_MODES else "triton.cudagraphs=True"
        raise CudaGraphsValueError(
            f"{where}: compile_options with {said} make inductor record CUDA graphs of its "
            "own (CUDA-graph trees); our graphs already record the compiled kernels, and "
            "a recording inside their capture fails. Fixes: 1. leave 'mode' out "
            "(inductor's default kernels); 2. mode='max-autotune-no-cudagraphs' for "
            "autotuned kernels without graphs of their own."
        )
    inductor = options.get("backend", "inductor") == "inductor"
    stated = isinstance(inner, Mapping) and "triton.cudagraphs" in inner
    if inductor and not stated and inductor_records_graphs():
        raise CudaGraphsValueError(
            f"{where}: inductor's own config records CUDA graphs (its triton.cudagraphs "
            "is True, as TORCHINDUCTOR_CUDAGRAPHS=1 sets it), so these compile_options "
            "would make CUDA-graph trees inside our "
            "graphs, whose capture they fail. Fixes: 1. unset TORCHINDUCTOR_CUDAGRAPHS (or "
            "the config); 2. pass options={'triton.cudagraphs': False} in compile_options"
        )
    try:
        # What torch.compile refuses of its keywords' values (``dynamic="yes"``, ...) it
        # refuses here, before anything compiles; the function is never called. A
        # wrapped torch.compile (a patch, a shim) is not called for this.
        if not takes_any:
            torch.compile(_never_called, **options)
    except Exception as exc:  # torch's refusals share no base class
        said = str(exc).strip().splitlines()
        raise CudaGraphsValueError(
            f"{where}: compile_options has values torch.compile refuses "
            f"({type(exc).__name__}: {said[0] if said else ''}). Fix: pass values of the "
            "kinds torch.compile documents for each keyword"
        ) from exc
    return dict(options)


def _never_called() -> None:
    """What :func:`check_compile_options` hands ``torch.compile`` to check its keywords."""
