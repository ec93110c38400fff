"""The full path of ``GraphRunner.run()``: a batch that is not an exact match of the
specs (a lossless dtype, ``batch_size``/``num_tokens``, token buckets, rank agreement, a
bad batch) is checked, agreed on and staged here, or run eagerly with its cause counted
and said once. Separate from the runner's fast path, which stays small on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..checks import check_int
from .buckets import select_bucket
from .distributed import agree_on_batch_size, is_distributed

if TYPE_CHECKING:  # the runner imports this module
    from .runner import GraphRunner

__all__ = ["run_checked"]


def run_checked(
    runner: GraphRunner,
    inputs: Mapping[str, torch.Tensor],
    batch_size: int | None,
    num_tokens: int | None,
    copy_output: bool,
) -> Any:
    """One step of ``runner`` on its full path: what ``GraphRunner.run()`` does with a
    batch its fast path does not take.

    Args:
        runner: the captured :class:`~cudagraphs.serving.runner.GraphRunner`
            (borrowed); its ``eager_runs`` and ``ignored_arguments`` count what
            happens here.
        inputs, batch_size, num_tokens, copy_output: ``GraphRunner.run()``'s.

    Returns:
        What ``GraphRunner.run()`` returns: the real rows of the replayed bucket's
        outputs, or forward's own output when it runs eagerly.

    Raises:
        CudaGraphInputError, CudaGraphsTypeError, CudaGraphsValueError: as
            ``GraphRunner.run()``; nothing is staged then.
    """
    static = runner.static
    rows = static.batch_rows(inputs)
    batch = rows if batch_size is None else check_int("batch_size", batch_size, minimum=1)
    if num_tokens is not None and not runner._token_buckets:
        num_tokens = _ignore_num_tokens(runner, num_tokens)
    if is_distributed(runner.group):
        # All ranks pick the same bucket: a graph holding a collective must be
        # replayed by every rank or by none.
        batch = agree_on_batch_size(batch, runner.group)
    bucket = runner.select(batch, num_tokens)
    if bucket is None:
        return _run_eagerly(runner, inputs, rows, batch, num_tokens)
    entry = runner.graphs[bucket]
    index = entry.next_slot
    entry.next_slot = (index + 1) % runner.slots
    runner.slot_inputs[index].stage(inputs, bucket, rows)
    return runner._replay(entry, index, rows, copy_output)


def _ignore_num_tokens(runner: GraphRunner, num_tokens: int) -> None:
    runner.ignored_arguments["num_tokens"] += 1
    runner._warn(
        "num_tokens",
        "GraphRunner: run(num_tokens=%s) is ignored: the config has no token buckets "
        "(BucketConfig(token_counts=...)), so buckets are chosen by batch size alone",
        num_tokens,
    )


def _run_eagerly(
    runner: GraphRunner,
    inputs: Mapping[str, torch.Tensor],
    rows: int,
    batch: int,
    num_tokens: int | None,
) -> Any:
    static = runner.static
    static.validate(inputs, None, rows)
    runner.eager_runs[_eager_cause(runner, batch, num_tokens)] += 1
    return runner.eager_forward(**static.in_spec_dtypes(inputs))


def _eager_cause(runner: GraphRunner, batch: int, num_tokens: int | None) -> str:
    if not runner.graphs:
        return "no_graphs"  # said at the end of capture
    size = f"{batch}" if num_tokens is None else f"{batch} ({num_tokens} tokens)"
    if select_bucket(runner.graphs, batch, num_tokens) is None:
        largest = max(runner.graphs, key=lambda b: (b.rows, b.batch_size))
        runner._warn(
            "too_large",
            "GraphRunner: a batch of %s fits no captured bucket (the largest is %s%s): "
            "it and later ones like it run eagerly, counted in "
            "stats()['eager_runs']['too_large']",
            size,
            largest,
            f"; dropped: {', '.join(map(str, runner.dropped_buckets))}"
            if runner.dropped_buckets
            else "",
        )
        return "too_large"
    runner._warn(
        "pad_ratio",
        "GraphRunner: a batch of %s would pad its bucket by more than max_pad_ratio=%s: "
        "it and later ones like it run eagerly, counted in "
        "stats()['eager_runs']['pad_ratio']",
        size,
        runner.config.max_pad_ratio,
    )
    return "pad_ratio"
