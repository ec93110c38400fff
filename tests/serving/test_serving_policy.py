"""Serving policies on the CPU: bucket config and choice, pad ratio, dropped-bucket
reporting, shared static input buffers, row-dim inference and the memory plan."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudagraphs import CudaGraphCaptureError, CudaGraphInputError
from cudagraphs.errors import CudaGraphsTypeError
from cudagraphs.serving import (
    DEFAULT_BATCH_SIZES,
    STRICT_BUCKETS_ENV,
    Bucket,
    BucketConfig,
    BucketCost,
    InputSpec,
    MemoryPlan,
    MemoryUse,
    StaticInputs,
    check_dropped_buckets,
    infer_row_dim,
    pad_ratio,
    plan_buckets,
    select_bucket,
)
from cudagraphs.serving.memory import _size

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


# --------------------------------------------------------------------------- input specs


def test_input_spec_negative_row_dim_normalizes():
    spec = InputSpec("x", (2, 64, 4), torch.float32, row_dim=-2)
    assert spec.row_dim == 1
    assert spec.trailing == (2, 4)
    assert InputSpec("y", (64, 3), torch.float32, row_dim=-1).row_dim == 1


@pytest.mark.parametrize("row_dim", [3, -4, 10])
def test_input_spec_row_dim_out_of_range(row_dim):
    with pytest.raises(ValueError, match="'x'.*row_dim"):
        InputSpec("x", (2, 64, 4), torch.float32, row_dim=row_dim)


@pytest.mark.parametrize(("row_dim", "expected"), [(-3, 0), (-2, 1), (-1, 2), (0, 0), (2, 2)])
def test_input_spec_row_dim_range_ends_are_in_range(row_dim, expected):
    # [-rank, rank): -3 and 2 are the ends for a rank-3 shape.
    assert InputSpec("x", (64, 2, 4), torch.float32, row_dim=row_dim).row_dim == expected


@pytest.mark.parametrize(
    ("dtype", "pad", "holds"),
    [
        (torch.int8, -128, True),  # the ends of an integer dtype's range are values of it
        (torch.int8, 127, True),
        (torch.int8, -129, False),
        (torch.int8, 128, False),
        (torch.uint8, 255, True),
        (torch.uint8, -1, False),
        (torch.int64, 3.0, True),
        (torch.int64, 2.5, False),
        (torch.float32, 0.5, True),  # floating and complex dtypes: any number
        (torch.float16, -2.5, True),
        (torch.complex64, 0.25, True),
        (torch.bool, True, True),
        (torch.bool, 0, True),
        (torch.bool, -1, False),
    ],
)
def test_input_spec_pad_value_must_be_a_value_of_its_dtype(dtype, pad, holds):
    if holds:
        assert InputSpec("x", (4,), dtype, pad_value=pad).pad_value == pad
    else:
        with pytest.raises(ValueError, match=rf"'x': pad_value {pad} is not a value of {dtype};"):
            InputSpec("x", (4,), dtype, pad_value=pad)


@pytest.mark.parametrize("dtype", [torch.uint4, torch.bits8, torch.quint8])
def test_input_spec_refuses_dtypes_a_buffer_cannot_hold(dtype):
    # Sub-byte, bits and quantized dtypes cannot be filled with a pad value (torch
    # raises untyped errors, or asserts): refused at the spec, naming the input.
    with pytest.raises(CudaGraphsTypeError, match=rf"'x': dtype {dtype} cannot be a static input"):
        InputSpec("x", (4,), dtype)


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.uint16, torch.complex64, torch.bool, torch.int64]
)
def test_input_spec_takes_every_plain_dtype(dtype):
    spec = InputSpec("x", (4,), dtype)
    assert StaticInputs([spec], 4, "cpu").views(Bucket(4))["x"].dtype == dtype


def test_static_inputs_rejects_duplicate_names():
    specs = [InputSpec("x", (8, 2), torch.float32), InputSpec("x", (8, 3), torch.float32)]
    with pytest.raises(ValueError, match="repeat"):
        StaticInputs(specs, 8, "cpu")


def test_static_inputs_rejects_wrong_max_rows():
    specs = [
        InputSpec("ok", (8, 2), torch.float32),
        InputSpec("bad", (2, 4), torch.float32, row_dim=1),
    ]
    with pytest.raises(ValueError, match=r"\['bad'\]"):
        StaticInputs(specs, 8, "cpu")


# --------------------------------------------------------------------------- static inputs

BUCKETS = [Bucket(64), Bucket(8), Bucket(2)]


def make_inputs(pad_kv=0):
    specs = [
        InputSpec("ids", (64,), torch.int64, pad_value=-1),
        InputSpec("h", (64, 3), torch.float32),
        InputSpec("kv", (2, 64, 4), torch.float32, row_dim=1, pad_value=pad_kv),
    ]
    return StaticInputs(specs, 64, "cpu")


def batch(rows, fill=1.0):
    return {
        "ids": torch.arange(rows, dtype=torch.int64) + 100,
        "h": torch.full((rows, 3), fill) + torch.arange(rows, dtype=torch.float32)[:, None],
        "kv": torch.full((2, rows, 4), fill) + torch.arange(rows, dtype=torch.float32)[:, None],
    }


def snapshot(s):
    return {k: v.clone() for k, v in s._storage.items()}


def assert_storage_equal(s, snap):
    for name, t in s._storage.items():
        assert torch.equal(t, snap[name]), name


def test_buffers_sized_at_largest_bucket_row_dim_first():
    s = make_inputs()
    assert s.max_rows == 64
    assert s.device == torch.device("cpu")
    assert s._storage["ids"].shape == (64,)
    assert s._storage["h"].shape == (64, 3)
    assert s._storage["kv"].shape == (64, 2, 4)
    assert s.nbytes == 64 * 8 + 64 * 3 * 4 + 2 * 64 * 4 * 4
    # Fresh buffers hold each input's pad value.
    assert (s._storage["ids"] == -1).all()


def test_row_dim_zero_view_is_storage_rows():
    s = make_inputs()
    v = s.view("h", 8)
    assert v.shape == (8, 3)
    assert v.data_ptr() == s._storage["h"].data_ptr()
    assert v.is_contiguous()


def test_moved_row_dim_view_shares_storage_with_largest_bucket():
    s = make_inputs()
    v8, v64 = s.view("kv", 8), s.view("kv", 64)
    assert v8.shape == (2, 8, 4)
    assert v64.shape == (2, 64, 4)
    assert v8.untyped_storage().data_ptr() == v64.untyped_storage().data_ptr()
    assert v8.data_ptr() == v64.data_ptr() == s._storage["kv"].data_ptr()
    # Writing through the small view is visible through the large one.
    v8[1, 7, 3] = 42.0
    assert v64[1, 7, 3] == 42.0


@pytest.mark.parametrize("name", ["ids", "h", "kv"])
def test_every_bucket_slice_is_a_contiguous_leading_block(name):
    s = make_inputs()
    base = s._storage[name]
    row_bytes = base[0].numel() * base.element_size()
    for b in BUCKETS:
        block = base[: b.rows]
        assert block.is_contiguous()
        assert block.data_ptr() == base.data_ptr()
        # The bucket's view covers exactly the first rows * row_bytes bytes of storage.
        v = s.view(name, b.rows)
        assert v.data_ptr() == base.data_ptr()
        assert v.numel() * v.element_size() == b.rows * row_bytes


def test_views_per_bucket():
    s = make_inputs()
    views = s.views(Bucket(8))
    assert set(views) == {"ids", "h", "kv"}
    assert views["ids"].shape == (8,)
    assert views["h"].shape == (8, 3)
    assert views["kv"].shape == (2, 8, 4)
    assert s.views(Bucket(4, 16))["kv"].shape == (2, 16, 4)  # token bucket: rows = tokens


def fill_storage(s, value):
    for t in s._storage.values():
        t.fill_(value)


@pytest.mark.parametrize("pad_kv", [0, -1])
def test_stage_copies_rows_pads_bucket_and_leaves_rest(pad_kv):
    s = make_inputs(pad_kv=pad_kv)
    fill_storage(s, 7)
    inputs = batch(5)
    s.stage(inputs, Bucket(8), 5)
    for name, spec in s.specs.items():
        view = s.view(name, 8).movedim(spec.row_dim, 0)
        real = inputs[name].movedim(spec.row_dim, 0)
        assert torch.equal(view[:5], real), name
        assert (view[5:8] == spec.pad_value).all(), name
        assert (s._storage[name][8:] == 7).all(), name
    assert torch.equal(s.view("kv", 8)[:, :5], inputs["kv"])
    assert (s.view("ids", 8)[5:] == -1).all()
    assert (s.view("kv", 8)[:, 5:] == pad_kv).all()


def test_stage_full_bucket_has_no_padding():
    s = make_inputs()
    fill_storage(s, 7)
    inputs = batch(8, fill=3.0)
    s.stage(inputs, Bucket(8), 8)
    for name in s.specs:
        assert torch.equal(s.view(name, 8), inputs[name]), name
        assert (s._storage[name][8:] == 7).all(), name


def test_stage_smaller_batch_resets_previous_rows():
    s = make_inputs(pad_kv=-1)
    s.stage(batch(8, fill=5.0), Bucket(8), 8)
    s.stage(batch(2, fill=1.0), Bucket(8), 2)
    assert torch.equal(s.view("h", 8)[:2], batch(2, fill=1.0)["h"])
    assert (s.view("h", 8)[2:] == 0).all()
    assert (s.view("kv", 8)[:, 2:] == -1).all()


@pytest.mark.parametrize(
    ("mutate", "expected", "field"),
    [
        (
            lambda d: d.pop("h"),
            [
                "Missing inputs: ['h']",
                "inputs: names expected ['h', 'ids', 'kv'], received ['ids', 'kv']",
            ],
            "names",
        ),
        (lambda d: d.update(extra=torch.zeros(5)), ["Unknown inputs: ['extra']"], "names"),
        (
            lambda d: d.update(h=d["h"].double()),
            ["inputs['h']: dtype expected torch.float32, received torch.float64"],
            "dtype",
        ),
        (
            lambda d: d.update(ids=d["ids"].to("meta")),
            [
                "inputs['ids']: device",
                "meta",
                "inputs['ids']: device expected device(type='cpu'), received device(type='meta')",
            ],
            "device",
        ),
        (
            lambda d: d.update(h=torch.zeros(5, 4)),
            ["inputs['h']: shape expected (5, 3), received (5, 4)"],
            "shape",
        ),
        (
            lambda d: d.update(kv=torch.zeros(3, 5, 4)),
            ["inputs['kv']: shape expected (2, 5, 4), received (3, 5, 4)"],
            "shape",
        ),
        (
            lambda d: d.update(h=torch.zeros(5, 3, 1)),
            ["inputs['h']: shape expected (5, 3), received (5, 3, 1)"],
            "shape",
        ),
        (
            lambda d: d.update(ids=torch.zeros(4, dtype=torch.int64)),
            ["inputs['ids']: rows in dim 0 expected 5, received 4"],
            "rows in dim 0",
        ),
        (
            lambda d: d.update(kv=torch.zeros(2, 6, 4)),
            ["inputs['kv']: rows in dim 1 expected 5, received 6"],
            "rows in dim 1",
        ),
        (
            lambda d: d.update(h=[[1.0] * 3] * 5),
            ["inputs['h']: type expected 'Tensor', received 'list'"],
            "type",
        ),
    ],
    ids=[
        "missing",
        "unknown",
        "dtype",
        "device",
        "trailing",
        "trailing-moved",
        "rank",
        "rows",
        "rows-moved",
        "not-tensor",
    ],
)
def test_validate_and_stage_reject_naming_input_and_bucket(mutate, expected, field):
    s = make_inputs()
    fill_storage(s, 7)
    before = snapshot(s)
    inputs = batch(5)
    mutate(inputs)
    with pytest.raises(CudaGraphInputError) as info:
        s.validate(inputs, Bucket(8), 5)
    msg = str(info.value)
    assert "inputs for bucket(bs=8) (5 rows)" in msg
    assert "Nothing was staged." in msg
    for part in expected:
        assert part in msg
    assert [m.field for m in info.value.mismatches] == [field]
    with pytest.raises(CudaGraphInputError, match="Nothing was staged"):
        s.stage(inputs, Bucket(8), 5)
    assert_storage_equal(s, before)


def test_validate_rows_larger_than_bucket():
    s = make_inputs()
    before = snapshot(s)
    with pytest.raises(
        CudaGraphInputError,
        match=r"inputs: rows expected at most 8, the rows of bucket\(bs=8\), received 9",
    ):
        s.stage(batch(9), Bucket(8), 9)
    assert_storage_equal(s, before)


def test_validate_reports_every_problem_at_once():
    s = make_inputs()
    inputs = batch(5)
    inputs["h"] = inputs["h"].double()
    inputs["kv"] = torch.zeros(3, 5, 4)
    del inputs["ids"]
    with pytest.raises(CudaGraphInputError) as info:
        s.stage(inputs, Bucket(8), 5)
    msg = str(info.value)
    assert "in 3 place(s)" in msg
    assert "Missing inputs: ['ids']" in msg
    assert "inputs['h']: dtype expected torch.float32, received torch.float64" in msg
    assert "inputs['kv']: shape expected (2, 5, 4), received (3, 5, 4)" in msg
    assert "Nothing was staged" in msg
    assert [(m.path, m.field) for m in info.value.mismatches] == [
        ("inputs", "names"),
        ("inputs['h']", "dtype"),
        ("inputs['kv']", "shape"),
    ]


def test_input_error_is_a_value_error():
    s = make_inputs()
    with pytest.raises(ValueError, match="differ from the runner's input specs"):
        s.validate({}, Bucket(8), 1)


def test_validate_passes_and_writes_nothing():
    s = make_inputs()
    before = snapshot(s)
    s.validate(batch(5), Bucket(8), 5)
    assert_storage_equal(s, before)


def test_validate_accepts_tensors_on_the_buffers_device_with_index():
    s = StaticInputs([InputSpec("x", (4, 2), torch.float32)], 4, "cpu:0")
    assert s._storage["x"].device == torch.device("cpu")
    s.stage({"x": torch.ones(2, 2)}, Bucket(4), 2)


def test_buffers_are_made_on_the_given_device():
    # The meta device stands in for a GPU here: the buffers are made where asked, and
    # batches are compared against that device.
    s = StaticInputs([InputSpec("x", (4, 2), torch.float32)], 4, "meta")
    assert s.device == torch.device("meta")
    assert s._storage["x"].device == torch.device("meta")
    assert s.view("x", 2).is_meta
    s.validate({"x": torch.zeros(2, 2, device="meta")}, Bucket(4), 2)
    with pytest.raises(
        CudaGraphInputError,
        match=r"inputs\['x'\]: device expected device\(type='meta'\), received device\(type='cpu'\)",
    ):
        s.validate({"x": torch.zeros(2, 2)}, Bucket(4), 2)


def test_stage_pads_each_input_with_its_own_value():
    specs = [
        InputSpec("zero", (8,), torch.float32),
        InputSpec("one", (8,), torch.int64, pad_value=1),
        InputSpec("half", (8, 2), torch.float32, pad_value=0.5),
        InputSpec("mask", (8,), torch.bool, pad_value=True),
    ]
    s = StaticInputs(specs, 8, "cpu")
    full = {
        "zero": torch.arange(8.0) + 10,
        "one": torch.arange(8) + 10,
        "half": torch.full((8, 2), 3.0),
        "mask": torch.zeros(8, dtype=torch.bool),
    }
    s.stage(full, Bucket(8), 8)
    s.stage({name: t[:3] for name, t in full.items()}, Bucket(8), 3)
    for name, t in full.items():
        assert torch.equal(s.view(name, 8)[:3], t[:3]), name
    assert torch.equal(s.view("zero", 8)[3:], torch.zeros(5))
    assert torch.equal(s.view("one", 8)[3:], torch.ones(5, dtype=torch.int64))
    assert torch.equal(s.view("half", 8)[3:], torch.full((5, 2), 0.5))
    assert s.view("mask", 8)[3:].all()


def test_an_exact_batch_takes_the_per_call_fast_path(monkeypatch):
    # The per-call check: an exact match (rows up to a bucket's, a bucket up to the
    # buffers', every dtype, device and shape equal) never runs the full report.
    s = make_inputs()
    for rows, bucket in ((5, Bucket(8)), (8, Bucket(8)), (1, Bucket(2)), (64, Bucket(64))):
        assert s._matches(batch(rows), bucket, rows), (rows, bucket)
    assert s._matches(batch(7), None, 7)

    def full_check(*args):
        raise AssertionError("the full check ran for an exact batch")

    monkeypatch.setattr(StaticInputs, "mismatches", full_check)
    s.validate(batch(5), Bucket(8), 5)
    s.stage(batch(8), Bucket(8), 8)


@pytest.mark.parametrize(
    ("mutate", "bucket", "rows"),
    [
        (lambda d: d.update(ids=d["ids"].int()), Bucket(8), 5),  # lossless: full check passes
        (lambda d: d.update(ids=d["ids"].to("meta")), Bucket(8), 5),
        (lambda d: d.update(h=torch.zeros(5, 4)), Bucket(8), 5),
        (lambda d: d.update(h=torch.zeros(4, 3)), Bucket(8), 5),
        (lambda d: d.update(h=[[1.0] * 3] * 5), Bucket(8), 5),
        (lambda d: d.update(extra=torch.zeros(5)), Bucket(8), 5),
        (lambda d: d.pop("kv"), Bucket(8), 5),
        (lambda d: None, Bucket(4), 5),  # more rows than the bucket
        (lambda d: None, Bucket(128), 5),  # a bucket larger than the buffers
    ],
)
def test_anything_but_an_exact_batch_takes_the_full_check(mutate, bucket, rows):
    s = make_inputs()
    inputs = batch(rows)
    mutate(inputs)
    assert not s._matches(inputs, bucket, rows)
    assert not s._matches(list(inputs.values()), bucket, rows)


@pytest.mark.parametrize(
    ("x", "field"),
    [
        (torch.zeros(2, 2, dtype=torch.float64), "dtype"),
        (torch.zeros(2, 2, device="meta"), "device"),
        (torch.zeros(3, 2), "rows in dim 0"),
        (torch.zeros(2, 3), "shape"),
        ([[0.0, 0.0]] * 2, "type"),
    ],
)
def test_a_single_input_that_differs_in_one_way_is_refused(x, field):
    # With one input, nothing else in the batch can send it to the full check.
    s = StaticInputs([InputSpec("x", (4, 2), torch.float32)], 4, "cpu")
    before = snapshot(s)
    with pytest.raises(CudaGraphInputError) as info:
        s.stage({"x": x}, Bucket(4), 2)
    assert [(m.path, m.field) for m in info.value.mismatches] == [("inputs['x']", field)]
    assert_storage_equal(s, before)


def test_inputs_named_by_keys_that_are_not_str_are_reported():
    s = make_inputs()
    inputs = batch(5)
    del inputs["ids"]
    inputs[0] = torch.zeros(5)
    inputs["extra"] = torch.zeros(5)
    with pytest.raises(CudaGraphInputError) as info:
        s.validate(inputs, Bucket(8), 5)
    assert [(m.path, m.field, m.expected, m.received) for m in info.value.mismatches] == [
        ("inputs", "names", ["h", "ids", "kv"], [0, "extra", "h", "kv"])
    ]
    assert "Nothing was staged. Missing inputs: ['ids']. Unknown inputs: [0, 'extra']. Pass" in (
        str(info.value)
    )


def test_a_batch_that_is_not_a_mapping_gets_the_whole_report():
    s = make_inputs()
    with pytest.raises(CudaGraphInputError) as info:
        s.validate([torch.zeros(5)], Bucket(8), 5)
    assert str(info.value) == (
        "inputs for bucket(bs=8) (5 rows) differ from the runner's input specs in 1 place(s):\n"
        "  inputs: type expected 'Mapping[str, Tensor]', received 'list'\n"
        "Nothing was staged. Pass every input named in the specs, each a tensor on cpu with "
        "its spec's dtype (or one that converts to it losslessly, such as int32 into int64) "
        "and its spec's shape, with the batch's rows in its row_dim."
    )
    assert [(m.path, m.field, m.received) for m in info.value.mismatches] == [
        ("inputs", "type", "list")
    ]


def test_a_one_dim_input_of_the_wrong_rank_shows_its_shape_as_a_tuple():
    s = make_inputs()
    inputs = batch(5)
    inputs["ids"] = torch.zeros(5, 2, dtype=torch.int64)
    with pytest.raises(
        CudaGraphInputError, match=r"inputs\['ids'\]: shape expected \(5,\), received \(5, 2\)\n"
    ):
        s.validate(inputs, Bucket(8), 5)


# --------------------------------------------------------------------------- batch rows


def test_batch_rows_is_the_count_every_input_holds_in_its_row_dim():
    s = make_inputs()
    assert s.batch_rows(batch(5)) == 5
    assert s.batch_rows(batch(64)) == 64
    assert s.batch_rows(batch(70)) == 70  # too large for every bucket: still counted


def test_batch_rows_that_disagree_are_one_mismatch_listing_every_count():
    s = make_inputs()
    inputs = batch(5)
    inputs["h"] = torch.zeros(4, 3)
    with pytest.raises(CudaGraphInputError) as info:
        s.batch_rows(inputs)
    assert [(m.path, m.field, m.received) for m in info.value.mismatches] == [
        ("inputs", "row counts", {"ids": 5, "h": 4, "kv": 5})
    ]
    # No bucket and no rows yet: the headline says neither.
    assert str(info.value).startswith(
        "inputs differ from the runner's input specs in 1 place(s):\n"
        "  inputs: row counts expected one count for all, received {'ids': 5, 'h': 4, 'kv': 5}\n"
        "Nothing was staged. Pass every input named"
    )


def test_batch_rows_of_a_batch_missing_an_input_reports_the_names_only():
    s = make_inputs()
    inputs = batch(5)
    del inputs["h"]
    with pytest.raises(CudaGraphInputError, match=r"^inputs differ") as info:
        s.batch_rows(inputs)
    assert [(m.path, m.field) for m in info.value.mismatches] == [("inputs", "names")]


def test_batch_rows_shape_report_says_rows_where_the_count_is_unknown():
    s = make_inputs()
    inputs = batch(5)
    inputs["ids"] = torch.zeros(4, 2, dtype=torch.int64)
    inputs["h"] = torch.zeros(4, 4)
    inputs["kv"] = torch.zeros(3, 5, 4)
    with pytest.raises(CudaGraphInputError) as info:
        s.batch_rows(inputs)
    assert [str(m) for m in info.value.mismatches] == [
        "inputs['ids']: shape expected (rows,), received (4, 2)",
        "inputs['h']: shape expected (rows, 3), received (4, 4)",
        "inputs['kv']: shape expected (2, rows, 4), received (3, 5, 4)",
    ]


# --------------------------------------------------------------------------- infer_row_dim


@pytest.mark.parametrize(
    ("large", "small", "rows_large", "rows_small", "expected"),
    [
        ((64, 3), (8, 3), 64, 8, 0),
        ((2, 64, 4), (2, 8, 4), 64, 8, 1),
        ((2, 4, 64), (2, 4, 8), 64, 8, 2),
        ((64,), (8,), 64, 8, 0),
        # Same rows in both buckets (e.g. packed tokens equal): the unique dim holding them.
        ((2, 16, 4), (2, 16, 4), 16, 16, 1),
    ],
)
def test_infer_row_dim_finds_the_batch_dim(large, small, rows_large, rows_small, expected):
    assert infer_row_dim("x", large, small, rows_large, rows_small) == expected


@pytest.mark.parametrize(
    ("large", "small", "rows_large", "rows_small"),
    [
        ((64, 3), (8, 3, 1), 64, 8),  # rank differs
        ((64, 64), (8, 8), 64, 8),  # two dims differ
        ((2, 64), (2, 64), 64, 8),  # nothing differs
        ((64, 3), (32, 3), 64, 8),  # differing dim does not hold the row counts
        ((16, 16), (16, 16), 16, 16),  # equal rows, ambiguous
        ((4, 3), (4, 3), 16, 16),  # equal rows, no dim holds them
    ],
)
def test_infer_row_dim_errors(large, small, rows_large, rows_small):
    with pytest.raises(ValueError, match="'x'"):
        infer_row_dim("x", large, small, rows_large, rows_small)


# --------------------------------------------------------------------------- memory plan


def cost(bs, pool_per_row=100, eager_per_row=10, nodes=10, per_node=1.0):
    return BucketCost(Bucket(bs), bs * eager_per_row, bs * pool_per_row, nodes, per_node)


COSTS = [cost(bs) for bs in (1, 2, 4, 8)]  # pool 100..800, exec 10 each, eager 10..80


def test_bucket_cost_exec_bytes():
    assert BucketCost(Bucket(1), 0, 0, 7, 2.5).exec_bytes == 17


def test_plan_everything_fits():
    plan = plan_buckets(COSTS, 10_000)
    assert plan.chosen == (Bucket(8), Bucket(4), Bucket(2), Bucket(1))
    assert plan.dropped == {}
    assert plan.predicted_pool_bytes == 800  # shared pool: the largest
    assert plan.predicted_exec_bytes == 40  # one executable per graph
    assert plan.predicted_bytes == 840
    assert plan.eager_reserve_bytes == 80
    assert plan.budget_bytes == 10_000
    assert "dropped: none" in plan.describe()


def test_plan_exact_fit_keeps_everything():
    assert len(plan_buckets(COSTS, 80 + 840).chosen) == 4
    assert plan_buckets(COSTS, 80 + 839).chosen == (Bucket(4), Bucket(2), Bucket(1))


def test_plan_tight_budget_drops_largest_first():
    plan = plan_buckets(COSTS, 80 + 430)
    assert plan.chosen == (Bucket(4), Bucket(2), Bucket(1))
    assert set(plan.dropped) == {Bucket(8)}
    assert plan.predicted_pool_bytes == 400
    assert plan.predicted_exec_bytes == 30
    text = plan.describe()
    assert "3 bucket(s)" in text
    assert "bucket(bs=8)" in text and "does not fit" in text


def test_plan_drops_most_expensive_not_largest_batch():
    # Bucket 2 has an unusually large pool: it goes before bucket 8.
    costs = [cost(1), BucketCost(Bucket(2), 20, 5_000, 10, 1.0), cost(4), cost(8)]
    plan = plan_buckets(costs, 80 + 830)
    assert plan.chosen == (Bucket(8), Bucket(4), Bucket(1))
    assert set(plan.dropped) == {Bucket(2)}


def test_plan_pool_tie_broken_by_exec_bytes():
    costs = [
        BucketCost(Bucket(1), 0, 100, 10, 1.0),
        BucketCost(Bucket(2), 0, 100, 50, 1.0),
        BucketCost(Bucket(4), 0, 100, 20, 1.0),
    ]
    plan = plan_buckets(costs, 100 + 30)
    assert plan.chosen == (Bucket(4), Bucket(1))
    assert set(plan.dropped) == {Bucket(2)}


def test_plan_subtracts_eager_reserve_and_headroom():
    # Without the reserve 430 would hold bucket 4; one byte of headroom drops it.
    plan = plan_buckets(COSTS, 80 + 430, headroom_bytes=1)
    assert plan.eager_reserve_bytes == 81
    assert plan.chosen == (Bucket(2), Bucket(1))
    assert set(plan.dropped) == {Bucket(8), Bucket(4)}
    # The reserve is the largest eager peak, not the sum.
    assert plan_buckets(COSTS, 10_000, headroom_bytes=5).eager_reserve_bytes == 85


def test_plan_reserve_uses_dropped_buckets_eager_peak():
    # Batches above the largest kept bucket run eagerly: their peak stays reserved.
    plan = plan_buckets(COSTS, 80 + 230)
    assert plan.chosen == (Bucket(2), Bucket(1))
    assert plan.eager_reserve_bytes == 80


@pytest.mark.parametrize("free", [0, 80, 100])
def test_plan_no_budget_drops_everything_with_reasons(free):
    plan = plan_buckets(COSTS, free)
    assert plan.chosen == ()
    assert set(plan.dropped) == {c.bucket for c in COSTS}
    assert all("does not fit" in why for why in plan.dropped.values())
    assert plan.predicted_pool_bytes == 0
    assert plan.predicted_exec_bytes == 0
    assert plan.predicted_bytes == 0
    text = plan.describe()
    assert "0 bucket(s)" in text
    for bs in (1, 2, 4, 8):
        assert f"bucket(bs={bs})" in text


def test_plan_empty_costs():
    plan = plan_buckets([], 0)
    assert plan.chosen == () and plan.dropped == {}
    assert plan.eager_reserve_bytes == 0


def test_plan_duplicate_buckets_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([cost(4), cost(4, pool_per_row=1)], 10_000)


@pytest.mark.parametrize(("free", "headroom"), [(-1, 0), (100, -1)])
def test_plan_negative_budget_rejected(free, headroom):
    with pytest.raises(ValueError, match=">= 0"):
        plan_buckets(COSTS, free, headroom_bytes=headroom)


def test_plan_feeds_check_dropped_buckets():
    plan = plan_buckets(COSTS, 80 + 430)
    check_dropped_buckets(plan.dropped, require_all=False)
    with pytest.raises(CudaGraphCaptureError, match="bucket\\(bs=8\\): does not fit"):
        check_dropped_buckets(plan.dropped, require_all=True)


def test_plan_token_buckets():
    costs = [
        BucketCost(Bucket(4, 64), 10, 640, 10, 1.0),
        BucketCost(Bucket(4, 16), 10, 160, 10, 1.0),
        BucketCost(Bucket(1, 1), 10, 10, 10, 1.0),
    ]
    plan = plan_buckets(costs, 10 + 160 + 20)
    assert plan.chosen == (Bucket(4, 16), Bucket(1, 1))
    assert set(plan.dropped) == {Bucket(4, 64)}


def test_plan_says_what_each_dropped_bucket_needed_and_what_was_free():
    plan = plan_buckets(COSTS, 80 + 430)
    assert plan.dropped == {
        Bucket(8): "does not fit: the plan needed 840 B with it, 430 B are free beside the "
        "eager reserve"
    }
    # Less than the eager reserve: nothing is free (not a negative size). Dropped in
    # order, each with what the plan still needed with it.
    plan = plan_buckets(COSTS, 50)
    assert list(plan.dropped.items()) == [
        (
            Bucket(bs),
            f"does not fit: the plan needed {need} B with it, 0 B are free beside the "
            "eager reserve",
        )
        for bs, need in ((8, 840), (4, 430), (2, 220), (1, 110))
    ]


def costs_strategy():
    one = st.tuples(
        st.integers(0, 2_000),  # eager peak
        st.integers(0, 5_000),  # pool
        st.integers(0, 40),  # nodes
        st.sampled_from([0.0, 0.5, 1.0, 16.0]),  # bytes per node
    )
    return st.lists(one, max_size=8).map(
        lambda rows: [BucketCost(Bucket(i + 1), *row) for i, row in enumerate(rows)]
    )


def need(costs):
    return max((c.pool_bytes for c in costs), default=0) + sum(c.exec_bytes for c in costs)


@given(costs=costs_strategy(), free=st.integers(0, 20_000), headroom=st.integers(0, 500))
def test_plan_property_fits_and_drops_the_most_expensive_only_as_needed(costs, free, headroom):
    plan = plan_buckets(costs, free, headroom_bytes=headroom)
    reserve = max((c.eager_peak_bytes for c in costs), default=0) + headroom
    assert plan.eager_reserve_bytes == reserve
    assert plan.budget_bytes == free
    # Every bucket is either chosen (in capture order) or dropped with a reason.
    assert set(plan.chosen) | set(plan.dropped) == {c.bucket for c in costs}
    assert not set(plan.chosen) & set(plan.dropped)
    assert list(plan.chosen) == sorted(plan.chosen, key=lambda b: (b.rows, b.batch_size))[::-1]
    chosen = [c for c in costs if c.bucket in plan.chosen]
    dropped = [c for c in costs if c.bucket in plan.dropped]
    # The prediction: one shared pool (the largest), one executable per graph.
    assert plan.predicted_pool_bytes == max((c.pool_bytes for c in chosen), default=0)
    assert plan.predicted_exec_bytes == sum(c.exec_bytes for c in chosen)
    assert plan.predicted_bytes == need(chosen)
    # The chosen buckets fit beside the eager reserve.
    assert not chosen or need(chosen) <= free - reserve
    # Nothing is dropped when everything fits.
    assert bool(dropped) == (bool(costs) and need(costs) > free - reserve)
    if dropped:
        # Each dropped bucket costs at least as much as any kept one (pool bytes, then
        # executable bytes, then the bucket), and the cheapest dropped did not fit.
        def key(c):
            return (c.pool_bytes, c.exec_bytes, c.bucket)

        assert all(key(d) >= key(c) for d in dropped for c in chosen)
        cheapest = min(dropped, key=key)
        assert list(plan.dropped)[-1] == cheapest.bucket
        assert need([*chosen, cheapest]) > free - reserve


def test_plan_describe_in_full():
    mib = 1 << 20
    plan = MemoryPlan(
        chosen=(Bucket(8), Bucket(2)),
        dropped={Bucket(16): "does not fit", Bucket(32): "capture failed"},
        predicted_pool_bytes=3 * mib,
        predicted_exec_bytes=mib // 2,
        eager_reserve_bytes=2 * mib,
        budget_bytes=10 * mib,
    )
    assert plan.describe() == (
        "memory plan: 2 bucket(s) predicted to take 3.0 MiB of pool and 0.5 MiB of executable "
        "graphs, beside 2.0 MiB kept for the largest eager step, within 10.0 MiB free; "
        "dropped: bucket(bs=16) (does not fit), bucket(bs=32) (capture failed)"
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        ((1 << 20) - 1, "1024.0 KiB"),
        (1 << 20, "1.0 MiB"),
        (5 << 29, "2.5 GiB"),
        (1 << 40, "1024.0 GiB"),
    ],
)
def test_sizes_are_written_in_binary_units(n, text):
    assert _size(n) == text


def test_pad_ratio_of_a_token_bucket_needs_num_tokens():
    with pytest.raises(ValueError, match="token bucket: pass num_tokens"):
        pad_ratio(Bucket(4, 16), 4)


def test_staging_for_a_bucket_larger_than_the_buffers_is_rejected():
    si = StaticInputs([InputSpec("ids", (8,), torch.int64)], 8, "cpu")
    with pytest.raises(
        CudaGraphInputError,
        match=r"bucket\(bs=16\): rows expected at most 8, the buffers' rows, received 16",
    ) as info:
        si.stage({"ids": torch.arange(4)}, Bucket(16), 4)
    assert [(m.path, m.field, m.received) for m in info.value.mismatches] == [
        ("bucket(bs=16)", "rows", 16)
    ]


def test_memory_use_reports_prediction_against_actual():
    from cudagraphs.serving import MemoryPlan, MemoryUse

    mib = 1 << 20
    plan = MemoryPlan(chosen=(), predicted_pool_bytes=100 * mib, predicted_exec_bytes=0)
    line = MemoryUse(pool_bytes=90 * mib, device_bytes=120 * mib).against(plan)
    assert "pool predicted 100.0 MiB, reserved 90.0 MiB" in line
    assert "actual/predicted 1.20" in line


def test_memory_use_line_in_full_and_without_a_prediction():
    mib = 1 << 20
    plan = MemoryPlan(
        chosen=(Bucket(8),), predicted_pool_bytes=3 * mib // 2, predicted_exec_bytes=mib // 2
    )
    assert MemoryUse(pool_bytes=1000, device_bytes=3 * mib).against(plan) == (
        "memory plan vs capture: pool predicted 1.5 MiB, reserved 1000 B; total predicted "
        "2.0 MiB, device free memory dropped by 3.0 MiB (actual/predicted 1.50)"
    )
    # Nothing predicted (every bucket dropped): no ratio, and no ZeroDivisionError.
    line = MemoryUse(pool_bytes=0, device_bytes=2048).against(MemoryPlan(chosen=()))
    assert line.endswith(
        "total predicted 0 B, device free memory dropped by 2.0 KiB (actual/predicted nan)"
    )
