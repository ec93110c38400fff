"""GraphRunner: one graph per batch-size bucket over shared static inputs.

The user gives a forward function over named static inputs. ``capture()`` walks the
buckets largest first into one pool: a bucket whose capture fails is dropped (logged
with its cause) and the others still capture; ranks then agree on the captured set.
``run()`` picks the tightest captured bucket, stages the real rows with one fused
copy, pads the rest, replays, and returns views of the real rows of the outputs
(borrowed: overwritten by the next replay) or owned copies. A batch no bucket fits
runs eagerly, counted.
"""

from __future__ import annotations

import gc
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..capture import GraphPool, capture_into_graph, capture_with_static_outputs, side_stream
from ..errors import CudaGraphInputError
from .buckets import Bucket, BucketConfig, check_dropped_buckets, select_bucket
from .distributed import agree_on_batch_size, agree_on_captured, is_distributed
from .memory import BucketCost, MemoryPlan, MemoryUse, measure_bucket_cost, plan_buckets
from .static_inputs import InputSpec, StaticInputs

__all__ = ["BucketGraph", "GraphRunner"]

logger = logging.getLogger(__name__)

#: ``backend(run, pool, what) -> (graph with .replay() and .reset(), output)``
CaptureBackend = Callable[[Callable[[], Any], GraphPool, str], tuple[Any, Any]]


def _default_backend(run: Callable[[], Any], pool: GraphPool, what: str) -> tuple[Any, Any]:
    return capture_into_graph(run, pool, what=what)


def _static_outputs_backend(run: Callable[[], Any], pool: GraphPool, what: str) -> tuple[Any, Any]:
    # Piecewise regions: the graph ends by copying its outputs into buffers outside the
    # pool, so regions sharing the pool may replay in any order around eager code.
    return capture_with_static_outputs(run, run(), pool, what=what)


@dataclass
class BucketGraph:
    """One captured bucket: its graph and the output tree the graph writes (slot 0),
    and the same for every further slot when the runner double-buffers."""

    bucket: Bucket
    graph: Any
    output: Any
    replays: int = 0
    more_slots: list[tuple[Any, Any]] = field(default_factory=list)  # (graph, output)
    next_slot: int = 0

    def slot(self, index: int) -> tuple[Any, Any]:
        return (self.graph, self.output) if index == 0 else self.more_slots[index - 1]

    def reset(self) -> None:
        for graph, _ in [(self.graph, None), *self.more_slots]:
            reset = getattr(graph, "reset", None)
            if reset is not None:
                reset()


