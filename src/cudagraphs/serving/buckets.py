"""Batch-size (and token-count) buckets: which graphs a runner captures and which one
a batch replays on (:func:`choose_bucket`, the one place a bucket is chosen). Pure
policy, tested on the CPU."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checks import check_int, check_number
from ..errors import CudaGraphCaptureError, CudaGraphsTypeError, CudaGraphsValueError
from ..settings import STRICT_BUCKETS_ENV, env_flag

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "STRICT_BUCKETS_ENV",
    "Bucket",
    "BucketChoice",
    "BucketConfig",
    "check_dropped_buckets",
    "choose_bucket",
    "pad_ratio",
    "select_bucket",
    "size_key",
    "warmup_runs",
]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# STRICT_BUCKETS_ENV (defined in ``settings``, re-exported here): set it to 1 to make any
# bucket dropped at startup an error, as ``require_all_buckets=True`` does.


@dataclass(frozen=True, order=True)
class Bucket:
    """One captured shape: a batch size and, for packed prefill, a token count."""

    batch_size: int
    num_tokens: int | None = None

    def __str__(self) -> str:
        if self.num_tokens is None:
            return f"bucket(bs={self.batch_size})"
        return f"bucket(bs={self.batch_size}, tokens={self.num_tokens})"

    @property
    def rows(self) -> int:
        """Leading rows of the static buffers this bucket uses (tokens when packed)."""
        return self.batch_size if self.num_tokens is None else self.num_tokens


def size_key(bucket: Bucket) -> tuple[int, int]:
    """How buckets compare by size: rows first (they size the static buffers and the
    pool), then batch size. Capture, reports and the choice of a bucket all order by it."""
    return (bucket.rows, bucket.batch_size)


def _positive_ints(values: Any, what: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    """``values`` as a sorted tuple of distinct ints >= 1, or an error naming ``what``."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise CudaGraphsTypeError(
            f"{what} must be a sequence of ints such as (1, 2, 4), got "
            f"{type(values).__name__} {values!r}"
        )
    out = tuple(values)
    for i, v in enumerate(out):
        check_int(f"{what}[{i}]", v)
    bad = [v for v in out if v < 1]
    if bad or not (out or allow_empty):
        raise CudaGraphsValueError(
            f"{what} must be a non-empty list of positive ints, got {list(out)}"
        )
    if len(set(out)) != len(out):
        raise CudaGraphsValueError(f"{what} has duplicates: {list(out)}")
    return tuple(sorted(int(v) for v in out))


