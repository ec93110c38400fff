"""Batch-size (and token-count) buckets: which graphs a runner captures and which one
a batch replays on. Pure policy, tested on the CPU."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import CudaGraphCaptureError

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "STRICT_BUCKETS_ENV",
    "Bucket",
    "BucketConfig",
    "check_dropped_buckets",
    "pad_ratio",
    "select_bucket",
]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Set to 1 to make any bucket dropped at startup an error (as ``require_all_buckets``).
STRICT_BUCKETS_ENV = "CUDAGRAPHS_REQUIRE_ALL_BUCKETS"


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


def _size_key(bucket: Bucket) -> tuple[int, int]:
    # Rows size the static buffers and the pool; capture and report the biggest first.
    return (bucket.rows, bucket.batch_size)


def _positive_ints(values: Iterable[int], what: str) -> tuple[int, ...]:
    out = tuple(values)
    bad = [v for v in out if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad or not out:
        raise ValueError(f"{what} must be a non-empty list of positive ints, got {list(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"{what} has duplicates: {list(out)}")
    return tuple(sorted(out))


@dataclass(frozen=True)
class BucketConfig:
    """Which buckets to capture.

    Args:
        batch_sizes: capture batch sizes; the largest is always captured.
        token_counts: for packed prefill, per batch size the token counts to capture;
            a batch size missing here gets one bucket with as many tokens as sequences
            (a decode step).
        max_pad_ratio: largest share of padding rows a replay may carry, in [0, 1);
            a batch that would pad more runs eagerly. ``None``: no limit.
    """

    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES
    token_counts: Mapping[int, Sequence[int]] | None = None
    max_pad_ratio: float | None = None
    _buckets: tuple[Bucket, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = _positive_ints(self.batch_sizes, "batch_sizes")
        object.__setattr__(self, "batch_sizes", sizes)
        if self.max_pad_ratio is not None and not 0.0 <= self.max_pad_ratio < 1.0:
            raise ValueError(f"max_pad_ratio must be in [0, 1), got {self.max_pad_ratio}")
        buckets: list[Bucket] = []
        if self.token_counts is None:
            buckets = [Bucket(bs) for bs in sizes]
        else:
            unknown = sorted(set(self.token_counts) - set(sizes))
            if unknown:
                raise ValueError(
                    f"token_counts names batch sizes {unknown} that are not in batch_sizes {list(sizes)}"
                )
            for bs in sizes:
                for tokens in _positive_ints(
                    self.token_counts.get(bs, ()) or (bs,), f"token_counts[{bs}]"
                ):
                    if tokens < bs:
                        raise ValueError(
                            f"token_counts[{bs}] holds {tokens}, fewer tokens than sequences"
                        )
                    buckets.append(Bucket(bs, tokens))
        # Capture order: largest first, so smaller graphs reuse the largest one's pool.
        object.__setattr__(self, "_buckets", tuple(sorted(buckets, key=_size_key, reverse=True)))

    def buckets(self) -> list[Bucket]:
        """Every configured bucket, in capture order (largest first)."""
        return list(self._buckets)

    @property
    def largest(self) -> Bucket:
        """The bucket with the most rows: it sizes the static buffers."""
        return self._buckets[0]


def pad_ratio(bucket: Bucket, batch_size: int, num_tokens: int | None = None) -> float:
    """Share of the bucket's rows that would be padding for this batch."""
    if bucket.num_tokens is not None and num_tokens is None:
        raise ValueError(f"{bucket} is a token bucket: pass num_tokens")
    real = batch_size if bucket.num_tokens is None else num_tokens
    return (bucket.rows - real) / bucket.rows


def select_bucket(
    captured: Iterable[Bucket],
    batch_size: int,
    num_tokens: int | None = None,
    max_pad_ratio: float | None = None,
) -> Bucket | None:
    """The tightest captured bucket that fits the batch, or ``None`` (run eagerly).

    A bucket fits when its batch size (and, for token buckets, its token count) is at
    least the batch's. Among those the smallest wins; with ``max_pad_ratio`` a bucket
    that would be padded more than that is refused.

    Raises:
        ValueError: a batch size below 1, or token buckets without ``num_tokens``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    fitting = []
    for b in captured:
        if b.batch_size < batch_size:
            continue
        if b.num_tokens is not None:
            if num_tokens is None:
                raise ValueError(f"{b} is a token bucket: pass num_tokens to select a bucket")
            if b.num_tokens < num_tokens:
                continue
        fitting.append(b)
    if not fitting:
        return None
    best = min(fitting, key=lambda b: (b.rows, b.batch_size))
    if max_pad_ratio is not None and pad_ratio(best, batch_size, num_tokens) > max_pad_ratio:
        return None
    return best


def check_dropped_buckets(dropped: Mapping[Bucket, str], require_all: bool | None = None) -> None:
    """Raise when buckets were dropped and the caller (or the environment) demands all.

    Args:
        dropped: bucket -> reason it was dropped (capture error, memory plan, ranks).
        require_all: ``True``/``False`` decides; ``None`` reads :data:`STRICT_BUCKETS_ENV`.

    Raises:
        CudaGraphCaptureError: listing every dropped bucket and why.
    """
    if require_all is None:
        require_all = os.environ.get(STRICT_BUCKETS_ENV, "0").strip().lower() in (
            "1",
            "true",
            "yes",
        )
    if require_all and dropped:
        ordered = sorted(dropped.items(), key=lambda item: _size_key(item[0]), reverse=True)
        lines = "\n  ".join(f"{b}: {why}" for b, why in ordered)
        raise CudaGraphCaptureError(
            f"{len(dropped)} bucket(s) were dropped at startup and all are required:\n  {lines}\n"
            f"Fix the causes, or allow dropped buckets (require_all_buckets=False, unset "
            f"{STRICT_BUCKETS_ENV})."
        )
