"""What a runner's capture produces and the runner holds: :class:`CapturedBuckets` (the
graphs per bucket, the static inputs per slot, the pool) and :class:`CaptureReport`
(what the capture found: dropped buckets, times, memory). Per bucket a
:class:`BucketGraph` holds a :class:`SlotGraph` per slot: a captured graph, the output
tree it writes, and how each output is cut to a batch's real rows, checked once at
capture. Also the capture backends (a graph, a graph with static outputs, or the eager
stand-in under ``CUDAGRAPHS_DISABLE``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..capture import (
    GraphMemoryPool,
    capture_eagerly,
    capture_into_graph,
    capture_with_static_outputs,
)
from ..errors import CudaGraphOutputError, Mismatch, describe_mismatches
from .buckets import Bucket
from .input_specs import Said
from .memory import MemoryPlan, MemoryUse
from .static_inputs import PLAN_CACHE_SIZE, StagePlan, StaticInputs

__all__ = [
    "BucketBackend",
    "BucketGraph",
    "CaptureReport",
    "CaptureTime",
    "CapturedBuckets",
    "ReplayStep",
    "SlotGraph",
    "default_backend",
    "eager_backend",
    "release",
    "slot_graph",
    "static_outputs_backend",
]

#: How a runner captures one bucket:
#: ``backend(run, pool, what) -> (graph with .replay() and .reset(), output)``
BucketBackend = Callable[[Callable[[], Any], GraphMemoryPool, str], tuple[Any, Any]]


def default_backend(run: Callable[[], Any], pool: GraphMemoryPool, what: str) -> tuple[Any, Any]:
    return capture_into_graph(run, pool, what=what)


def static_outputs_backend(
    run: Callable[[], Any], pool: GraphMemoryPool, what: str
) -> tuple[Any, Any]:
    # Piecewise regions: the graph ends by copying its outputs into buffers outside the
    # pool, so regions sharing the pool may replay in any order around eager code.
    return capture_with_static_outputs(run, run(), pool, what=what)


def eager_backend(run: Callable[[], Any], pool: GraphMemoryPool, what: str) -> tuple[Any, Any]:
    """``CUDAGRAPHS_DISABLE``: an :class:`~cudagraphs.capture.EagerGraph` in place of
    each graph; its replay runs ``run()`` (forward on the static input views) and
    copies the result into the output tree returned here, so the runner's path
    (staging, padding, ``plan``, output rows) is the graphed one, minus the graph."""
    del pool  # nothing is captured, nothing goes into the pool
    return capture_eagerly(run, what=what)


@dataclass
class SlotGraph:
    """One captured graph of a bucket and the output tree its replay writes, with what
    ``run()`` cuts to the real rows worked out at capture."""

    graph: Any
    output: Any
    leaves: list[Any]
    treespec: pytree.TreeSpec
    narrow: tuple[tuple[int, int], ...]  # (leaf index, row dim) of every tensor leaf
    # rows -> the output tree of views cut to them, made the first time rows are seen
    # (a narrow per leaf and an unflatten cost microseconds of host time per step).
    _views: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def real_rows(self, rows: int, full_rows: int, copy: bool) -> Any:
        """The output tree cut to ``rows`` real rows: views of the graph's outputs (the
        same tree object at every call with these rows: borrowed, like the outputs),
        or owned copies with ``copy``."""
        if copy:
            return self._cut(rows, clone=True)
        if rows == full_rows:
            return self.output
        views = self._views.get(rows)
        if views is None:
            views = self._cut(rows, clone=False)
            if len(self._views) < PLAN_CACHE_SIZE:
                self._views[rows] = views
        return views

    def _cut(self, rows: int, clone: bool) -> Any:
        leaves = list(self.leaves)
        for i, dim in self.narrow:
            x = leaves[i].narrow(dim, 0, rows)
            leaves[i] = x.clone() if clone else x
        return pytree.tree_unflatten(leaves, self.treespec)


def slot_graph(graph: Any, output: Any, bucket: Bucket, row_dim: int, what: str) -> SlotGraph:
    """Check every tensor leaf of ``output`` for the bucket's rows in ``row_dim``.

    Raises:
        CudaGraphOutputError: leaves without that dimension or with another size there
            (all of them, by path and shape): returning them would hand back padding
            rows or cut another dimension.
    """
    flat, treespec = pytree.tree_flatten_with_path(output)
    narrow, wrong = [], []
    for i, (path, x) in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            continue
        dim = row_dim + x.dim() if row_dim < 0 else row_dim
        if 0 <= dim < x.dim() and x.shape[dim] == bucket.rows:
            narrow.append((i, dim))
        else:
            expected = Said(f"{bucket.rows} rows in dim {row_dim}")
            wrong.append(
                Mismatch(f"output{pytree.keystr(path)}", "shape", expected, tuple(x.shape))
            )
    if wrong:
        raise CudaGraphOutputError(
            describe_mismatches(
                f"outputs of {what} do not hold its {bucket.rows} rows in output_row_dim={row_dim}",
                wrong,
                "The runner cuts every output tensor to the batch's rows in that dimension. "
                "Fixes: 1. set output_row_dim to the dimension holding the rows (0 for "
                "[rows, ...] outputs; negative values count from the end); 2. return only "
                "row-wise outputs from forward.",
            )
        )
    return SlotGraph(graph, output, [x for _, x in flat], treespec, tuple(narrow))


@dataclass
class BucketGraph:
    """One captured bucket: a :class:`SlotGraph` per slot (one, or more when the runner
    double-buffers), its replay count and the slot the next step uses."""

    bucket: Bucket
    slots: list[SlotGraph]
    replays: int = 0
    next_slot: int = 0

    @property
    def graph(self) -> Any:
        return self.slots[0].graph

    @property
    def output(self) -> Any:
        return self.slots[0].output

    def slot(self, index: int) -> SlotGraph:
        return self.slots[index]

    def reset(self) -> None:
        release(slot.graph for slot in self.slots)


@dataclass(frozen=True)
class ReplayStep:
    """How a runner replays a batch of one row count, worked out the first time it sees
    that count: the bucket graph it replays on and, per slot, what staging writes into
    that slot's buffers. Borrowed views; dropped with the runner's graphs."""

    entry: BucketGraph
    staging: tuple[StagePlan, ...]


@dataclass(frozen=True)
class CaptureTime:
    """How long one bucket took to capture (host wall time, seconds)."""

    warmup_runs: int
    warmup_s: float
    capture_s: float  # recording and instantiation
    # Of warmup_s, what torch.compile spent compiling for this bucket (dynamo's records),
    # and the frames it compiled: 0 for eager code and for a bucket whose shape reused
    # a compile (cudagraphs.compile_watch).
    compile_s: float = 0.0
    compiled_frames: int = 0


@dataclass
class CaptureReport:
    """What one capture of a runner's buckets found. The capture fills it as it goes, so
    the runner keeps it after :meth:`~cudagraphs.serving.GraphRunner.close` and after a
    capture that raised (then up to where that capture stopped).

    Attributes:
        disabled: ``CUDAGRAPHS_DISABLE`` was set: eager stand-ins, no graphs.
        dropped: bucket -> why it was dropped (capture error, memory plan, ranks).
        times: per captured bucket, its warmup runs and seconds.
        memory_plan: the plan (with ``plan_memory``), else ``None``.
        memory_used: what the captures took, beside the plan (with ``plan_memory``
            on CUDA), else ``None``.
        memory_account: where the capture's device memory went
            (:class:`~cudagraphs.memory.MemoryAccount`; ``None`` off CUDA or when
            disabled).
    """

    disabled: bool = False
    dropped: dict[Bucket, str] = field(default_factory=dict)
    times: dict[Bucket, CaptureTime] = field(default_factory=dict)
    memory_plan: MemoryPlan | None = None
    memory_used: MemoryUse | None = None
    memory_account: Any = None


@dataclass(frozen=True)
class CapturedBuckets:
    """Everything one capture made, owned by the runner until it closes: the graphs per
    bucket (in capture order, largest first), the static inputs per slot (every
    bucket's graphs read slices of them), the pool the graphs live in and the
    :class:`CaptureReport`.

    It does NOT change after the capture, except the replay counts and next slots of
    its :class:`BucketGraph` entries, which each call advances.
    """

    graphs: dict[Bucket, BucketGraph]
    slot_inputs: list[StaticInputs]
    pool: GraphMemoryPool
    report: CaptureReport

    @property
    def static(self) -> StaticInputs:
        """The first slot's static inputs (the only ones with one slot)."""
        return self.slot_inputs[0]

    def release(self) -> None:
        """Reset every graph (their memory goes back to the pool)."""
        for entry in self.graphs.values():
            entry.reset()


def release(graphs: Any) -> None:
    """Reset each graph that can be reset (an eager stand-in may have no ``reset``)."""
    for graph in graphs:
        reset = getattr(graph, "reset", None)
        if reset is not None:
            reset()
