"""Every refused call of ``GraphRunner.run``, one after another on one runner: each
ends in a typed error (a ``CudaGraphsError``) that names the input, and the good call
after it returns the eager result from a replay. Nothing a bad call did (a partial
staging, a counter, a cached plan) may show in the next good call."""

import pytest
import torch

from cudagraphs.errors import CudaGraphsError
from helpers.serving_runner import HIDDEN, batch, dummy, forward, make_runner


def _bad_calls():
    def with_(**changes):
        def make(n):
            b = batch(n, seed=n)
            b.update({k: v(b, n) for k, v in changes.items()})
            return b

        return make

    return {
        "dtype": (
            with_(x=lambda b, n: b["x"].double()),
            r"inputs\['x'\]: dtype expected torch.float32, received torch.float64",
        ),
        "missing": (
            lambda n: {"x": batch(n)["x"]},
            r"names expected \['scale', 'x'\], received \['x'\]",
        ),
        "unknown": (
            with_(y=lambda b, n: torch.zeros(n, 1)),
            r"names expected \['scale', 'x'\], received \['scale', 'x', 'y'\]",
        ),
        "rows disagree": (
            with_(scale=lambda b, n: torch.ones(n + 1, 1)),
            r"row counts expected one count for all",
        ),
        "requires grad": (
            with_(x=lambda b, n: b["x"].clone().requires_grad_(True)),
            r"inputs\['x'\]: requires_grad expected False, received True",
        ),
        "trailing shape": (
            with_(x=lambda b, n: torch.zeros(n, HIDDEN + 1)),
            r"inputs\['x'\]: shape expected",
        ),
        "not a tensor": (
            with_(x=lambda b, n: b["x"].tolist()),
            r"inputs\['x'\]: type expected 'Tensor'",
        ),
        "not a dict": (lambda n: [batch(n)["x"]], r"type expected .Mapping"),
        "no rows": (lambda n: batch(0), r"the batch has no rows"),
    }


BAD = _bad_calls()


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_refused_run_names_its_input_and_the_next_good_run_replays_eagers_result(name):
    runner = make_runner()
    runner.capture(dummy)
    make_bad, match = BAD[name]
    for n in (3, 8):  # two buckets, before and after the bad call
        with pytest.raises(CudaGraphsError, match=match):
            runner.run(make_bad(n))
        good = batch(n, seed=100 + n)
        replays = sum(runner.stats()["replays"].values())
        out = runner.run(good)
        assert sum(runner.stats()["replays"].values()) == replays + 1, "the good run replayed"
        assert torch.equal(out, forward(good["x"], good["scale"]))


def test_every_refusal_in_a_row_then_good_runs_at_every_bucket():
    runner = make_runner()
    runner.capture(dummy)
    for make_bad, match in BAD.values():
        with pytest.raises(CudaGraphsError, match=match):
            runner.run(make_bad(5))
    for n in (1, 2, 5, 7, 16, 64):
        good = batch(n, seed=n)
        assert torch.equal(runner.run(good), forward(good["x"], good["scale"]))
    assert runner.stats()["eager_runs"] == {}
