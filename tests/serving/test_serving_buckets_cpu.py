"""Serving bucket policies on the CPU: bucket configuration, bucket choice and pad
ratio, and dropped-bucket reporting."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraphs import CudaGraphCaptureError
from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError
from cudagraphs.serving import (
    DEFAULT_BATCH_SIZES,
    STRICT_BUCKETS_ENV,
    Bucket,
    BucketChoice,
    BucketConfig,
    check_dropped_buckets,
    choose_bucket,
    pad_ratio,
    select_bucket,
)
from cudagraphs.serving.buckets import size_key

# --------------------------------------------------------------------------- config


def test_default_config_captures_powers_of_two_largest_first():
    cfg = BucketConfig()
    assert cfg.batch_sizes == (1, 2, 4, 8, 16, 32, 64) == DEFAULT_BATCH_SIZES
    assert cfg.buckets() == [Bucket(bs) for bs in (64, 32, 16, 8, 4, 2, 1)]
    assert cfg.largest == Bucket(64)
    assert cfg.largest.rows == 64


def test_config_sorts_batch_sizes_and_returns_a_fresh_list():
    cfg = BucketConfig(batch_sizes=[8, 1, 3])
    assert cfg.batch_sizes == (1, 3, 8)
    assert cfg.buckets() == [Bucket(8), Bucket(3), Bucket(1)]
    cfg.buckets().clear()
    assert len(cfg.buckets()) == 3


@pytest.mark.parametrize("sizes", [[], [0], [-4], [1, 0, 2], [2, 2], [1, 4, 1]])
def test_config_rejects_bad_batch_sizes(sizes):
    with pytest.raises(ValueError, match="batch_sizes"):
        BucketConfig(batch_sizes=sizes)


@pytest.mark.parametrize("sizes", [[True], [1, True], [1.5], ["8"], 8, "8", None])
def test_config_rejects_batch_sizes_of_the_wrong_type(sizes):
    # Not ints (bool included: True is not a count), or not a sequence at all.
    with pytest.raises(CudaGraphsTypeError, match="batch_sizes"):
        BucketConfig(batch_sizes=sizes)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan")])
def test_config_rejects_max_pad_ratio_outside_unit_interval(ratio):
    with pytest.raises(ValueError, match="max_pad_ratio"):
        BucketConfig(max_pad_ratio=ratio)


@pytest.mark.parametrize("ratio", [None, 0.0, 0.5, 0.999])
def test_config_accepts_max_pad_ratio_in_unit_interval(ratio):
    assert BucketConfig(max_pad_ratio=ratio).max_pad_ratio == ratio


def test_config_rejects_token_counts_for_unknown_batch_sizes():
    with pytest.raises(ValueError, match=r"\[3, 5\]"):
        BucketConfig(batch_sizes=(1, 2, 4), token_counts={3: [8], 5: [8], 4: [8]})


@pytest.mark.parametrize("tokens", [[2], [4, 3], [0], [-1], [8, 8]])
def test_config_rejects_bad_token_counts(tokens):
    with pytest.raises(ValueError, match=r"token_counts\[4\]"):
        BucketConfig(batch_sizes=(1, 2, 4), token_counts={4: tokens})


def test_config_token_buckets_default_to_one_token_per_sequence():
    cfg = BucketConfig(batch_sizes=(1, 2, 4, 8), token_counts={4: [32, 4], 8: [64, 16]})
    # Capture order is by rows (what sizes the buffers and the pool), most first.
    assert cfg.buckets() == [
        Bucket(8, 64),
        Bucket(4, 32),
        Bucket(8, 16),
        Bucket(4, 4),
        Bucket(2, 2),
        Bucket(1, 1),
    ]
    assert cfg.largest == Bucket(8, 64)
    assert [b.rows for b in cfg.buckets()] == [64, 32, 16, 4, 2, 1]


def test_largest_bucket_is_the_one_with_most_rows():
    cfg = BucketConfig(token_counts={4: [512]})
    assert cfg.largest == Bucket(4, 512)
    assert cfg.buckets()[0] == Bucket(4, 512)
    # An empty list for a batch size means the same as leaving it out.
    assert BucketConfig(batch_sizes=(2,), token_counts={2: []}).buckets() == [Bucket(2, 2)]


def test_bucket_str_and_rows():
    assert str(Bucket(8)) == "bucket(bs=8)"
    assert str(Bucket(8, 32)) == "bucket(bs=8, tokens=32)"
    assert Bucket(8).rows == 8
    assert Bucket(8, 32).rows == 32


# --------------------------------------------------------------------------- selection

DEFAULT_BUCKETS = BucketConfig().buckets()


def brute_force_tightest(sizes, batch_size):
    fits = [s for s in sizes if s >= batch_size]
    return Bucket(min(fits)) if fits else None


@pytest.mark.parametrize("batch_size", range(1, 71))
def test_select_tightest_default_bucket(batch_size):
    expected = brute_force_tightest(DEFAULT_BATCH_SIZES, batch_size)
    assert select_bucket(DEFAULT_BUCKETS, batch_size) == expected
    if batch_size > 64:
        assert expected is None


def test_select_does_not_depend_on_bucket_order():
    for bs in (1, 3, 9, 33, 64):
        assert select_bucket(reversed(DEFAULT_BUCKETS), bs) == select_bucket(DEFAULT_BUCKETS, bs)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_select_rejects_batch_size_below_one(batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        select_bucket(DEFAULT_BUCKETS, batch_size)


def test_select_nothing_captured_runs_eagerly():
    assert select_bucket([], 1) is None


@pytest.mark.parametrize(
    ("batch_size", "ratio", "expected"),
    [
        (33, 0.4, None),  # 31/64 = 0.48 padding
        (33, 0.5, Bucket(64)),
        (32, 0.0, Bucket(32)),
        (31, 0.0, None),
        (3, 0.25, Bucket(4)),  # exactly at the limit is allowed
        (3, 0.24, None),
        (70, 0.9, None),
    ],
)
def test_select_max_pad_ratio_refuses_wasteful_padding(batch_size, ratio, expected):
    assert select_bucket(DEFAULT_BUCKETS, batch_size, max_pad_ratio=ratio) == expected


def test_select_on_captured_subset_picks_tightest_remaining():
    # 16 and 32 failed to capture (or were dropped by the memory plan).
    captured = [Bucket(bs) for bs in (64, 8, 4, 2, 1)]
    assert select_bucket(captured, 9) == Bucket(64)
    assert select_bucket(captured, 8) == Bucket(8)
    assert select_bucket(captured, 5) == Bucket(8)
    # Largest dropped: nothing fits above the largest captured.
    assert select_bucket([Bucket(bs) for bs in (32, 16, 1)], 33) is None
    assert select_bucket([Bucket(bs) for bs in (32, 16, 1)], 2) == Bucket(16)


TOKEN_BUCKETS = BucketConfig(batch_sizes=(1, 2, 4, 8), token_counts={4: [4, 32], 8: [16, 64]})


@pytest.mark.parametrize(
    ("batch_size", "num_tokens", "expected"),
    [
        (1, 1, Bucket(1, 1)),
        (2, 2, Bucket(2, 2)),
        (3, 20, Bucket(4, 32)),
        (3, 10, Bucket(8, 16)),  # fewest rows beats the smaller batch size
        (4, 4, Bucket(4, 4)),
        (5, 17, Bucket(8, 64)),
        (8, 64, Bucket(8, 64)),
        (5, 65, None),
        (9, 9, None),
    ],
)
def test_select_token_bucket_with_fewest_rows(batch_size, num_tokens, expected):
    assert select_bucket(TOKEN_BUCKETS.buckets(), batch_size, num_tokens) == expected


def test_select_token_bucket_ties_on_rows_take_smaller_batch():
    captured = [Bucket(8, 16), Bucket(4, 16)]
    assert select_bucket(captured, 3, 16) == Bucket(4, 16)
    assert select_bucket(list(reversed(captured)), 3, 16) == Bucket(4, 16)


def test_select_token_buckets_need_num_tokens():
    with pytest.raises(ValueError, match="num_tokens"):
        select_bucket(TOKEN_BUCKETS.buckets(), 3)


def test_select_token_bucket_pad_ratio_counts_tokens():
    # (8, 16) for 10 tokens: 6/16 = 0.375 padding.
    assert select_bucket(TOKEN_BUCKETS.buckets(), 3, 10, max_pad_ratio=0.375) == Bucket(8, 16)
    assert select_bucket(TOKEN_BUCKETS.buckets(), 3, 10, max_pad_ratio=0.3) is None


def test_pad_ratio_values():
    assert pad_ratio(Bucket(64), 33) == 31 / 64
    assert pad_ratio(Bucket(8), 8) == 0.0
    assert pad_ratio(Bucket(8), 1) == 7 / 8
    assert pad_ratio(Bucket(8, 16), 3, 10) == 6 / 16
    assert pad_ratio(Bucket(8, 16), 8, 16) == 0.0


@given(
    sizes=st.sets(st.integers(1, 128), min_size=1, max_size=10),
    batch_size=st.integers(1, 160),
    ratio=st.none() | st.floats(0.0, 0.99),
)
def test_select_property_chosen_fits_and_nothing_smaller_fits(sizes, batch_size, ratio):
    captured = [Bucket(s) for s in sizes]
    chosen = select_bucket(captured, batch_size, max_pad_ratio=ratio)
    tightest = brute_force_tightest(sizes, batch_size)
    if chosen is None:
        assert tightest is None or (ratio is not None and pad_ratio(tightest, batch_size) > ratio)
        return
    assert chosen in captured
    assert chosen.batch_size >= batch_size
    assert not [b for b in captured if batch_size <= b.batch_size < chosen.batch_size]
    if ratio is not None:
        assert pad_ratio(chosen, batch_size) <= ratio


@given(
    buckets=st.sets(
        st.tuples(st.integers(1, 16), st.integers(0, 64)).map(lambda t: Bucket(t[0], t[0] + t[1])),
        min_size=1,
        max_size=10,
    ),
    batch_size=st.integers(1, 20),
    extra_tokens=st.integers(0, 80),
)
def test_select_property_token_buckets(buckets, batch_size, extra_tokens):
    num_tokens = batch_size + extra_tokens
    chosen = select_bucket(buckets, batch_size, num_tokens)
    fits = [b for b in buckets if b.batch_size >= batch_size and b.num_tokens >= num_tokens]
    if chosen is None:
        assert not fits
        return
    assert chosen in fits
    assert chosen.rows == min(b.rows for b in fits)


def test_choose_says_why_a_batch_runs_eagerly():
    captured = [Bucket(2), Bucket(8)]
    assert choose_bucket([], 3) == BucketChoice(None, "no_graphs")
    assert choose_bucket(iter([]), 3, max_pad_ratio=0.5) == BucketChoice(None, "no_graphs")
    assert choose_bucket(captured, 9) == BucketChoice(None, "too_large")
    assert choose_bucket(captured, 3, max_pad_ratio=0.5) == BucketChoice(None, "pad_ratio")
    assert choose_bucket(captured, 3, max_pad_ratio=0.625) == BucketChoice(Bucket(8))
    assert choose_bucket(iter(captured), 2) == BucketChoice(Bucket(2), None)
    tokens = [Bucket(2, 8), Bucket(4, 4)]
    assert choose_bucket(tokens, 2, 9) == BucketChoice(None, "too_large")
    assert choose_bucket(tokens, 2, 2, max_pad_ratio=0.25) == BucketChoice(None, "pad_ratio")
    assert choose_bucket(tokens, 2, 3) == BucketChoice(Bucket(4, 4))


def test_choose_raises_what_select_raises():
    with pytest.raises(CudaGraphsValueError, match="batch_size must be >= 1, got 0"):
        choose_bucket([Bucket(2)], 0)
    with pytest.raises(CudaGraphsValueError, match="batch_size must be >= 1, got 0"):
        choose_bucket([], 0)
    with pytest.raises(CudaGraphsValueError, match=r"bucket\(bs=4, tokens=8\) is a token"):
        choose_bucket([Bucket(4, 8)], 2)


@given(
    sizes=st.sets(st.integers(1, 128), max_size=10),
    batch_size=st.integers(1, 160),
    ratio=st.none() | st.floats(0.0, 0.99),
)
def test_choose_property_the_cause_matches_the_bucket(sizes, batch_size, ratio):
    captured = [Bucket(s) for s in sizes]
    choice = choose_bucket(captured, batch_size, max_pad_ratio=ratio)
    assert choice.bucket == select_bucket(captured, batch_size, max_pad_ratio=ratio)
    tightest = brute_force_tightest(sizes, batch_size)
    if choice.bucket is not None:
        assert choice.eager_cause is None and choice.bucket == tightest
    elif not sizes:
        assert choice.eager_cause == "no_graphs"
    elif tightest is None:
        assert choice.eager_cause == "too_large"
    else:
        assert choice.eager_cause == "pad_ratio" and pad_ratio(tightest, batch_size) > ratio


def test_size_key_orders_by_rows_then_batch_size():
    assert size_key(Bucket(4)) == (4, 4)
    assert size_key(Bucket(2, 8)) == (8, 2)
    ordered = sorted([Bucket(4, 4), Bucket(2, 8), Bucket(1), Bucket(2, 4)], key=size_key)
    assert ordered == [Bucket(1), Bucket(2, 4), Bucket(4, 4), Bucket(2, 8)]


# --------------------------------------------------------------------------- dropped


DROPPED = {Bucket(64): "capture failed: out of memory", Bucket(16): "memory plan"}


def test_check_dropped_nothing_dropped_never_raises(monkeypatch):
    monkeypatch.setenv(STRICT_BUCKETS_ENV, "1")
    check_dropped_buckets({}, require_all=True)
    check_dropped_buckets({}, require_all=None)
    check_dropped_buckets({})


def test_check_dropped_require_all_lists_every_bucket_and_reason(monkeypatch):
    monkeypatch.delenv(STRICT_BUCKETS_ENV, raising=False)
    with pytest.raises(CudaGraphCaptureError) as info:
        check_dropped_buckets(DROPPED, require_all=True)
    msg = str(info.value)
    assert "2 bucket(s)" in msg
    assert "bucket(bs=64): capture failed: out of memory" in msg
    assert "bucket(bs=16): memory plan" in msg
    assert STRICT_BUCKETS_ENV in msg


def test_check_dropped_explicit_false_overrides_env(monkeypatch):
    monkeypatch.setenv(STRICT_BUCKETS_ENV, "1")
    check_dropped_buckets(DROPPED, require_all=False)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " True "])
def test_check_dropped_env_enables(monkeypatch, value):
    monkeypatch.setenv(STRICT_BUCKETS_ENV, value)
    with pytest.raises(CudaGraphCaptureError, match="bucket"):
        check_dropped_buckets(DROPPED)
    with pytest.raises(CudaGraphCaptureError, match="were dropped at startup"):
        check_dropped_buckets(DROPPED, require_all=None)


@pytest.mark.parametrize("value", ["0", "false", ""])
def test_check_dropped_env_disabled(monkeypatch, value):
    monkeypatch.setenv(STRICT_BUCKETS_ENV, value)
    check_dropped_buckets(DROPPED)


def test_check_dropped_env_unset_allows_dropping(monkeypatch):
    monkeypatch.delenv(STRICT_BUCKETS_ENV, raising=False)
    check_dropped_buckets(DROPPED)


def test_check_dropped_lists_buckets_in_capture_order_one_per_line():
    # Whatever order they were dropped in: most rows first (a token bucket's rows are
    # its tokens, not its batch size), equal rows by batch size, largest first.
    dropped = {
        Bucket(1, 1): "a",
        Bucket(2, 16): "b",
        Bucket(8, 16): "c",
        Bucket(4, 32): "d",
        Bucket(8, 64): "e",
    }
    with pytest.raises(CudaGraphCaptureError) as info:
        check_dropped_buckets(dropped, require_all=True)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("5 bucket(s) were dropped")
    assert lines[1:6] == [
        "  bucket(bs=8, tokens=64): e",
        "  bucket(bs=4, tokens=32): d",
        "  bucket(bs=8, tokens=16): c",
        "  bucket(bs=2, tokens=16): b",
        "  bucket(bs=1, tokens=1): a",
    ]
    assert "require_all_buckets=False" in lines[6] and STRICT_BUCKETS_ENV in lines[6]
