"""GraphRunner.run()'s full path on the CPU: batch_size checks and padding, rank
agreement, slot rotation, owned outputs, token buckets, and the exact WARNING said for
each eager cause (too large, padding ratio) and the input errors of an eager batch."""

import logging

import pytest
import torch

from cudagraphs.errors import CudaGraphInputError, CudaGraphsTypeError, CudaGraphsValueError
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec, call_path
from helpers.serving_contract import RUNNER_LOG, small_runner, warnings_about
from helpers.serving_runner import HIDDEN, batch, dummy, eager_backend, forward, make_runner

TOO_LARGE = (
    "GraphRunner: a batch of {} fits no captured bucket (the largest is {}): it and later "
    "ones like it run eagerly, counted in stats()['eager_runs']['too_large']"
)
PAD_RATIO = (
    "GraphRunner: a batch of {} would pad its bucket by more than max_pad_ratio={}: it and "
    "later ones like it run eagerly, counted in stats()['eager_runs']['pad_ratio']"
)


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def captured_small(**kw):
    runner = small_runner(backend=kw.pop("backend", eager_backend()), **kw)
    runner.capture(dummy)
    return runner


def token_runner(max_pad_ratio=None):
    """Token buckets whose most-rows bucket is not the largest in Bucket's own order:
    bucket(bs=2, tokens=8) has the most rows, bucket(bs=4, tokens=4) the largest size."""
    runner = GraphRunner(
        lambda x: x * 2,
        [InputSpec("x", (8, HIDDEN), torch.float32)],
        BucketConfig(
            batch_sizes=(2, 4), token_counts={2: (8,), 4: (4,)}, max_pad_ratio=max_pad_ratio
        ),
        device="cpu",
        capture_backend=eager_backend(),
    )
    runner.capture(lambda b: {"x": torch.ones(b.rows, HIDDEN)}, warmup=0)
    return runner


def replays(runner):
    return {b: n for b, n in runner.stats()["replays"].items() if n}


# --------------------------------------------------------------------------- batch_size


def test_batch_size_picks_the_bucket_of_the_given_size():
    runner = make_runner()
    runner.capture(dummy)
    inputs = batch(3, seed=1)
    out = runner.run(inputs, batch_size=7)
    assert torch.equal(out, forward(**inputs)) and out.shape == (3, HIDDEN)
    assert replays(runner) == {"bucket(bs=8)": 1}
    assert runner.stats()["eager_runs"] == {}


@pytest.mark.parametrize(
    "value, message",
    [
        ("3", "batch_size must be an int, got str '3'"),
        (True, "batch_size must be an int, got bool True"),
        (2.0, "batch_size must be an int, got float 2.0"),
    ],
)
def test_a_batch_size_that_is_not_an_int_is_a_type_error(value, message):
    runner = captured_small()
    with pytest.raises(CudaGraphsTypeError) as e:
        runner.run(batch(2), batch_size=value)
    assert str(e.value) == message
    assert replays(runner) == {} and runner.stats()["eager_runs"] == {}


@pytest.mark.parametrize("value", [0, -1])
def test_a_batch_size_below_one_is_a_value_error_naming_it(value):
    runner = captured_small()
    with pytest.raises(CudaGraphsValueError) as e:
        runner.run(batch(2), batch_size=value)
    assert str(e.value) == f"batch_size must be an int >= 1, got {value}"
    assert replays(runner) == {} and runner.stats()["eager_runs"] == {}


# --------------------------------------------------------------------------- rank agreement


def test_rank_agreement_gets_the_batch_size_and_the_runners_group(monkeypatch):
    group = object()
    seen = []

    def is_distributed(g=None):
        seen.append(("is_distributed", g))
        return g is group

    def agree(n, g=None):
        seen.append(("agree", n, g))
        assert g is group
        return n + 4

    monkeypatch.setattr(call_path, "is_distributed", is_distributed)
    monkeypatch.setattr(call_path, "agree_on_batch_size", agree)
    runner = make_runner(group=group)
    runner.capture(dummy)
    inputs = batch(3, seed=2)
    assert torch.equal(runner.run(inputs, batch_size=3), forward(**inputs))
    assert seen == [("is_distributed", group), ("agree", 3, group)]
    assert replays(runner) == {"bucket(bs=8)": 1}  # the agreed 7 rows' bucket


