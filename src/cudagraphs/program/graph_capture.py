"""Capturing a program: warm up, fill the input buffer, capture the function into its
own pool or into a shared one (outputs then copied out of the shared scratch), with
inputs staged by copies or inside the graph (:mod:`.staging`); the result is one
frozen :class:`CapturedProgram` that ``CudaGraphProgram``'s constructor takes. Runs
once per program, never on the replay path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..capture import (
    GraphPool,
    capture_eagerly,
    capture_into_graph,
    capture_with_static_outputs,
)
from ..settings import DISABLE_ENV
from .buffer import ReusableValueBuffer
from .capture_steps import check_output_device, detached, output_signature, warm_up
from .leaves import LeafTypes
from .pool import CudaGraphCaptureStats, CudaGraphPool
from .signature import ValueTreeSignature
from .staging import GraphStaging, choose_staging, runtime_for, staged_arguments

__all__ = [
    "CapturedGraph",
    "CapturedProgram",
    "capture_function",
    "capture_program",
    "run_function_eagerly",
]

logger = logging.getLogger(__name__)


@dataclass
class CapturedGraph:
    """What capturing a program's function produced."""

    graph: torch.cuda.CUDAGraph
    output: Any  # the borrowed output tree the graph writes
    out_sig: ValueTreeSignature
    staging: GraphStaging | None  # inputs the graph copies from the caller's tensors


@dataclass(frozen=True)
class CapturedProgram:
    """Everything a program is made of, as its capture left it."""

    function: Callable[..., Any]
    name: str
    device: torch.device
    signature: ValueTreeSignature
    leaf_types: LeafTypes | None
    pool: CudaGraphPool | None  # shared scratch, or None
    graph_pool: GraphPool | None  # the program's own pool; None in a shared one
    buffer: ReusableValueBuffer  # the fixed input buffer, holding the example inputs
    captured: CapturedGraph
    last: Any  # the last warmup output (None without warmup)
    warmup_iterations: int
    warmup_seconds: float
    capture_seconds: float

    def stats(self, first_replay_seconds: float = 0.0) -> CudaGraphCaptureStats:
        """The capture's costs, with the allocator's figures as of now."""
        return CudaGraphCaptureStats(
            warmup_iterations=self.warmup_iterations,
            warmup_seconds=self.warmup_seconds,
            capture_seconds=self.capture_seconds,
            first_replay_seconds=first_replay_seconds,
            memory_allocated_bytes=torch.cuda.memory_allocated(self.device),
            memory_reserved_bytes=torch.cuda.memory_reserved(self.device),
        )


def capture_program(
    function: Callable[..., Any],
    inputs: tuple,
    signature: ValueTreeSignature,
    device: torch.device,
    *,
    warmup: int,
    pool: CudaGraphPool | None,
    leaf_types: LeafTypes | None,
    check_input_liveness: bool,
    staging: str,
    disabled: bool,
) -> CapturedProgram:
    """Warm up ``function`` on fresh buffers, copy ``inputs`` into the program's buffer
    and capture (or, ``disabled``: set up the eager stand-in). Call with ``device``
    current. Raises what warm-up and capture raise (``CudaGraphCaptureError``)."""
    name = getattr(function, "__qualname__", type(function).__name__)
    # Programs of one pool share its capture stream, and so one cuBLAS workspace, made
    # inside the pool (GraphPool.capture_stream); warmups run on its warmup stream.
    graph_pool = pool.graph_pool if pool is not None else GraphPool()
    t0 = time.perf_counter()
    last = None
    if not disabled:
        last = warm_up(
            function, signature, inputs, device, warmup, graph_pool.warmup_stream(device), name
        )
    t1 = time.perf_counter()
    buffer = ReusableValueBuffer(signature, device)
    buffer.copy_from(inputs, path="inputs")
    if disabled:
        captured = run_function_eagerly(function, buffer, leaf_types, name)
    else:
        captured = capture_function(
            function,
            buffer,
            last=last,
            graph_pool=graph_pool,
            stream=graph_pool.capture_stream(device),
            shared_pool=pool is not None,
            leaf_types=leaf_types,
            name=name,
            check_input_liveness=check_input_liveness,
            staging=staging,
        )
    return CapturedProgram(
        function=function,
        name=name,
        device=device,
        signature=signature,
        leaf_types=leaf_types,
        pool=pool,
        graph_pool=graph_pool if pool is None else None,
        buffer=buffer,
        captured=captured,
        last=last,
        warmup_iterations=warmup,
        warmup_seconds=t1 - t0,
        capture_seconds=time.perf_counter() - t1,
    )


