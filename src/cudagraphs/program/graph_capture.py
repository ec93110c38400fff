"""Capturing a program's function: into its own pool, or into a shared pool with the
outputs copied out of the shared scratch; with inputs staged by copies or inside the
graph (:mod:`.staging`). Runs once per program, never on the replay path."""

from __future__ import annotations

import logging
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
from .capture_steps import check_output_device, detached, output_signature
from .leaves import LeafTypes
from .signature import ValueTreeSignature
from .staging import GraphStaging, choose_staging, runtime_for, staged_arguments

__all__ = ["CapturedGraph", "capture_function", "run_function_eagerly"]

logger = logging.getLogger(__name__)


@dataclass
class CapturedGraph:
    """What capturing a program's function produced."""

    graph: torch.cuda.CUDAGraph
    output: Any  # the borrowed output tree the graph writes
    out_sig: ValueTreeSignature
    staging: GraphStaging | None  # inputs the graph copies from the caller's tensors


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