def test_without_a_process_group_the_local_batch_size_is_kept():
    runner = make_runner()
    runner.capture(dummy)
    runner.run(batch(3), batch_size=3)
    assert replays(runner) == {"bucket(bs=4)": 1}


# --------------------------------------------------------------------------- slots, outputs


def test_three_slots_are_used_in_turn_on_the_full_path():
    planned = []
    specs = [InputSpec("x", (8, HIDDEN), torch.float32), InputSpec("scale", (8, 1), torch.float32)]
    runner = GraphRunner(
        forward,
        specs,
        BucketConfig(batch_sizes=(2, 8)),
        device="cpu",
        capture_backend=eager_backend(),
        slots=3,
        plan=lambda b, s: planned.append((str(b), s)),
    )
    runner.capture(dummy)
    for seed in range(5):
        inputs = batch(2, seed=seed)
        assert torch.equal(runner.run(inputs, batch_size=2), forward(**inputs))
    assert planned == [("bucket(bs=2)", s) for s in (0, 1, 2, 0, 1)]
    for slot, seed in ((0, 3), (1, 4), (2, 2)):
        assert torch.equal(runner.slot_inputs[slot].view("x", 2), batch(2, seed=seed)["x"])


def test_copy_output_on_the_full_path_returns_owned_copies():
    runner = make_runner()
    runner.capture(dummy)
    view = runner.run(batch(3, seed=1), batch_size=3)
    owned = runner.run(batch(3, seed=1), batch_size=3, copy_output=True)
    kept = owned.clone()
    assert owned.data_ptr() != view.data_ptr()
    runner.run(batch(3, seed=2), batch_size=3)
    assert torch.equal(owned, kept)  # not overwritten by the next replay
    assert torch.equal(view, forward(**batch(3, seed=2)))  # the borrowed view is


# --------------------------------------------------------------------------- too large


