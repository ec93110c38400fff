"""serving/graphs.py on the CPU: the capture backends hand the runner's run, pool and
bucket name to the capture functions, release() resets what can be reset, slot_graph
checks every tensor leaf past non-tensor ones, and the row-cut cache stays bounded."""

import pytest
import torch

from cudagraphs.errors import CudaGraphOutputError
from cudagraphs.serving import Bucket
from cudagraphs.serving import graphs as graphs_module
from cudagraphs.serving.graphs import release, slot_graph
from cudagraphs.serving.static_inputs import PLAN_CACHE_SIZE


def test_the_backends_pass_run_pool_and_name_through(monkeypatch):
    seen = []
    monkeypatch.setattr(
        graphs_module, "capture_into_graph", lambda *a, **k: seen.append(("graph", a, k)) or 1
    )
    monkeypatch.setattr(
        graphs_module,
        "capture_with_static_outputs",
        lambda *a, **k: seen.append(("static", a, k)) or 2,
    )

    def run():
        return "out"

    pool = object()
    assert graphs_module.default_backend(run, pool, "bucket(bs=4)") == 1
    assert graphs_module.static_outputs_backend(run, pool, "bucket(bs=2)") == 2
    assert seen == [
        ("graph", (run, pool), {"what": "bucket(bs=4)"}),
        ("static", (run, "out", pool), {"what": "bucket(bs=2)"}),
    ]


class Resettable:
    was_reset = False

    def reset(self):
        self.was_reset = True


def test_release_resets_what_has_reset_and_skips_the_rest():
    a, b = Resettable(), Resettable()
    release([a, object(), b])
    assert a.was_reset and b.was_reset


def test_slot_graph_checks_tensors_after_a_non_tensor_leaf():
    with pytest.raises(CudaGraphOutputError, match=r"output\[1\]: shape expected 4 rows"):
        slot_graph(None, (3, torch.zeros(5, 2)), Bucket(4), 0, "bucket(bs=4)")
    slot = slot_graph(None, (None, torch.arange(8.0).view(4, 2)), Bucket(4), 0, "bucket(bs=4)")
    assert slot.narrow == ((1, 0),)
    none, cut = slot.real_rows(3, 4, copy=False)
    assert none is None and cut.shape == (3, 2)


def test_the_row_cut_cache_is_bounded():
    slot = slot_graph(
        None, torch.zeros(PLAN_CACHE_SIZE + 4, 1), Bucket(PLAN_CACHE_SIZE + 4), 0, "b"
    )
    for rows in range(1, PLAN_CACHE_SIZE + 3):
        slot.real_rows(rows, PLAN_CACHE_SIZE + 4, copy=False)
    assert len(slot._views) == PLAN_CACHE_SIZE
    first = slot.real_rows(1, PLAN_CACHE_SIZE + 4, copy=False)
    assert slot.real_rows(1, PLAN_CACHE_SIZE + 4, copy=False) is first, "cached"
