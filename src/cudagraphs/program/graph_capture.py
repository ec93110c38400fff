"""Capturing a program, once per program and never on the replay path: check the
examples, warm up on fresh buffers, fill the input buffer, capture the function into
its own pool or into a shared one (outputs then copied out of the shared scratch),
with inputs staged by copies or inside the graph (:mod:`.staging`), and describe the
outputs. The result is one frozen :class:`CapturedProgram` that
``CudaGraphProgram``'s constructor takes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..capture import (
    GraphMemoryPool,
    capture_eagerly,
    capture_into_graph,
    capture_with_static_outputs,
    side_stream,
)
from ..checks import check_callable, check_int
from ..errors import CudaGraphCaptureError, CudaGraphsTypeError, CudaGraphsValueError
from ..settings import DISABLE_ENV
from ..torch_private import tensor_version
from .buffer import ReusableValueBuffer
from .leaves import LeafTypes
from .pool import CudaGraphCaptureStats, CudaGraphPool
from .signature import ValueTreeSignature
from .staging import (
    GraphStaging,
    check_staging_mode,
    choose_staging,
    runtime_for,
    staged_arguments,
)

__all__ = [
    "CapturedGraph",
    "CapturedProgram",
    "capture_function",
    "capture_program",
    "check_capture_arguments",
    "check_capture_options",
    "check_examples",
    "check_output_device",
    "detached",
    "first_replay_mismatch",
    "output_signature",
    "run_function_eagerly",
    "warm_up",
]

logger = logging.getLogger(__name__)


def check_capture_options(
    function: object, example_inputs: object, warmup: object, staging: object
) -> None:
    """The checks of :func:`check_capture_arguments` that need no device: run before
    asking for CUDA, so that a wrong argument is named before a missing GPU."""
    check_callable("function", function)
    check_int("warmup", warmup, minimum=0)
    if isinstance(example_inputs, (str, bytes)) or not isinstance(example_inputs, Sequence):
        raise CudaGraphsTypeError("example_inputs must be a sequence of positional arguments")
    check_staging_mode(staging)


def check_capture_arguments(
    function: object,
    example_inputs: object,
    warmup: object,
    pool: Any,
    leaf_types: LeafTypes | None,
    staging: object,
) -> tuple[tuple, ValueTreeSignature, torch.device]:
    """Check the arguments of ``CudaGraphProgram.capture``; return the inputs as a
    tuple, their signature and their device. Nothing is captured or allocated."""
    check_capture_options(function, example_inputs, warmup, staging)
    # Read as a pool by what it offers (a CudaGraphPool; tests stand in for it).
    if pool is not None and not (hasattr(pool, "check_open") and hasattr(pool, "device")):
        raise CudaGraphsTypeError(
            f"pool must be a CudaGraphPool (shared by programs), got {type(pool).__name__} "
            f"{pool!r}; pass CudaGraphPool(device) or leave it out"
        )
    inputs = tuple(example_inputs)
    signature = ValueTreeSignature.from_value(inputs, leaf_types=leaf_types, path="inputs")
    device = check_examples(signature, signature.flatten(inputs, path="inputs"))
    if pool is not None:
        pool.check_open()
        if warmup < 1:
            raise CudaGraphsValueError("capture into a CudaGraphPool needs warmup >= 1")
        if pool.device != device:
            raise CudaGraphsValueError(f"pool is on {pool.device} but example_inputs on {device}")
    return inputs, signature, device


def check_examples(signature: ValueTreeSignature, tensors: list[torch.Tensor]) -> torch.device:
    if not tensors:
        raise CudaGraphsValueError(
            "example_inputs hold no tensor; a program needs at least one tensor input "
            "(bind constants in the function instead)"
        )
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise CudaGraphsValueError(
            f"example_inputs must all sit on one CUDA device, found {sorted(map(str, devices))}"
        )
    expanded = [i for i, t in enumerate(signature.tensor_signatures()) if t.self_overlapping]
    if expanded:
        raise CudaGraphsValueError(
            f"example input tensors {expanded} (in flatten order) are expanded views (stride "
            "0); each input needs storage of its own (pass .contiguous() copies)"
        )
    storages: dict[int, int] = {}
    for i, t in enumerate(tensors):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            raise CudaGraphsValueError(
                f"example input tensors {storages[ptr]} and {i} (in flatten order) share "
                "storage; every input leaf needs its own storage, since each gets its own "
                "fixed buffer (pass clones)"
            )
        storages[ptr] = i
    return next(iter(devices))


def output_signature(output: Any, leaf_types: LeafTypes | None) -> ValueTreeSignature:
    try:
        return ValueTreeSignature.from_value(
            output, leaf_types=leaf_types, path="output", allow_none=True
        )
    except TypeError as exc:
        raise CudaGraphsTypeError(
            f"{exc}. A program's output must be CUDA tensors, registered leaves or None, "
            "nested in lists, tuples and dicts."
        ) from None


def check_output_device(tensors: list[torch.Tensor], device: torch.device) -> None:
    elsewhere = sorted({str(t.device) for t in tensors if t.device != device})
    if elsewhere:
        raise CudaGraphsTypeError(
            f"the function returned tensors on {elsewhere}; a program's outputs must be "
            f"tensors on its device {device} (a graph replay never writes other devices)"
        )


def detached(tree: Any, leaf_types: LeafTypes | None) -> Any:
    """``tree`` with every tensor replaced by a detached view (no copies, no kernels)."""
    sig = output_signature(tree, leaf_types)
    return sig.rebuild([t.detach() for t in sig.flatten(tree, path="output")])


def warm_up(
    function: Callable[..., Any],
    signature: ValueTreeSignature,
    inputs: tuple,
    device: torch.device,
    warmup: int,
    stream: torch.cuda.Stream,
    name: str,
) -> Any:
    """Run ``function`` ``warmup`` times on fresh buffers on ``stream``; return the
    last output (``None`` without warmup)."""
    last = None
    try:
        with side_stream(stream):
            for _ in range(warmup):
                fresh = ReusableValueBuffer(signature, device)
                fresh.copy_from(inputs, path="inputs")
                versions = [tensor_version(t) for t in fresh.tensors]
                last = function(*fresh.value)
                _refuse_written_inputs(fresh.tensors, versions, name)
        torch.cuda.synchronize(device)
    except CudaGraphsValueError:
        raise
    except Exception as exc:
        raise CudaGraphCaptureError(f"warmup of program {name} failed: {exc}") from exc
    return last


def _refuse_written_inputs(tensors: list[torch.Tensor], versions: list[int], name: str) -> None:
    """The function wrote into input tensors in place: a replay writes into the
    program's own buffers (or their staging copies), never into the tensors passed, so
    it would diverge from running the function eagerly."""
    written = [i for i, (t, v) in enumerate(zip(tensors, versions)) if tensor_version(t) != v]
    if written:
        raise CudaGraphsValueError(
            f"program {name}: the function writes into input tensors {written} (in flatten "
            "order) in place; a replay writes into the program's own copy of each input, "
            "so the tensors passed would keep their values. Fix: return the new values "
            "instead of writing into the inputs"
        )


def first_replay_mismatch(
    out_sig: ValueTreeSignature, output: Any, last: Any, leaf_types: LeafTypes | None, name: str
) -> str | None:
    """Why the first replay's ``output`` is not the last warmup's ``last``, or ``None``."""
    got = out_sig.flatten(output, path="output")
    want = out_sig.flatten(detached(last, leaf_types), path="output")
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not _same_values(a, b)]
    if not bad:
        return None
    return (
        f"program {name}: the first replay's output differs from the last "
        f"warmup output at output tensors {bad} (in flatten order). The function is "
        "not a fixed schedule (host-side control flow, random numbers, reading "
        "state outside its inputs?). For functions that draw random numbers pass "
        "check_first_replay=False."
    )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN (a masked softmax's fully padded row is NaN
    at every run: a fixed schedule all the same)."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()) or a.shape != b.shape:
        return False
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


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
    graph_pool: GraphMemoryPool | None  # the program's own pool; None in a shared one
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
    # inside the pool (GraphMemoryPool.capture_stream); warmups run on its warmup stream.
    graph_pool = pool.graph_pool if pool is not None else GraphMemoryPool()
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
    graph_pool: GraphMemoryPool,
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
            return _own_outputs(function(*buffer.value), buffer.tensors)
        tensors, ptrs = staged_arguments(buffer.tensors)
        inner_ptrs.update(ptrs)
        return _own_outputs(function(*signature.rebuild(tensors)), [*buffer.tensors, *tensors])

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


def _own_outputs(output: Any, inputs: Sequence[torch.Tensor]) -> Any:
    """``output`` with each tensor that lies in an input's memory (a pass-through,
    ``return x``, or a view of an input) replaced by a copy made inside the graph.

    Why: the inputs' memory is the program's input buffers (or the graph's staging
    copies of them), which the next call's copy overwrites. An output fed back as the
    next input (``step(cur, prev) -> (new, cur)``) would be read after it was
    overwritten, and a prefetch (``copy_inputs_from``) would change an output already
    handed out. Tensors inside registered leaf types are not looked into."""
    held = {t.untyped_storage().data_ptr() for t in inputs}

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.untyped_storage().data_ptr() in held else t

    return pytree.tree_map_only(torch.Tensor, own, output)


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