def test_a_batch_larger_than_every_bucket_is_said_exactly_once(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = captured_small()
    for n in (5, 6):
        assert torch.equal(runner.run(batch(n, seed=n)), forward(**batch(n, seed=n)))
    assert warnings(caplog) == [TOO_LARGE.format(5, "bucket(bs=4)")]
    assert runner.stats()["eager_runs"] == {"too_large": 2}


def test_an_ignored_num_tokens_leaves_the_size_without_tokens(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = captured_small()
    assert torch.equal(runner.run(batch(5), num_tokens=5), forward(**batch(5)))
    assert warnings(caplog) == [
        "GraphRunner: run(num_tokens=5) is ignored: the config has no token buckets "
        "(BucketConfig(token_counts=...)), so buckets are chosen by batch size alone",
        TOO_LARGE.format(5, "bucket(bs=4)"),
    ]
    assert runner.stats()["ignored_arguments"] == {"num_tokens": 1}


def test_the_too_large_warning_names_the_dropped_buckets(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = captured_small(
        backend=eager_backend(fail_on=[Bucket(1), Bucket(2)]), require_all_buckets=False
    )
    assert torch.equal(runner.run(batch(5)), forward(**batch(5)))
    said = warnings_about(caplog, "fits no captured bucket")
    assert [r.getMessage() for r in said] == [
        TOO_LARGE.format(5, "bucket(bs=4); dropped: bucket(bs=2), bucket(bs=1)")
    ]


def test_too_many_tokens_name_the_bucket_with_the_most_rows(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = token_runner()
    x = torch.randn(9, HIDDEN)
    assert torch.equal(runner.run({"x": x}, batch_size=4, num_tokens=9), x * 2)
    assert warnings(caplog) == [TOO_LARGE.format("4 (9 tokens)", "bucket(bs=2, tokens=8)")]
    assert runner.stats()["eager_runs"] == {"too_large": 1}
    assert replays(runner) == {}


def test_a_token_batch_that_fits_replays_its_token_bucket():
    runner = token_runner()
    x = torch.randn(6, HIDDEN)
    assert torch.equal(runner.run({"x": x}, batch_size=2, num_tokens=6), x * 2)
    assert replays(runner) == {"bucket(bs=2, tokens=8)": 1}


# --------------------------------------------------------------------------- pad ratio


def test_a_batch_refused_by_max_pad_ratio_is_said_exactly_once(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = make_runner(BucketConfig(max_pad_ratio=0.3))
    runner.capture(dummy)
    for _ in range(2):
        assert torch.equal(runner.run(batch(5)), forward(**batch(5)))
    assert warnings(caplog) == [PAD_RATIO.format(5, 0.3)]
    assert runner.stats()["eager_runs"] == {"pad_ratio": 2}


def test_a_token_batch_refused_by_max_pad_ratio_names_its_tokens(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = token_runner(max_pad_ratio=0.2)
    x = torch.randn(3, HIDDEN)  # 3 tokens in bucket(bs=4, tokens=4): 25% padding
    assert torch.equal(runner.run({"x": x}, batch_size=2, num_tokens=3), x * 2)
    assert warnings(caplog) == [PAD_RATIO.format("2 (3 tokens)", 0.2)]
    assert runner.stats()["eager_runs"] == {"pad_ratio": 1}


def test_both_causes_are_said_once_each_in_order(caplog):
    caplog.set_level(logging.WARNING, logger=RUNNER_LOG)
    runner = small_runner(
        backend=eager_backend(), config=BucketConfig(batch_sizes=(2, 4), max_pad_ratio=0.3)
    )
    runner.capture(dummy)
    for n in (1, 5, 1, 6):  # 1 on bucket 2 pads 50%; 5 and 6 fit nothing
        runner.run(batch(n))
    assert warnings(caplog) == [PAD_RATIO.format(1, 0.3), TOO_LARGE.format(5, "bucket(bs=4)")]
    assert runner.stats()["eager_runs"] == {"pad_ratio": 2, "too_large": 2}


# --------------------------------------------------------------------------- eager inputs


def test_a_bad_eager_batch_is_reported_with_its_rows():
    runner = captured_small()
    bad = batch(5)
    bad["x"] = bad["x"].double()
    with pytest.raises(CudaGraphInputError) as e:
        runner.run(bad)
    assert str(e.value).startswith(
        "inputs (5 rows) differ from the runner's input specs in 1 place(s):\n"
        "  inputs['x']: dtype expected torch.float32, received torch.float64\n"
    )
    assert runner.stats()["eager_runs"] == {}


def test_a_wrong_shape_in_an_eager_batch_shows_the_batchs_rows():
    runner = captured_small()
    bad = batch(5)
    bad["x"] = torch.zeros(5, HIDDEN + 1)
    with pytest.raises(CudaGraphInputError) as e:
        runner.run(bad, batch_size=5)
    assert str(e.value).splitlines()[:2] == [
        "inputs (5 rows) differ from the runner's input specs in 1 place(s):",
        f"  inputs['x']: shape expected (5, {HIDDEN}), received (5, {HIDDEN + 1})",
    ]


def test_an_eager_batch_in_a_lossless_dtype_reaches_forward_converted():
    seen = []

    def fwd(x, scale):
        seen.append((x.dtype, scale.dtype))
        return forward(x, scale)

    runner = small_runner(fwd, backend=eager_backend())
    runner.capture(dummy)
    inputs = batch(5)
    half = {"x": inputs["x"].half(), "scale": inputs["scale"]}
    seen.clear()
    out = runner.run(half)
    assert seen == [(torch.float32, torch.float32)]
    assert torch.equal(out, forward(half["x"].float(), inputs["scale"]))
    assert runner.stats()["eager_runs"] == {"too_large": 1}


# ------------------------------------------------------------- inputs that require grad


@pytest.mark.parametrize("rows", [3, 8], ids=["padded", "exact"])
def test_an_input_that_requires_grad_is_refused_before_staging_and_the_runner_stays_good(rows):
    # Copied into the buffers, it would make them part of its autograd graph for every
    # later call: refused before a byte is written, with the fix.
    runner = make_runner()
    runner.capture(dummy)
    bad = batch(rows, seed=2)
    bad["x"].requires_grad_()
    with pytest.raises(
        CudaGraphInputError, match=r"(?s)inputs\[.x.\]: requires_grad expected False.*x.detach\(\)"
    ):
        runner.run(bad)
    assert not any(t.requires_grad for t in runner.static._storage.values())
    good = batch(rows, seed=3)
    assert torch.equal(runner.run(good), forward(**good))
    assert sum(replays(runner).values()) == 1
    # Detached, the same values replay.
    bad["x"] = bad["x"].detach()
    assert torch.equal(runner.run(bad), forward(**bad))
