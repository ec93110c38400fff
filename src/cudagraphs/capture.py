"""Capture primitives: the one way this package turns a Python callable into a CUDA graph.

Every layer (the core helper, programs, partial graphs, serving) captures through
:func:`capture_into_graph`, so the rules below hold everywhere:

* Capture is a transaction. Everything changed for the capture (the garbage
  collector, ``cudnn.benchmark``, torch.compile's stance, the current stream, the
  caching allocator's routing into the pool) is restored in ``finally``.
* A capture that fails part way is abandoned cleanly: the stream leaves capture
  mode, the allocator stops routing this thread's allocations into the pool, and the
  caller's stream is current again. The next capture in the same pool works.
* The caller always knows the pool id, because we create one when none is given:
  the pool id is what the allocator needs to stop routing after a failure.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from .capture_state import capture_scope
from .checks import require_cuda
from .errors import (
    CudaGraphCaptureError,
    CudaGraphOutputError,
    CudaGraphsStateError,
    CudaGraphsValueError,
)
from .graph_pool import (
    GraphMemoryPool,
    GraphPool,
    PoolHandle,
    as_graph_pool,
    new_pool,
    new_torch_graph,
    pool_segments,
    side_stream,
)
from .torch_private import dynamo_loaded, end_allocate_to_pool

__all__ = [
    "GraphMemoryPool",
    "GraphPool",
    "PoolHandle",
    "as_graph_pool",
    "EagerGraph",
    "capture_eagerly",
    "capture_environment",
    "capture_into_graph",
    "capture_with_static_outputs",
    "gc_paused",
    "new_pool",
    "side_stream",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector off inside (restored to its previous state on exit)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def cudnn_benchmark_off() -> Iterator[None]:
    """``torch.backends.cudnn.benchmark`` off inside, restored on exit; nothing is
    touched when it is already off.

    Through torch's ``cudnn.flags()`` context manager, never by assignment: a process
    that froze the flags (``torch.backends.disable_global_flags()``, as torch's own
    test harness does) refuses assignment with "not allowed to set
    torch.backends.cudnn flags after disable_global_flags". Every other flag is passed
    as ``None``, which ``flags()`` leaves as it is, so only ``benchmark`` changes.
    """
    if not torch.backends.cudnn.benchmark:
        yield
        return
    keep = dict.fromkeys(inspect.signature(torch.backends.cudnn.flags).parameters)
    keep["benchmark"] = False
    with torch.backends.cudnn.flags(**keep):
        yield


@contextlib.contextmanager
def capture_environment() -> Iterator[None]:
    """Process-wide settings that must hold while a stream is being captured.

    * The garbage collector is off: a collection during capture can run a
      ``__del__`` that destroys another graph or frees a tensor with a pending
      event query, which is illegal while the stream captures.
    * ``torch.backends.cudnn.benchmark`` is off: a benchmark search inside capture
      empties the allocator cache and launches timing kernels that cannot be captured.
    * torch.compile may not recompile (``fail_on_recompile`` stance, where the
      installed torch has it): a recompilation inside capture runs Python-side guards
      and Triton autotuning, which cannot be captured and would fail obscurely.

    Every setting is restored on exit, also when the body raises.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(gc_paused())
        stack.enter_context(cudnn_benchmark_off())
        # Only when dynamo is loaded: nothing can be compiled (or recompile) otherwise,
        # and set_stance would import it, seconds of the first capture (measured on the
        # H200: 3.4 s of a 16-layer decoder's first capture went to that import).
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is not None and dynamo_loaded():
            stack.enter_context(set_stance("fail_on_recompile"))
        yield


