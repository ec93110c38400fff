"""Prefills replayed from graphs: prompts left-padded to a length bucket.

An eager prefill of a small model is host-bound: HF's Python runs every layer's
modules once per request whatever the prompt's length (about 10 ms for 16 Llama
layers on an H100, as long as a few decode steps). Here a request's prompts are
left-padded to the shortest length bucket ``L`` that holds them (padding tokens are
id 0 with mask 0, so every row still starts its real tokens at position 0, as HF's
left padding does) and the prefill replays the graph of ``(rows bucket, L)``: the
model's eager kernels over the shared static cache, its write counters zeroed inside
the graph so that every replay writes positions ``0 .. L-1``. The decode then goes on
from position ``L`` with the padded mask as its prefix.

Extra left padding changes no token's attention but the kernels' shapes, so the
logits agree with an unpadded prefill to rounding, not bit for bit: the generator
uses these graphs by default only when it decodes through compiled kernels (whose
tokens agree with HF's to rounding already), and the eager-kernel generator, whose
tokens equal HF's, takes them only when asked (``prefill_lengths``).

Bounded by construction: lengths up to :data:`DEFAULT_MAX_LENGTH` by default, and a
graph only where rows x length is at most ``prefill_tokens`` (a long prompt is
compute-bound, where a graph saves nothing and its activations would cost memory).
A request no graph serves prefills eagerly, counted per cause in ``stats()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...checks import check_int
from ...errors import CudaGraphsTypeError, CudaGraphsValueError
from ..buckets import BucketConfig, choose_bucket
from ..input_specs import InputSpec
from ..runner import GraphRunner
from .requests import Request, positions_from_mask

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "DEFAULT_MIN_LENGTH",
    "DEFAULT_PREFILL_TOKENS",
    "PrefillGraphs",
    "PrefillLength",
    "PrefillRun",
    "check_prefill_lengths",
    "check_prefill_tokens",
    "choose_length",
    "default_prefill_lengths",
]

#: The shortest and longest default length buckets (powers of two between them).
DEFAULT_MIN_LENGTH = 16
DEFAULT_MAX_LENGTH = 512
#: Default cap on rows x length per prefill graph: its activations' memory.
DEFAULT_PREFILL_TOKENS = 2048


def default_prefill_lengths(max_cache_len: int) -> tuple[int, ...]:
    """Powers of two from :data:`DEFAULT_MIN_LENGTH` to :data:`DEFAULT_MAX_LENGTH` that a
    request can use (at most ``max_cache_len``: a request writes its prompt and at least
    one position more); a cache shorter than the shortest gets one bucket of its own
    length."""
    top = min(DEFAULT_MAX_LENGTH, max_cache_len)
    lengths, length = [], DEFAULT_MIN_LENGTH
    while length <= top:
        lengths.append(length)
        length *= 2
    return tuple(lengths) or (max_cache_len,)


def check_prefill_tokens(lengths: Sequence[int], config: BucketConfig, max_tokens: int) -> None:
    """Every prefill length must have a rows bucket of at most ``max_tokens`` rows x
    length: a length without one could never replay a graph, and its prefills would
    run eagerly without a word.

    Raises:
        CudaGraphsValueError: naming each such length, the smallest rows bucket and
            the ``prefill_tokens`` that would serve it.
    """
    fewest = min(b.rows for b in config.buckets())
    unserved = [n for n in lengths if fewest * n > max_tokens]
    if unserved:
        raise CudaGraphsValueError(
            f"prefill_lengths {unserved} cannot have a prefill graph: even the smallest "
            f"rows bucket ({fewest}) x length is above prefill_tokens={max_tokens}, so "
            "their prefills would always run eagerly. Fixes: 1. prefill_tokens >= "
            f"{fewest * max(unserved)}; 2. leave those lengths out of prefill_lengths"
        )


def check_prefill_lengths(lengths: Any, max_cache_len: int) -> tuple[int, ...]:
    """``prefill_lengths`` checked: distinct ints in ``[1, max_cache_len]``, sorted.

    Raises:
        CudaGraphsTypeError: not a sequence of ints.
        CudaGraphsValueError: a length outside ``[1, max_cache_len]`` or repeated.
    """
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise CudaGraphsTypeError(
            f"prefill_lengths must be a sequence of prompt lengths such as (16, 32, 64), "
            f"or None, got {type(lengths).__name__} {lengths!r}"
        )
    checked = [check_int(f"prefill_lengths[{i}]", n, minimum=1) for i, n in enumerate(lengths)]
    repeated = sorted({n for n in checked if checked.count(n) > 1})
    if repeated:
        raise CudaGraphsValueError(f"prefill_lengths repeats {repeated}; pass each length once")
    longer = [n for n in checked if n > max_cache_len]
    if longer:
        raise CudaGraphsValueError(
            f"prefill_lengths {longer} exceed max_cache_len={max_cache_len}: no request "
            "fits them. Drop them or build the generator with a longer cache"
        )
    return tuple(sorted(checked))


@dataclass(frozen=True)
class PrefillLength:
    """Where a request's prefill goes: the length bucket ``length`` it is padded to, or
    ``None`` and the ``eager_cause``: ``"longer"`` (the prompt is longer than every
    bucket) or ``"no_room"`` (padded to its bucket, the prompt and the new tokens would
    not fit the cache)."""

    length: int | None
    eager_cause: str | None = None


def choose_length(
    lengths: Sequence[int], prompt_len: int, max_new_tokens: int, max_cache_len: int
) -> PrefillLength:
    """The shortest length bucket that holds the prompt, when the padded request still
    fits the cache (``length + max_new_tokens - 1 <= max_cache_len``); a longer bucket
    never fits where the shortest does not, so there is no second choice. Pure policy:
    ``lengths`` sorted, as :func:`check_prefill_lengths` returns them."""
    for length in lengths:
        if length >= prompt_len:
            if length + max_new_tokens - 1 > max_cache_len:
                return PrefillLength(None, "no_room")
            return PrefillLength(length)
    return PrefillLength(None, "longer")


@dataclass(frozen=True)
class PrefillRun:
    """A replayed prefill: the last position's ``logits`` ``[batch, vocab]`` (float,
    owned) and the padded ``mask`` (bool ``[batch, length]``: the cache positions it
    wrote, the decode mask's prefix); or neither, and the ``eager_cause`` no graph
    served it for (:class:`PrefillLength`'s, ``"off"`` without length buckets, or
    :class:`~cudagraphs.serving.buckets.BucketChoice`'s for the rows)."""

    logits: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    eager_cause: str | None = None


class PrefillGraphs:
    """A :class:`~cudagraphs.serving.GraphRunner` per length bucket, over the rows
    buckets whose graphs hold at most ``max_tokens`` tokens, all capturing into one pool.
    Built at the generator's capture (it owns no memory until :meth:`capture`).

    Args:
        forward: ``forward(input_ids, position_ids, attention_mask) -> logits``
            ``[rows, vocab]``: the prefill at one length, its cache counters zeroed first.
        lengths: the length buckets (checked, sorted).
        config: the decode buckets (their rows and ``max_pad_ratio``).
        max_tokens: the cap on rows x length per graph.
        device, pool, require_all_buckets, capture_backend: as for the runner.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        lengths: Sequence[int],
        config: BucketConfig,
        max_tokens: int,
        *,
        device: torch.device,
        pool: Any,
        require_all_buckets: bool | None,
        capture_backend: Any,
    ) -> None:
        self.lengths = tuple(lengths)
        self.runners: dict[int, GraphRunner] = {}
        for length in self.lengths:
            rows = [b.rows for b in config.buckets() if b.rows * length <= max_tokens]
            if not rows:
                continue
            most = max(rows)
            specs = [
                InputSpec("input_ids", (most, length), torch.long),
                InputSpec("position_ids", (most, length), torch.long),
                # Padding rows attend to every position: finite junk, never NaN.
                InputSpec("attention_mask", (most, length), torch.long, pad_value=1),
            ]
            self.runners[length] = GraphRunner(
                forward,
                specs,
                BucketConfig(tuple(rows), max_pad_ratio=config.max_pad_ratio),
                device=device,
                pool=pool,
                require_all_buckets=require_all_buckets,
                capture_backend=capture_backend,
            )

    def capture(self, make_inputs: Callable[[int], Callable[..., Any]], **kwargs: Any) -> None:
        """Capture every length's runner (``make_inputs(length)`` gives its dummy
        inputs per bucket), one eager run before each bucket's capture."""
        for length, runner in self.runners.items():
            runner.capture(make_inputs(length), 1, **kwargs)

    def run(self, request: Request, max_cache_len: int) -> PrefillRun:
        """Replay the request's prefill, or say why no graph serves it."""
        if not self.runners:
            return PrefillRun(eager_cause="off")
        choice = choose_length(
            self.lengths, request.prompt_len, request.max_new_tokens, max_cache_len
        )
        if choice.length is None:
            return PrefillRun(eager_cause=choice.eager_cause)
        runner = self.runners.get(choice.length)
        if runner is None:  # no rows bucket fits this length under the token cap
            return PrefillRun(eager_cause="too_large")
        bucket = choose_bucket(runner.graphs, request.batch, None, runner.config.max_pad_ratio)
        if bucket.bucket is None:
            # The runner would run it eagerly itself; the eager prefill at the prompt's
            # own length is the cheaper one.
            return PrefillRun(eager_cause=bucket.eager_cause)
        pad = choice.length - request.prompt_len
        mask = F.pad(request.attention_mask, (pad, 0), value=False)
        inputs = {
            "input_ids": F.pad(request.input_ids, (pad, 0), value=0),
            "position_ids": positions_from_mask(mask),
            "attention_mask": mask.long(),
        }
        return PrefillRun(runner.run(inputs, copy_output=True), mask)

    @property
    def disabled(self) -> bool:
        """``CUDAGRAPHS_DISABLE`` was set at capture: the runners' stand-ins run the
        padded prefill eagerly on the same path."""
        return any(runner.disabled for runner in self.runners.values())

    def stats(self) -> dict[str, Any]:
        """Per length bucket, the runner's ``captured``, ``dropped``, ``replays`` and
        ``capture_seconds``."""
        return {
            str(length): {
                key: value
                for key, value in runner.stats().items()
                if key in ("captured", "dropped", "replays", "capture_seconds")
            }
            for length, runner in self.runners.items()
        }

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