@dataclass(frozen=True)
class BucketConfig:
    """Which buckets to capture. Every argument is checked here, at construction.

    Args:
        batch_sizes: capture batch sizes (a sequence of distinct ints >= 1); the
            largest is always captured.
        token_counts: for packed prefill, per batch size the token counts to capture
            (a mapping of int to a sequence of ints); a batch size missing here gets
            one bucket with as many tokens as sequences (a decode step).
        max_pad_ratio: largest share of padding rows a replay may carry, a number in
            [0, 1); a batch that would pad more runs eagerly. ``None``: no limit.

    Raises:
        CudaGraphsTypeError: an argument of the wrong type (``batch_sizes=8``,
            ``max_pad_ratio="0.5"``, token counts that are not ints), naming it.
        CudaGraphsValueError: sizes below 1, duplicates, a ratio outside [0, 1),
            token counts for unknown batch sizes or below their batch size.
    """

    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES
    token_counts: Mapping[int, Sequence[int]] | None = None
    max_pad_ratio: float | None = None
    _buckets: tuple[Bucket, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = _positive_ints(self.batch_sizes, "batch_sizes")
        object.__setattr__(self, "batch_sizes", sizes)
        if self.max_pad_ratio is not None:
            check_number("max_pad_ratio", self.max_pad_ratio)
            if not 0.0 <= self.max_pad_ratio < 1.0:
                raise CudaGraphsValueError(
                    f"max_pad_ratio must be in [0, 1), got {self.max_pad_ratio}"
                )
        if self.token_counts is None:
            buckets = [Bucket(bs) for bs in sizes]
        else:
            buckets = _token_buckets(self.token_counts, sizes)
        # Capture order: largest first, so smaller graphs reuse the largest one's pool.
        object.__setattr__(self, "_buckets", tuple(sorted(buckets, key=size_key, reverse=True)))

    def buckets(self) -> list[Bucket]:
        """Every configured bucket, in capture order (largest first)."""
        return list(self._buckets)

    @property
    def largest(self) -> Bucket:
        """The bucket with the most rows: it sizes the static buffers."""
        return self._buckets[0]


def _token_buckets(token_counts: Any, sizes: tuple[int, ...]) -> list[Bucket]:
    if not isinstance(token_counts, Mapping):
        raise CudaGraphsTypeError(
            "token_counts must be a mapping of batch size to token counts such as "
            f"{{8: (64, 256)}}, got {type(token_counts).__name__} {token_counts!r}"
        )
    for bs in token_counts:
        check_int(f"token_counts key {bs!r}", bs)
    unknown = sorted(set(token_counts) - set(sizes))
    if unknown:
        raise CudaGraphsValueError(
            f"token_counts names batch sizes {unknown} that are not in batch_sizes {list(sizes)}"
        )
    buckets = []
    for bs in sizes:
        counts = token_counts.get(bs)
        name = f"token_counts[{bs}]"
        # None or an empty list mean the same as leaving the batch size out.
        tokens_per_bucket = _positive_ints(() if counts is None else counts, name, allow_empty=True)
        for tokens in tokens_per_bucket or (bs,):
            if tokens < bs:
                raise CudaGraphsValueError(
                    f"token_counts[{bs}] holds {tokens}, fewer tokens than sequences"
                )
            buckets.append(Bucket(bs, tokens))
    return buckets


def pad_ratio(bucket: Bucket, batch_size: int, num_tokens: int | None = None) -> float:
    """Share of the bucket's rows that would be padding for this batch.

    Raises:
        CudaGraphsValueError: a token bucket without ``num_tokens``.
    """
    if bucket.num_tokens is not None and num_tokens is None:
        raise CudaGraphsValueError(f"{bucket} is a token bucket: pass num_tokens")
    real = batch_size if bucket.num_tokens is None else num_tokens
    return (bucket.rows - real) / bucket.rows


@dataclass(frozen=True)
class BucketChoice:
    """Where a batch goes: the captured ``bucket`` it replays on, or ``None`` and the
    ``eager_cause`` it runs eagerly for: ``"no_graphs"`` (nothing was captured),
    ``"too_large"`` (no captured bucket holds it) or ``"pad_ratio"`` (the tightest one
    would pad it more than ``max_pad_ratio``)."""

    bucket: Bucket | None
    eager_cause: str | None = None


def choose_bucket(
    captured: Iterable[Bucket],
    batch_size: int,
    num_tokens: int | None = None,
    max_pad_ratio: float | None = None,
) -> BucketChoice:
    """The tightest captured bucket that fits the batch, or why there is none.

    A bucket fits when its batch size (and, for token buckets, its token count) is at
    least the batch's. Among those the smallest (:func:`size_key`) wins; with
    ``max_pad_ratio`` a bucket that would be padded more than that is refused.

    Raises:
        CudaGraphsValueError: a batch size below 1, or token buckets without
            ``num_tokens``.
    """
    if batch_size < 1:
        raise CudaGraphsValueError(f"batch_size must be >= 1, got {batch_size}")
    fitting, any_captured = [], False
    for b in captured:
        any_captured = True
        if b.batch_size < batch_size:
            continue
        if b.num_tokens is not None:
            if num_tokens is None:
                raise CudaGraphsValueError(
                    f"{b} is a token bucket: pass num_tokens to select a bucket"
                )
            if b.num_tokens < num_tokens:
                continue
        fitting.append(b)
    if not fitting:
        return BucketChoice(None, "too_large" if any_captured else "no_graphs")
    best = min(fitting, key=size_key)
    if max_pad_ratio is not None and pad_ratio(best, batch_size, num_tokens) > max_pad_ratio:
        return BucketChoice(None, "pad_ratio")
    return BucketChoice(best)


def select_bucket(
    captured: Iterable[Bucket],
    batch_size: int,
    num_tokens: int | None = None,
    max_pad_ratio: float | None = None,
) -> Bucket | None:
    """The tightest captured bucket that fits the batch, or ``None`` (run eagerly):
    :func:`choose_bucket`'s bucket.

    Raises:
        CudaGraphsValueError: as :func:`choose_bucket`.
    """
    return choose_bucket(captured, batch_size, num_tokens, max_pad_ratio).bucket


def check_dropped_buckets(dropped: Mapping[Bucket, str], require_all: bool | None = None) -> None:
    """Raise when buckets were dropped and the caller (or the environment) demands all.

    Args:
        dropped: bucket -> reason it was dropped (capture error, memory plan, ranks).
        require_all: ``True``/``False`` decides; ``None`` reads :data:`STRICT_BUCKETS_ENV`
            through :func:`cudagraphs.settings.env_flag`.

    Raises:
        CudaGraphCaptureError: listing every dropped bucket and why.
        CudaGraphsValueError: :data:`STRICT_BUCKETS_ENV` holds something other than a
            boolean (read only when ``require_all`` is ``None``).
    """
    if require_all is None:
        require_all = env_flag(STRICT_BUCKETS_ENV)
    if require_all and dropped:
        ordered = sorted(dropped.items(), key=lambda item: size_key(item[0]), reverse=True)
        lines = "\n  ".join(f"{b}: {why}" for b, why in ordered)
        raise CudaGraphCaptureError(
            f"{len(dropped)} bucket(s) were dropped at startup and all are required:\n  {lines}\n"
            f"Fix the causes, or allow dropped buckets (require_all_buckets=False, unset "
            f"{STRICT_BUCKETS_ENV})."
        )


def warmup_runs(index: int, warmup: int, compiled: bool) -> int:
    """Eager runs before the capture of the ``index``-th bucket captured (0: the first).

    Why not ``warmup`` for every bucket: warmups are most of a runner's startup (the
    ``capture_seconds`` of ``benchmarks/results/serving_hf-*-startup.json``), and what
    they exist for happens once (cuBLAS handles, the warmup stream's workspaces, lazily
    built module state). One run per later bucket still meets what is built per shape;
    a compiled forward compiles per shape, in warmup, so every bucket gets the full
    count then.
    """
    if compiled or index == 0:
        return warmup
    return min(warmup, 1)
