"""Serving static inputs on the CPU: input specs, the shared static input buffers
and their input check, batch rows and row-dimension inference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs import CudaGraphInputError
from cudagraphs.errors import CudaGraphsTypeError
from cudagraphs.serving import (
    Bucket,
    InputSpec,
    StaticInputs,
    infer_row_dim,
)

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
        "and its spec's shape, with the batch's rows in its row_dim, not requiring grad "
        "(pass x.detach(): the graphs compute no gradient)."
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


@settings(max_examples=150, deadline=None)
@given(
    buckets=st.sets(st.integers(1, 64), min_size=1, max_size=5),
    calls=st.lists(
        st.tuples(st.integers(0, 4), st.integers(1, 64), st.integers(0, 99)), max_size=12
    ),
    pad_kv=st.sampled_from([0, 7.5]),
)
def test_every_staged_bucket_holds_the_batch_then_pad_values_whatever_came_before(
    buckets, calls, pad_kv
):
    # Reference, per call: what the bucket's forward reads is the batch's rows, then
    # each input's pad value in every padding row; never a row of an earlier batch.
    s = make_inputs(pad_kv=pad_kv)
    sizes = sorted(buckets)
    pads = {"ids": -1, "h": 0.0, "kv": pad_kv}
    for which, rows, fill in calls:
        bucket = Bucket(sizes[which % len(sizes)])
        rows = min(rows, bucket.rows)
        inputs = batch(rows, fill=float(fill))
        s.stage(inputs, bucket, rows)
        got = s.views(bucket)
        for name, spec in s.specs.items():
            seen = got[name].movedim(spec.row_dim, 0)
            want = inputs[name].movedim(spec.row_dim, 0)
            assert torch.equal(seen[:rows], want), (name, bucket, rows)
            assert (seen[rows:] == pads[name]).all(), (name, bucket, rows, seen[rows:])
