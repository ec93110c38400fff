"""One call of a :class:`~cudagraphs.serving.GraphRunner`, from the batch to its outputs.

Everything that happens to one batch is here, in order (:meth:`CallPath.run`):

1. fast path: a batch that matches the specs exactly (a ``dict`` of the specs' names,
   each tensor of its spec's dtype, device and shape at one row count; no
   ``batch_size``/``num_tokens``, no token buckets, no rank agreement) replays what its
   row count worked out the first time it was seen (:class:`~.graphs.ReplayStep`):
   the bucket and, per slot, the staging plan. A step then costs a few attribute
   reads per input besides the copy, the padding fill and the replay;
2. otherwise the full path: validate the batch (every difference reported, nothing
   staged), check ``batch_size``, ignore ``num_tokens`` without token buckets (said
   once), agree with the other ranks on the batch size;
3. choose the bucket (:func:`~.buckets.choose_bucket`, the one place a bucket is
   chosen), or run eagerly with the cause counted and said once at WARNING;
4. stage the real rows into the bucket's next slot and pad the rest;
5. ``plan(bucket, slot)``, replay, and return the outputs cut to the real rows
   (:meth:`~.graphs.SlotGraph.real_rows`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..checks import check_int
from ..diagnostics import WarnOnce
from ..errors import CudaGraphInputError, CudaGraphsStateError
from .buckets import Bucket, BucketChoice, BucketConfig, choose_bucket, size_key
from .distributed import agree_on_batch_size, is_distributed
from .graphs import BucketGraph, CapturedBuckets, ReplayStep
from .static_inputs import StaticInputs

__all__ = ["CallPath"]


class CallPath:
    """The per-call path of a runner over the buckets it holds.

    Workflow: built with the runner (nothing captured); :meth:`serve` hands it each
    captured value (``None`` at close); :meth:`run` serves one batch. It owns the
    per-row-count replay steps (made on first use, forgotten with the captured value)
    and the counts of eager runs and ignored arguments (kept for the runner's life).

    It does NOT capture, release graphs, or check its constructor's arguments (the
    runner does all three).

    Args:
        eager_forward: forward run eagerly for a batch no bucket serves (not compiled).
        config: the runner's buckets (its ``max_pad_ratio``, and whether it has token
            buckets).
        slots: input/graph sets per bucket, taken in turn.
        plan: ``plan(bucket, slot)`` before each replay, or ``None``.
        group: the process group ranks agree over.
        warn: the runner's once-per-cause WARNING.
    """

    def __init__(
        self,
        eager_forward: Callable[..., Any],
        config: BucketConfig,
        slots: int,
        plan: Callable[[Bucket, int], None] | None,
        group: object | None,
        warn: WarnOnce,
    ) -> None:
        self.eager_forward = eager_forward
        self.max_pad_ratio = config.max_pad_ratio
        self.token_buckets = config.token_counts is not None
        self.slots = slots
        self.plan = plan
        self.group = group
        self._warn = warn
        #: Eager runs per cause: "no_graphs", "too_large", "pad_ratio".
        self.eager_runs: Counter[str] = Counter()
        #: Arguments ``run()`` accepted and ignored, per name ("num_tokens").
        self.ignored_arguments: Counter[str] = Counter()
        #: What the runner captured and hands this path (``None``: nothing to serve).
        self.captured: CapturedBuckets | None = None
        #: The first slot's static inputs, read by every call (``captured.static``).
        self.static: StaticInputs | None = None
        #: Row count -> its replay, for batches that match the specs exactly (batch-size
        #: buckets only: token buckets choose by num_tokens).
        self.steps: dict[int, ReplayStep] = {}

    def serve(self, captured: CapturedBuckets | None) -> None:
        """Serve the buckets of ``captured`` from now on (``None``: nothing is served;
        :meth:`run` raises). Forgets the replay steps of the previous value."""
        self.captured = captured
        self.static = None if captured is None else captured.static
        self.steps = {}

    def choose(self, batch_size: int, num_tokens: int | None = None) -> BucketChoice:
        """The served bucket a batch replays on, or why it runs eagerly.

        Raises:
            CudaGraphsValueError: as :func:`~cudagraphs.serving.buckets.choose_bucket`.
        """
        graphs = () if self.captured is None else self.captured.graphs
        return choose_bucket(graphs, batch_size, num_tokens, self.max_pad_ratio)

    def run(
        self,
        inputs: Mapping[str, torch.Tensor],
        batch_size: int | None,
        num_tokens: int | None,
        copy_output: bool,
    ) -> Any:
        """One step: what :meth:`GraphRunner.run` returns and raises (it delegates here
        with its arguments)."""
        static = self.static
        if static is None:
            raise CudaGraphsStateError(
                "GraphRunner.run() before capture() (or after close()): call "
                "capture(make_inputs) first"
            )
        if batch_size is None and num_tokens is None and not self.token_buckets:
            rows = static.exact_rows(inputs)
            if rows is not None and not is_distributed(self.group):
                step = self.steps.get(rows) or self._replay_step(rows)
                if step is not None:
                    entry = step.entry
                    index = entry.next_slot
                    entry.next_slot = (index + 1) % self.slots
                    step.staging[index].write(inputs)
                    return self._replay(entry, index, rows, copy_output)
        return self._run_checked(inputs, batch_size, num_tokens, copy_output)

    def _replay_step(self, rows: int) -> ReplayStep | None:
        """The replay of an exactly matching batch of ``rows`` rows (kept), or ``None``
        when it runs eagerly (the full path counts and says that)."""
        bucket = self.choose(rows).bucket
        if bucket is None:
            return None
        captured = self.captured
        staging = tuple(static.staging(bucket, rows) for static in captured.slot_inputs)
        step = self.steps[rows] = ReplayStep(captured.graphs[bucket], staging)
        return step

    def _run_checked(
        self,
        inputs: Mapping[str, torch.Tensor],
        batch_size: int | None,
        num_tokens: int | None,
        copy_output: bool,
    ) -> Any:
        rows = self.static.batch_rows(inputs)
        if rows == 0 and batch_size is None and not is_distributed(self.group):
            # Said as what it is, not as a batch_size the caller never passed.
            raise CudaGraphInputError(
                "the batch has no rows (every input's row dim is 0): a graph replays at "
                "least one. Fix: skip the call when there is nothing to run"
            )
        batch = rows if batch_size is None else check_int("batch_size", batch_size, minimum=1)
        if num_tokens is not None and not self.token_buckets:
            num_tokens = self._ignore_num_tokens(num_tokens)
        if is_distributed(self.group):
            # All ranks pick the same bucket: a graph holding a collective must be
            # replayed by every rank or by none.
            batch = agree_on_batch_size(batch, self.group)
        choice = self.choose(batch, num_tokens)
        if choice.bucket is None:
            return self._run_eagerly(inputs, rows, batch, num_tokens, choice.eager_cause)
        entry = self.captured.graphs[choice.bucket]
        index = entry.next_slot
        entry.next_slot = (index + 1) % self.slots
        self.captured.slot_inputs[index].stage(inputs, choice.bucket, rows)
        return self._replay(entry, index, rows, copy_output)

    def _replay(self, entry: BucketGraph, index: int, rows: int, copy_output: bool) -> Any:
        if self.plan is not None:
            self.plan(entry.bucket, index)
        slot = entry.slots[index]
        slot.graph.replay()
        entry.replays += 1
        return slot.real_rows(rows, entry.bucket.rows, copy_output)

    def _ignore_num_tokens(self, num_tokens: int) -> None:
        self.ignored_arguments["num_tokens"] += 1
        self._warn(
            "num_tokens",
            "GraphRunner: run(num_tokens=%s) is ignored: the config has no token buckets "
            "(BucketConfig(token_counts=...)), so buckets are chosen by batch size alone",
            num_tokens,
        )

    def _run_eagerly(
        self,
        inputs: Mapping[str, torch.Tensor],
        rows: int,
        batch: int,
        num_tokens: int | None,
        cause: str,
    ) -> Any:
        static = self.static
        static.validate(inputs, None, rows)
        self._say_eager(cause, batch, num_tokens)
        self.eager_runs[cause] += 1
        return self.eager_forward(**static.in_spec_dtypes(inputs))

    def _say_eager(self, cause: str, batch: int, num_tokens: int | None) -> None:
        """Say once per cause why batches run eagerly ("no_graphs" was said at the end
        of capture)."""
        size = f"{batch}" if num_tokens is None else f"{batch} ({num_tokens} tokens)"
        if cause == "too_large":
            dropped = self.captured.report.dropped
            self._warn(
                "too_large",
                "GraphRunner: a batch of %s fits no captured bucket (the largest is %s%s): "
                "it and later ones like it run eagerly, counted in "
                "stats()['eager_runs']['too_large']",
                size,
                max(self.captured.graphs, key=size_key),
                f"; dropped: {', '.join(map(str, dropped))}" if dropped else "",
            )
        elif cause == "pad_ratio":
            self._warn(
                "pad_ratio",
                "GraphRunner: a batch of %s would pad its bucket by more than "
                "max_pad_ratio=%s: it and later ones like it run eagerly, counted in "
                "stats()['eager_runs']['pad_ratio']",
                size,
                self.max_pad_ratio,
            )