def _abandon_capture(
    graph: torch.cuda.CUDAGraph, device: int, pool: PoolHandle, *, end_capture: bool
) -> None:
    """Leave capture mode after a failure inside a capture.

    ``CUDAGraph.capture_end`` raises when the capture was invalidated (for example by
    a host sync), and depending on the torch version it raises before telling the
    caching allocator that the capture is over. We therefore (1) end the stream
    capture unless capture_end itself is what failed (``cudaStreamEndCapture`` leaves
    capture mode even when it reports the invalidation), and (2) end the allocator's
    routing into the pool ourselves. Both steps tolerate having been done already.
    The stream's capture status is not consulted: an invalidated capture may report
    itself as not capturing while the stream still sits in capture mode.
    """
    if end_capture:
        try:
            graph.capture_end()
        except Exception as exc:  # the capture is known to be broken; the cause is re-raised
            logger.debug("capture_end of an abandoned capture reported: %s", exc)
    # Raises when capture_end already ended the routing: nothing left to undo then.
    with contextlib.suppress(Exception):
        end_allocate_to_pool(device, pool)


def _repair_generators(stream: torch.cuda.Stream) -> None:
    """Take the CUDA random generators out of capture mode after a failed capture.

    When ``capture_end`` fails, torch skips the generators' capture epilogue, and every
    later eager random op raises "Offset increment outside graph capture". A capture
    that succeeds runs prologue and epilogue again, so we capture a trivial graph into
    a throwaway pool and drop it.
    """
    buffer = torch.zeros(1, device=stream.device)
    graph = new_torch_graph(keep_graph=False)
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(
                pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local"
            )
            try:
                buffer.zero_()
            finally:
                graph.capture_end()
    except Exception as exc:
        logger.warning("could not reset the CUDA generators after a failed capture: %s", exc)


def _begin_options(capture_error_mode: str, check_input_liveness: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"capture_error_mode": capture_error_mode}
    if check_input_liveness:
        if (
            "check_input_liveness"
            in inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters
        ):
            options["check_input_liveness"] = True
        else:
            logger.debug("this torch has no check_input_liveness; capturing without it")
    return options