def capture_function(
    function: Callable[..., Any],
    buffer: ReusableValueBuffer,
    *,
    last: Any,
    graph_pool: GraphPool,
    stream: torch.cuda.Stream,
    shared_pool: bool,
    leaf_types: LeafTypes | None,
    name: str,
    check_input_liveness: bool,
    staging: str,
) -> CapturedGraph:
    """Capture ``function`` reading ``buffer``; ``last`` is the last warmup output
    (it sizes the retained outputs of a program in a shared pool)."""
    runtime = runtime_for(staging)
    mode = choose_staging(staging, buffer.tensors, runtime is not None)
    signature, device = buffer.signature, buffer.device
    inner_ptrs: dict[int, int] = {}

    def call() -> Any:
        if mode == "copy":
            return function(*buffer.value)
        tensors, ptrs = staged_arguments(buffer.tensors)
        inner_ptrs.update(ptrs)
        return function(*signature.rebuild(tensors))

    opts = {
        "stream": stream,
        "check_input_liveness": check_input_liveness,
        "what": f"program {name}",
        # The cudaGraph_t stays alive for in-graph staging: node updates name nodes
        # of the graph the executable graph was instantiated from.
        "keep_graph": mode == "graph",
    }
    if not shared_pool:
        graph, raw_output = capture_into_graph(call, graph_pool, **opts)
        try:
            # Detached views of the graph's output memory: the captured autograd graph
            # is not kept alive through them.
            output = detached(raw_output, leaf_types)
            out_sig = output_signature(output, leaf_types)
            check_output_device(out_sig.flatten(output), device)
            return CapturedGraph(
                graph, output, out_sig, _staging(graph, buffer, runtime, inner_ptrs)
            )
        except Exception:
            graph.reset()
            raise
    # Retained outputs are copied, inside the graph, into buffers allocated outside the
    # shared scratch, so other programs' replays cannot overwrite them.
    out_sig = output_signature(detached(last, leaf_types), leaf_types)
    like = out_sig.flatten(detached(last, leaf_types), path="output")
    check_output_device(like, device)
    graph, static = capture_with_static_outputs(
        lambda: out_sig.flatten(detached(call(), leaf_types), path="output"),
        like,
        graph_pool,
        **opts,
    )
    try:
        staged = _staging(graph, buffer, runtime, inner_ptrs)
    except Exception:
        graph.reset()
        raise
    return CapturedGraph(graph, out_sig.rebuild(static), out_sig, staged)


def run_function_eagerly(
    function: Callable[..., Any],
    buffer: ReusableValueBuffer,
    leaf_types: LeafTypes | None,
    name: str,
) -> CapturedGraph:
    """``CUDAGRAPHS_DISABLE``: the stand-in for :func:`capture_function`. Each replay
    runs ``function`` on the buffer eagerly and copies the result into a fixed output
    tree, which callers borrow as they would a graph's."""
    logger.warning(
        "%s is set: program %s is not captured; each replay runs it eagerly", DISABLE_ENV, name
    )
    first = detached(function(*buffer.value), leaf_types)
    out_sig = output_signature(first, leaf_types)
    check_output_device(out_sig.flatten(first), buffer.device)
    graph, static = capture_eagerly(
        lambda: out_sig.flatten(detached(function(*buffer.value), leaf_types), path="output"),
        out_sig.flatten(first, path="output"),
        what=f"program {name}",
    )
    return CapturedGraph(graph, out_sig.rebuild(static), out_sig, None)


def _staging(
    graph: torch.cuda.CUDAGraph,
    buffer: ReusableValueBuffer,
    runtime: Any,
    inner_ptrs: dict[int, int],
) -> GraphStaging | None:
    if not inner_ptrs:
        return None
    graph.instantiate()  # node updates apply to the executable graph
    staging = GraphStaging(runtime, graph, buffer.tensors, inner_ptrs)
    return staging if staging else None