class GraphRunner:
    """A bucketed CUDA-graph runner for a fixed forward function (see module docs).

    Args:
        forward: ``forward(**inputs) -> output tree`` of tensors whose row dimension
            (``output_row_dim``) grows with the bucket; runs eagerly for warmup, for
            capture and for batches no bucket fits.
        inputs: the named inputs at the largest bucket (:class:`InputSpec`).
        config: the buckets (:class:`BucketConfig`).
        device: where the static inputs live.
        output_row_dim: the row dimension of every output tensor.
        require_all_buckets: make any dropped bucket a startup error (``None``: the
            ``CUDAGRAPHS_REQUIRE_ALL_BUCKETS`` environment variable decides).
        group: process group for rank agreement (default group when distributed).
        capture_backend: replaces the CUDA capture (tests use an eager stand-in).
        static_outputs: end each graph with a copy of its outputs into buffers outside
            the pool (piecewise regions: several runners share a pool and replay in
            any order, with eager code between them).
        pool: the :class:`GraphPool` to capture into (share one between the runners of
            piecewise regions); a new one by default.
        slots: input/graph sets per bucket, used in turn by consecutive steps (2 for
            double buffering: host-side planning of step N+1 writes the other slot's
            buffers while step N replays).
        plan: ``plan(bucket, slot)``, called after staging and before each replay,
            outside the graph (per-step metadata that the graph reads from buffers).
        compile_options: compile ``forward`` with ``torch.compile(**compile_options)``
            once, before capture; warmup compiles each bucket's shapes, and a
            recompilation inside a capture fails that capture early with torch's
            account of the guard that broke (the capture runs under the
            ``fail_on_recompile`` stance).

    The constructor allocates nothing and captures nothing; call :meth:`capture`.
    One host thread drives a runner.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        inputs: Sequence[InputSpec],
        config: BucketConfig | None = None,
        *,
        device: torch.device | str = "cuda",
        output_row_dim: int = 0,
        require_all_buckets: bool | None = None,
        group: object | None = None,
        capture_backend: CaptureBackend | None = None,
        static_outputs: bool = False,
        pool: GraphPool | None = None,
        slots: int = 1,
        plan: Callable[[Bucket, int], None] | None = None,
        compile_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.slots = slots
        self.plan = plan
        self.slot_inputs: list[StaticInputs] = []
        self.eager_forward = forward
        # Compiled once per runner (torch.compile itself compiles per bucket shape, in
        # warmup, never inside a capture).
        self.forward = (
            forward if compile_options is None else torch.compile(forward, **compile_options)
        )
        self.config = config or BucketConfig()
        self.specs = list(inputs)
        self.device = torch.device(device)
        self.output_row_dim = output_row_dim
        self.require_all_buckets = require_all_buckets
        self.group = group
        default = _static_outputs_backend if static_outputs else _default_backend
        self._backend = capture_backend or default
        self.memory_plan: MemoryPlan | None = None
        #: With ``plan_memory``: what the captures actually took (logged beside the plan).
        self.memory_used: MemoryUse | None = None
        self.static: StaticInputs | None = None
        self.graphs: dict[Bucket, BucketGraph] = {}
        self.dropped_buckets: dict[Bucket, str] = {}
        self.eager_runs: Counter[str] = Counter()
        self._pool: GraphPool | None = pool

    # ---- capture ---------------------------------------------------------------------
    def capture(
        self,
        make_inputs: Callable[[Bucket], Mapping[str, torch.Tensor]],
        warmup: int = 2,
        *,
        plan_memory: bool = False,
        free_bytes: int | None = None,
        headroom_bytes: int = 0,
        measure: Callable[[Bucket], BucketCost] | None = None,
    ) -> None:
        """Capture every configured bucket, largest first, into one pool.

        Args:
            make_inputs: dummy inputs for a bucket (all its rows real), staged before
                its warmup and capture.
            warmup: eager runs per bucket before its capture.
            plan_memory: first measure every bucket (``measure``; by default an eager
                step's peak, a thrown-away capture and the driver's executable memory)
                and capture only the buckets :func:`plan_buckets` fits into
                ``free_bytes`` (default: the device's free memory); the others are
                dropped with the plan's reason. ``memory_plan`` keeps the plan, and
                ``memory_used`` what the captures then took (both logged at INFO).
            headroom_bytes: memory the plan keeps free besides the largest eager step.

        Raises:
            CudaGraphCaptureError: a bucket was dropped and all are required.
        """
        largest = self.config.largest
        self.slot_inputs = [
            StaticInputs(self.specs, largest.rows, self.device) for _ in range(self.slots)
        ]
        self.static = self.slot_inputs[0]
        if self._pool is None:
            self._pool = GraphPool()
        chosen = set(self.config.buckets())
        if plan_memory:
            chosen = self._plan(make_inputs, free_bytes, headroom_bytes, measure)
        local_ok = []
        gc.collect()  # once before: no collection of old cycles during the captures
        before = self._memory_now() if plan_memory else None
        for bucket in self.config.buckets():
            # Every rank walks every bucket, also after a local failure, so the
            # agreement below is one collective per rank.
            ok = bucket in chosen and self._capture_bucket(bucket, make_inputs, warmup)
            local_ok.append(ok)
        if before is not None:
            after = self._memory_now()
            self.memory_used = MemoryUse(after[0] - before[0], before[1] - after[1])
            logger.info("%s", self.memory_used.against(self.memory_plan))
        self._agree(local_ok)
        gc.collect()
        check_dropped_buckets(self.dropped_buckets, self.require_all_buckets)

    def _memory_now(self) -> tuple[int, int] | None:
        """(reserved bytes, device free bytes), or None off CUDA. Empties the cache
        first, so blocks cached by the eager warmups are not counted as graph memory."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device), torch.cuda.mem_get_info(self.device)[0]

    def _plan(
        self,
        make_inputs: Callable,
        free_bytes: int | None,
        headroom_bytes: int,
        measure: Callable[[Bucket], BucketCost] | None,
    ) -> set[Bucket]:
        costs = []
        for bucket in self.config.buckets():
            views = self.static.views(bucket)
            self.static.stage(make_inputs(bucket), bucket, bucket.rows)
            if measure is not None:
                costs.append(measure(bucket))
            else:
                costs.append(
                    measure_bucket_cost(
                        bucket, lambda v=views: self.forward(**v), self._capture_stream()
                    )
                )
        if free_bytes is None:
            free_bytes = torch.cuda.mem_get_info()[0]
        self.memory_plan = plan = plan_buckets(costs, free_bytes, headroom_bytes=headroom_bytes)
        logger.info("%s", plan.describe())
        for bucket, why in plan.dropped.items():
            self.dropped_buckets[bucket] = f"memory plan: {why}"
            logger.error("dropping %s: %s", bucket, why)
        return set(plan.chosen)

    def _capture_stream(self) -> torch.cuda.Stream | None:
        # Warmup and capture of every bucket on the pool's one stream: cuBLAS makes its
        # per-stream workspace once, in the first warmup, instead of once per bucket
        # inside the pool (32 MiB each on Hopper). None on the CPU (tests).
        if self.device.type != "cuda":
            return None
        return self._pool.capture_stream(self.device)

    def _capture_bucket(self, bucket: Bucket, make_inputs: Callable, warmup: int) -> bool:
        captured: list[tuple[Any, Any]] = []
        try:
            for slot, static in enumerate(self.slot_inputs):
                views = static.views(bucket)
                static.stage(make_inputs(bucket), bucket, bucket.rows)
                what = str(bucket) if self.slots == 1 else f"{bucket} slot {slot}"
                with side_stream(self._capture_stream()):
                    for _ in range(warmup):
                        self.forward(**views)
                    captured.append(
                        self._backend(lambda v=views: self.forward(**v), self._pool, what)
                    )
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self.dropped_buckets[bucket] = reason
            logger.error("dropping %s: its capture failed: %s", bucket, reason)
            for graph, _ in captured:
                getattr(graph, "reset", lambda: None)()
            return False
        (graph, output), *more = captured
        self.graphs[bucket] = BucketGraph(bucket, graph, output, more_slots=more)
        return True

    def _agree(self, local_ok: list[bool]) -> None:
        agreed = agree_on_captured(local_ok, self.group)
        for bucket, ok, all_ok in zip(self.config.buckets(), local_ok, agreed):
            if ok and not all_ok:
                self.graphs.pop(bucket).reset()
                self.dropped_buckets[bucket] = "dropped on another rank"
                logger.error("dropping %s: another rank could not capture it", bucket)

    # ---- run -------------------------------------------------------------------------
    def _rows(self, inputs: Mapping[str, torch.Tensor]) -> int:
        counts = {
            name: t.shape[self.static.specs[name].row_dim]
            for name, t in inputs.items()
            if name in self.static.specs and isinstance(t, torch.Tensor)
        }
        if len(set(counts.values())) != 1:
            raise CudaGraphInputError(f"inputs disagree on their row counts: {counts}")
        return next(iter(counts.values()))

    def select(self, batch_size: int, num_tokens: int | None = None) -> Bucket | None:
        """The captured bucket a batch would replay on (``None``: eager)."""
        return select_bucket(self.graphs, batch_size, num_tokens, self.config.max_pad_ratio)

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        *,
        batch_size: int | None = None,
        num_tokens: int | None = None,
        copy_output: bool = False,
    ) -> Any:
        """Run one step: replay the tightest captured bucket, or eagerly.

        Args:
            inputs: the real rows of every named input.
            batch_size: sequences in the batch (default: the inputs' row count).
            num_tokens: packed tokens, for token buckets.
            copy_output: return owned copies instead of borrowed views.

        Raises:
            CudaGraphInputError: inputs that differ from the specs (naming the input
                and the bucket); nothing is staged then.
        """
        if self.static is None:
            raise RuntimeError("capture() the runner before run()")
        rows = self._rows(inputs)
        batch = rows if batch_size is None else batch_size
        if is_distributed(self.group):
            # All ranks pick the same bucket: a graph holding a collective must be
            # replayed by every rank or by none.
            batch = agree_on_batch_size(batch, self.group)
        bucket = self.select(batch, num_tokens)
        if bucket is None:
            self.eager_runs["no_bucket"] += 1
            return self.eager_forward(**inputs)
        entry = self.graphs[bucket]
        slot = entry.next_slot
        entry.next_slot = (slot + 1) % self.slots
        self.slot_inputs[slot].stage(inputs, bucket, rows)
        if self.plan is not None:
            self.plan(bucket, slot)
        graph, output = entry.slot(slot)
        graph.replay()
        entry.replays += 1
        return self._real_rows(output, rows, copy_output)

    def _real_rows(self, output: Any, rows: int, copy_output: bool) -> Any:
        leaves, spec = pytree.tree_flatten(output)
        dim = self.output_row_dim
        out = []
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.dim() > dim:
                x = x.narrow(dim, 0, rows)
                x = x.clone() if copy_output else x
            out.append(x)
        return pytree.tree_unflatten(out, spec)

    # ---- reporting and teardown ------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "captured": [str(b) for b in self.graphs],
            "dropped": {str(b): why for b, why in self.dropped_buckets.items()},
            "replays": {str(b): g.replays for b, g in self.graphs.items()},
            "eager_runs": dict(self.eager_runs),
        }

    def close(self) -> None:
        """Release every graph and the static buffers (idempotent)."""
        for entry in self.graphs.values():
            entry.reset()
        self.graphs = {}
        self.static = None
        self.slot_inputs = []
        self._pool = None