def capture_into_graph(
    run: Callable[[], T],
    pool: GraphMemoryPool | PoolHandle | None = None,
    *,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "thread_local",
    keep_graph: bool = False,
    check_input_liveness: bool = False,
    what: str = "callable",
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``run()`` into a new CUDA graph whose memory comes from ``pool``.

    Args:
        run: called once, with the capture stream current; its CUDA work is recorded,
            not executed. Whatever it returns is returned as ``output``: tensors in it
            live in the pool and are overwritten by every replay.
        pool: the :class:`GraphMemoryPool` shared with other graphs (:func:`new_pool`), a
            raw torch pool handle (wrapped; see :func:`as_graph_pool`), or ``None`` for
            a new pool. Graphs sharing a pool must be replayed in an order where no
            graph reads memory that a later-captured graph reuses; in practice,
            replay in capture order.
        stream: side stream to capture on; ``None`` for the pool's
            :meth:`GraphMemoryPool.capture_stream` (warm up in :meth:`GraphMemoryPool.warmup_scope`,
            which runs on the capture stream only while it routes the warmup's memory
            into the pool). Work
            already queued on the device is finished before capture starts.
        capture_error_mode: ``"thread_local"`` (default: other threads' unsafe CUDA
            calls cannot invalidate this capture), ``"global"`` or ``"relaxed"``.
        keep_graph: keep the ``cudaGraph_t`` after capture so that
            :mod:`cudagraphs.introspect` can inspect it; instantiation then happens on
            the first replay or an explicit ``graph.instantiate()``.
        check_input_liveness: ask torch to track tensors the graph reads from outside
            its pool and fail a replay after one was freed (torch versions that have
            it; ignored with a debug log elsewhere).
        what: a name for error messages (a module name, a bucket).

    Returns:
        ``(graph, output)``.

    Raises:
        CudaGraphsValueError: unknown ``capture_error_mode``.
        NoCudaDeviceError: torch finds no usable CUDA device.
        CudaGraphCaptureError: ``run`` raised or the capture was invalidated. The
            cause is chained. The allocator, the current stream, the random
            generators and the global settings are restored, and ``pool`` moved to a
            fresh handle, so another capture into it may follow at once.
    """
    if capture_error_mode not in _CAPTURE_ERROR_MODES:
        raise CudaGraphsValueError(
            f"capture_error_mode must be one of {_CAPTURE_ERROR_MODES}, got {capture_error_mode!r}"
        )
    require_cuda(f"capture of {what}")
    if torch.cuda.is_current_stream_capturing():
        raise CudaGraphCaptureError(
            f"cannot capture {what}: the current stream is already capturing; "
            "nested captures are not supported"
        )
    device = torch.cuda.current_device()
    pool = as_graph_pool(pool)
    stream = pool.capture_stream(device) if stream is None else stream
    caller_stream = torch.cuda.current_stream(device)
    graph = new_torch_graph(keep_graph)
    # The capture records work; it must not overlap work still queued for the buffers
    # it reads (warmup outputs, freshly copied inputs).
    torch.cuda.synchronize(device)
    with capture_environment(), capture_scope(), pool_segments():
        handle = pool.prepare(stream)
        pool.mark_captured()
        torch.cuda.set_stream(stream)
        try:
            graph.capture_begin(
                pool=handle, **_begin_options(capture_error_mode, check_input_liveness)
            )
            try:
                output = run()
            except BaseException:
                _abandon_capture(graph, device, handle, end_capture=True)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _abandon_capture(graph, device, handle, end_capture=False)
                raise
        except Exception as exc:
            torch.cuda.set_stream(caller_stream)
            pool.retire()
            _repair_generators(stream)
            raise CudaGraphCaptureError(
                f"capture of {what} failed: {type(exc).__name__}: {exc}. "
                f"{_failure_hint(str(exc))}The allocator and stream were restored, so fix "
                "the code and capture again."
            ) from exc
        finally:
            torch.cuda.set_stream(caller_stream)
    return graph, output


def _failure_hint(message: str) -> str:
    if "appears to not have been used in the graph" in message:
        # autograd.grad's refusal of an unused input: with num_warmup_iters=0 the
        # capture is the first backward, so the warmup's own check never ran.
        return (
            "An input or parameter that requires grad is not used by the forward, so it "
            "can get no gradient. Fixes: 1. allow_unused_input=True (its gradient is "
            "then None); 2. requires_grad=False on it. "
        )
    if "legacy stream" in message:
        # Seen on torch 2.11: autograd runs a leaf's AccumulateGrad on the stream it was
        # created on, and an eager graph still alive keeps that node (default stream).
        return (
            "Work went to the default (legacy) stream during capture. In a backward "
            "capture this usually means something holds the parameters' AccumulateGrad "
            "nodes, made on the default stream: 1. an eager autograd graph still alive "
            "(a `loss` or output of an earlier eager step): drop it (del loss) before "
            "capturing; 2. a data-parallel wrapper that keeps them for its gradient "
            "hooks (Megatron's DDP): build it under a side stream (`with "
            "torch.cuda.stream(torch.cuda.Stream()):`), as Megatron's training does. "
        )
    return (
        "Common causes: a host sync (.item(), .cpu(), printing a CUDA tensor, "
        "data-dependent shapes) or an op that allocates pinned memory inside the "
        "captured code. "
    )


def capture_with_static_outputs(
    run: Callable[[], Any],
    like: Any,
    pool: GraphMemoryPool | PoolHandle | None = None,
    **capture_kwargs: Any,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``run()`` and end the graph with a copy of its outputs into buffers
    allocated outside ``pool``.

    Use this for graphs that share a pool but replay in a data-dependent order: the
    pool's memory may be reused by another graph's replay, while the static outputs
    here stay valid until *this* graph replays again.

    Args:
        run: the work to capture; returns a tree of tensors (and other leaves).
        like: a tree of the same structure (for example the output of a warmup call):
            its tensor leaves give the shapes, dtypes and devices of the buffers.
        pool, capture_kwargs: as for :func:`capture_into_graph`.

    Returns:
        ``(graph, static_outputs)``: a tree like ``like`` whose tensors are owned by the
        caller, outside the pool, and overwritten by each replay of ``graph``.

    Raises:
        CudaGraphCaptureError: the capture failed, or ``run`` returned a tree whose
            structure, shapes or dtypes differ from ``like`` (the message lists every
            difference).
    """
    like_leaves, like_spec = pytree.tree_flatten(like)
    # Allocated before capture begins, so the buffers come from the ordinary allocator.
    buffers = [
        torch.empty_like(x, requires_grad=False) if isinstance(x, torch.Tensor) else x
        for x in like_leaves
    ]

    def run_and_copy() -> Any:
        out_leaves, out_spec = pytree.tree_flatten(run())
        problems = _describe_mismatch(like_leaves, like_spec, out_leaves, out_spec)
        if problems:
            raise CudaGraphsValueError("output differs from `like`: " + "; ".join(problems))
        # Plain data movement: the static outputs must carry no autograd history.
        with torch.no_grad():
            for buf, out in zip(buffers, out_leaves):
                if isinstance(buf, torch.Tensor):
                    buf.copy_(out)
        return None

    graph, _ = capture_into_graph(run_and_copy, pool, **capture_kwargs)
    return graph, pytree.tree_unflatten(buffers, like_spec)


def _describe_mismatch(
    like_leaves: list[Any], like_spec: Any, out_leaves: list[Any], out_spec: Any
) -> list[str]:
    if like_spec != out_spec:
        return [f"tree structure {out_spec} != expected {like_spec}"]
    problems = []
    for i, (a, b) in enumerate(zip(like_leaves, out_leaves)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            problems.append(f"leaf {i}: {type(b).__name__} != expected {type(a).__name__}")
        elif isinstance(a, torch.Tensor) and (a.shape, a.dtype) != (b.shape, b.dtype):
            problems.append(
                f"leaf {i}: {tuple(b.shape)}/{b.dtype} != expected {tuple(a.shape)}/{a.dtype}"
            )
    return problems


class EagerGraph:
    """Stands in for a captured graph when graphs are disabled (``CUDAGRAPHS_DISABLE``).

    ``replay()`` runs the function eagerly and copies what it returns into the static
    output buffers made by :func:`capture_eagerly`, so a caller keeps reading the same
    (borrowed) output tree that a real graph's replay overwrites: the layer above runs
    its usual code path, only the kernels are launched one by one.
    """

    def __init__(self, run: Callable[[], Any], static: list[Any], spec: Any, what: str) -> None:
        self._run, self._static, self._spec, self._what = run, static, spec, what
        self.replays = 0

    def replay(self) -> None:
        if self._run is None:
            raise CudaGraphsStateError(f"{self._what}: replay() after reset()")
        leaves, spec = pytree.tree_flatten(self._run())
        problems = _describe_mismatch(self._static, self._spec, leaves, spec)
        if problems:
            # A real graph would replay the captured kernels; an eager run that changes
            # its outputs cannot stand in for it.
            raise CudaGraphOutputError(
                f"{self._what}: run eagerly (graphs disabled), it returned outputs that "
                "differ from its first run: " + "; ".join(problems) + ". Return the same "
                "output tree and shapes for every call, as a graph would."
            )
        pairs = [(b, x) for b, x in zip(self._static, leaves) if isinstance(b, torch.Tensor)]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([b for b, _ in pairs], [x for _, x in pairs])
        self.replays += 1

    def reset(self) -> None:
        self._run = self._static = None


def capture_eagerly(
    run: Callable[[], Any], like: Any = None, *, what: str = "callable"
) -> tuple[EagerGraph, Any]:
    """The eager stand-in for :func:`capture_with_static_outputs`: no capture, no pool.

    Args:
        run: the work a graph would hold; returns a tree of tensors and other leaves.
        like: a tree its outputs look like (sizes the static buffers); ``None`` runs
            ``run()`` once for it.
        what: a name for error messages.

    Returns:
        ``(graph, static_outputs)``: ``graph.replay()`` runs ``run`` and copies its
        outputs into ``static_outputs`` (detached tensors owned by the caller).
    """
    if like is None:
        like = run()
    leaves, spec = pytree.tree_flatten(like)
    static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    return EagerGraph(run, static, spec, what), pytree.tree_unflatten(static, spec)
