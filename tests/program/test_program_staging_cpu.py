"""In-graph staging policy and bookkeeping on the CPU, with a fake CUDA runtime."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.cuda_binding import MemcpyNode, _loaded_cudart_path
from cudagraphs.program.staging import (
    AUTO_GRAPH_STAGING_MAX_TENSORS,
    GraphStaging,
    choose_staging,
    runtime_for,
    stageable,
)
from helpers.staging import FAKE_GRAPH, FakeRuntime

INNER = [0x1000, 0x2000]  # addresses of the graph-internal copies


def _staging(buffers, with_nodes=(0, 1)):
    nodes = [
        MemcpyNode(100 + i, buffers[i].data_ptr(), INNER[i], buffers[i].nbytes) for i in with_nodes
    ]
    runtime = FakeRuntime(nodes)
    inner = {i: INNER[i] for i in range(len(buffers))}
    return GraphStaging(runtime, FAKE_GRAPH, buffers, inner), runtime


# ---- policy -------------------------------------------------------------------------


def test_policy_modes():
    small = [torch.zeros(4)] * AUTO_GRAPH_STAGING_MAX_TENSORS
    large = [torch.zeros(4)] * (AUTO_GRAPH_STAGING_MAX_TENSORS + 1)
    assert choose_staging("auto", small, True) == "graph"
    assert choose_staging("auto", large, True) == "copy"
    assert choose_staging("auto", small, False) == "copy"
    assert choose_staging("copy", small, True) == "copy"
    assert choose_staging("graph", large, True) == "graph"


def test_policy_refusals_say_what_to_do():
    with pytest.raises(ValueError, match="staging must be one of"):
        choose_staging("fast", [torch.zeros(4)], True)
    with pytest.raises(ValueError, match="cuda-bindings.*libcudart.*staging='copy'"):
        choose_staging("graph", [torch.zeros(4)], False)
    with pytest.raises(ValueError, match="contiguous, non-empty"):
        choose_staging("graph", [torch.zeros(4, 3).t(), torch.zeros(0)], True)
    assert choose_staging("auto", [torch.zeros(4, 3).t()], True) == "copy"


def test_stageable_tensors():
    assert stageable(torch.zeros(3, 4))
    assert not stageable(torch.zeros(3, 4).t())
    assert not stageable(torch.zeros(0))
    assert not stageable(torch.zeros(3, dtype=torch.complex64).conj())


# ---- bookkeeping --------------------------------------------------------------------


def test_bind_points_nodes_at_sources_and_skips_unchanged_ones():
    buffers = [torch.zeros(4), torch.zeros(4)]
    staging, runtime = _staging(buffers)
    a, b = torch.ones(4), torch.ones(4)
    assert staging.bind([a, b]) is None  # every input bound: nothing to copy
    assert runtime.calls == [(100, a.data_ptr()), (101, b.data_ptr())]
    staging.bind([a, b])
    assert len(runtime.calls) == 2 and staging.rebinds == 2
    assert staging._held == [a, b]  # kept alive while the nodes read them


def test_bind_with_an_unstaged_input_returns_what_to_copy():
    buffers = [torch.zeros(4), torch.zeros(4)]
    staging, _ = _staging(buffers, with_nodes=(1,))
    a, b = torch.ones(4), torch.ones(4)
    out = staging.bind([a, b])
    assert out[0] is a and out[1] is buffers[1]


def test_unbind_points_back_at_the_buffers_once():
    buffers = [torch.zeros(4), torch.zeros(4)]
    staging, runtime = _staging(buffers)
    staging.bind([torch.ones(4), torch.ones(4)])
    staging.unbind()
    assert runtime.calls[-2:] == [(100, buffers[0].data_ptr()), (101, buffers[1].data_ptr())]
    staging.unbind()
    assert len(runtime.calls) == 4 and staging._held == []


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(lambda: torch.ones(4, dtype=torch.float64), id="dtype"),
        pytest.param(lambda: torch.ones(5), id="numel"),
        pytest.param(lambda: torch.ones(8)[::2], id="strided"),
        pytest.param(lambda: torch.ones(4, device="meta"), id="device"),
    ],
)
def test_sources_that_cannot_feed_the_node_are_left_to_the_copy(source):
    buffers = [torch.zeros(4), torch.zeros(4)]
    staging, runtime = _staging(buffers)
    good, other = torch.ones(4), torch.ones(4)
    staging.bind([good, other])
    odd = source()
    out = staging.bind([odd, other])
    assert out[0] is odd and out[1] is buffers[1]  # the caller copies odd into buffers[0]
    assert runtime.calls[-1] == (100, buffers[0].data_ptr())  # node reads the buffer again


def test_a_source_overlapping_the_node_destination_is_copied():
    buffers = [torch.zeros(4)]
    staging, runtime = _staging(buffers, with_nodes=(0,))
    # Pretend the graph-internal copy sits where this tensor sits.
    src = torch.ones(8)
    staging.inputs[0].dst = src.data_ptr() + 8
    out = staging.bind([src[:4]])
    assert out[0] is not buffers[0] and runtime.calls == []


def test_a_refused_update_falls_back_to_the_copy():
    buffers = [torch.zeros(4)]
    staging, runtime = _staging(buffers, with_nodes=(0,))
    src = torch.ones(4)
    runtime.refuse.add(src.data_ptr())
    out = staging.bind([src])
    assert out[0] is src and runtime.calls == []


def test_refusing_to_point_back_at_the_buffer_raises():
    buffers = [torch.zeros(4)]
    staging, runtime = _staging(buffers, with_nodes=(0,))
    staging.bind([torch.ones(4)])
    runtime.refuse.add(buffers[0].data_ptr())
    with pytest.raises(
        RuntimeError, match=r"refused \(cudaErrorInvalidValue \(1\)\).*staging='copy'"
    ):
        staging.unbind()


def test_inputs_without_a_matching_node_stay_copy_fed():
    buffers = [torch.zeros(4), torch.zeros(4)]
    staging, _ = _staging(buffers, with_nodes=(1,))
    assert [s.index for s in staging.inputs] == [1]
    staging_none, _ = _staging(buffers, with_nodes=())
    assert not staging_none


def test_no_runtime_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only answer")
    assert runtime_for("auto") is None and runtime_for("graph") is None
    assert _loaded_cudart_path() is None or "libcudart" in _loaded_cudart_path()


# ---- property: the nodes always read what the last call asked for ------------------

SOURCE_KINDS = ["same", "new", "pool", "wrong_dtype", "refused", "unbind"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(SOURCE_KINDS), st.sampled_from(SOURCE_KINDS)), max_size=12)
)
def test_nodes_track_the_last_call(steps):
    buffers = [torch.zeros(4), torch.zeros(4)]
    staging, runtime = _staging(buffers)
    pool = [torch.ones(4) * k for k in range(3)]  # sources that come back
    last = [buffers[0], buffers[1]]  # what each node reads now
    for kinds in steps:
        if "unbind" in kinds:
            staging.unbind()
            last = [buffers[0], buffers[1]]
            assert staging._held == []
            continue
        sources = []
        for i, kind in enumerate(kinds):
            if kind == "same":
                src = last[i] if last[i] is not buffers[i] else pool[i]
            elif kind == "new":
                src = torch.full((4,), float(i))
            elif kind == "pool":
                src = pool[2]
            elif kind == "wrong_dtype":
                src = torch.ones(4, dtype=torch.float64)
            else:  # refused by the runtime
                src = torch.full((4,), 7.0)
                runtime.refuse.add(src.data_ptr())
            sources.append(src)
        if sources[0] is sources[1]:
            sources[1] = sources[1].clone()  # two nodes, two tensors
        calls_before = len(runtime.calls)
        out = staging.bind(sources)
        bindable = [
            s.dtype is torch.float32 and s.data_ptr() not in runtime.refuse for s in sources
        ]
        expected_reads = [src if ok else buf for src, ok, buf in zip(sources, bindable, buffers)]
        for s, want in zip(staging.inputs, expected_reads):
            assert s.current == want.data_ptr()
        if all(bindable):
            assert out is None
        else:
            for i, ok in enumerate(bindable):
                assert out[i] is (buffers[i] if ok else sources[i])
        assert staging._held == [s for s, ok in zip(sources, bindable) if ok]
        # One runtime call per node whose address changed, none otherwise.
        changed = sum(
            1 for prev, want in zip(last, expected_reads) if prev.data_ptr() != want.data_ptr()
        )
        assert len(runtime.calls) - calls_before == changed
        last = expected_reads
        runtime.refuse.clear()


def test_a_conjugate_view_is_left_to_the_copy_its_bytes_are_not_its_values():
    buffers = [torch.zeros(4, dtype=torch.complex64), torch.zeros(4, dtype=torch.complex64)]
    staging, runtime = _staging(buffers)
    z = torch.tensor([1 + 2j, 3 - 1j, 0.5j, 2], dtype=torch.complex64)
    other = torch.ones(4, dtype=torch.complex64)
    staging.bind([z, other])
    conj = z.conj()
    assert conj.is_conj() and conj.is_contiguous() and conj.data_ptr() == z.data_ptr()
    out = staging.bind([conj, other])
    assert out[0] is conj  # copied by the caller (copy_ resolves the conjugate bit)
    assert runtime.calls[-1] == (100, buffers[0].data_ptr())
