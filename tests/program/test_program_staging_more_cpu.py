"""In-graph staging on the CPU: runtime lookup, capture-time copies, node bookkeeping."""

import logging
from types import SimpleNamespace

import pytest
import torch

from cudagraphs.cuda_binding import MemcpyNode
from cudagraphs.program import staging as staging_module
from cudagraphs.program.staging import (
    GraphStaging,
    runtime_for,
    stageable,
    staged_arguments,
)
from helpers.staging import FAKE_GRAPH, REFUSAL, FakeRuntime

LOGGER = "cudagraphs.program.staging"


def _staging(buffers, inner, nodes):
    runtime = FakeRuntime(nodes)
    return GraphStaging(runtime, FAKE_GRAPH, buffers, inner), runtime


def _one_staged(n=4):
    home = torch.zeros(n)
    node = MemcpyNode(100, home.data_ptr(), 0x1000, home.nbytes)
    return _staging([home], {0: 0x1000}, [node])


# ---- runtime_for ----------------------------------------------------------------------


def _patch_runtime(monkeypatch, available, binding):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(staging_module, "cuda_binding", lambda: binding)


@pytest.mark.parametrize("mode", ["auto", "graph"])
def test_runtime_for_staging_modes_returns_the_binding(monkeypatch, mode):
    binding = SimpleNamespace(has_runtime=True)
    _patch_runtime(monkeypatch, True, binding)
    assert runtime_for(mode) is binding


def test_runtime_for_copy_mode_is_none_even_with_a_runtime(monkeypatch):
    _patch_runtime(monkeypatch, True, SimpleNamespace(has_runtime=True))
    assert runtime_for("copy") is None


@pytest.mark.parametrize("mode", ["auto", "graph", "copy"])
def test_runtime_for_without_cuda_is_none(monkeypatch, mode):
    _patch_runtime(monkeypatch, False, SimpleNamespace(has_runtime=True))
    assert runtime_for(mode) is None


@pytest.mark.parametrize(
    "binding",
    [None, SimpleNamespace(has_runtime=False)],
    ids=["no-binding", "binding-without-runtime"],
)
def test_runtime_for_without_a_reachable_runtime_is_none(monkeypatch, binding):
    _patch_runtime(monkeypatch, True, binding)
    assert runtime_for("graph") is None


def test_a_one_element_tensor_is_stageable():
    assert stageable(torch.zeros(1))
    assert stageable(torch.zeros(1, 1))


# ---- staged_arguments -------------------------------------------------------------------


def test_staged_arguments_copy_stageable_buffers_and_keep_the_rest():
    a = torch.arange(4.0).requires_grad_()
    strided = torch.arange(6.0).reshape(2, 3).t()
    empty = torch.zeros(0)
    d = torch.arange(3, dtype=torch.int64)
    buffers = [a, strided, empty, d]
    inner, ptrs = staged_arguments(buffers)
    assert len(inner) == 4
    assert inner[1] is strided and inner[2] is empty
    for i in (0, 3):
        assert inner[i] is not buffers[i]
        assert inner[i].data_ptr() != buffers[i].data_ptr()
        assert torch.equal(inner[i].detach(), buffers[i].detach())
        assert inner[i].dtype == buffers[i].dtype and inner[i].shape == buffers[i].shape
    assert inner[0].requires_grad and inner[0].is_leaf
    assert not inner[3].requires_grad
    assert ptrs == {0: inner[0].data_ptr(), 3: inner[3].data_ptr()}


def test_staged_arguments_of_nothing_stageable():
    strided = torch.zeros(2, 3).t()
    inner, ptrs = staged_arguments([strided])
    assert inner == [strided] and ptrs == {}
    assert staged_arguments([]) == ([], {})


# ---- GraphStaging -------------------------------------------------------------------------


def test_a_staging_with_inputs_is_true_and_holds_nothing_yet():
    staging, _ = _one_staged()
    assert staging
    assert len(staging.inputs) == 1
    assert staging._held == []
    assert staging.rebinds == 0


def test_a_staging_of_no_buffers():
    staging, _ = _staging([], {}, [])
    assert not staging
    assert staging.inputs == ()
    assert staging.bind([]) is None  # covers all of nothing: nothing to copy


@pytest.mark.parametrize("nbytes_delta", [None, -4], ids=["no-node", "split-node"])
def test_a_missing_memcpy_node_is_logged(caplog, nbytes_delta):
    home = torch.zeros(4)
    nodes = []
    if nbytes_delta is not None:
        nodes = [MemcpyNode(100, home.data_ptr(), 0x1000, home.nbytes + nbytes_delta)]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        staging, _ = _staging([torch.zeros(2), home], {1: 0x1000}, nodes)
    assert not staging
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages == ["input tensor 1: no 1-D memcpy node found; staged by copy"]


def test_a_refused_node_update_is_logged(caplog):
    staging, runtime = _one_staged()
    src = torch.ones(4)
    runtime.refuse.add(src.data_ptr())
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        out = staging.bind([src])
    assert out == [src]
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages == [f"input tensor 0: memcpy node update refused ({REFUSAL})"]


def test_a_source_ending_where_the_destination_starts_is_bound():
    staging, runtime = _one_staged()
    src = torch.ones(4)
    s = staging.inputs[0]
    s.dst = src.data_ptr() + s.nbytes  # the destination right after the source
    assert staging.bind([src]) is None
    assert runtime.calls == [(100, src.data_ptr())]


def test_a_source_starting_where_the_destination_ends_is_bound():
    staging, runtime = _one_staged()
    src = torch.ones(4)
    s = staging.inputs[0]
    s.dst = src.data_ptr() - s.nbytes  # the destination right before the source
    assert staging.bind([src]) is None
    assert runtime.calls == [(100, src.data_ptr())]


@pytest.mark.parametrize("offset", [-12, -4, 0, 4, 12])
def test_a_source_sharing_a_byte_with_the_destination_is_copied(offset):
    staging, runtime = _one_staged()
    src = torch.ones(4)
    staging.inputs[0].dst = src.data_ptr() + offset
    out = staging.bind([src])
    assert out == [src] and runtime.calls == []
