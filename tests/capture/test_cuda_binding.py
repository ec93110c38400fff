"""The CUDA binding layer (``cuda_binding.py``) on a real GPU, for each binding this
machine has: both see the same graph, move a memcpy node's source, name CUDA errors,
and leave torch's runtime usable after a refused call; a program stages its inputs in
the graph through either."""

import pytest
import torch

from cudagraphs import CudaGraphProgram
from cudagraphs.cuda_binding import BINDINGS, MemcpyNode, cuda_binding
from cudagraphs.errors import CudaCallError
from helpers.asserts import assert_bitwise_equal

pytestmark = pytest.mark.cuda

N = 4096


def _available():
    found = [name for name in BINDINGS if cuda_binding(prefer=name) is not None]
    assert "ctypes" in found, "the ctypes binding must work wherever torch runs on CUDA"
    return found


@pytest.fixture(params=BINDINGS)
def binding(request):
    found = cuda_binding(prefer=request.param)
    if found is None:
        pytest.skip(f"{request.param} is not installed here")
    assert found.name == request.param and found.has_runtime
    return found


@pytest.fixture
def copy_graph():
    """A graph that copies ``home`` into a graph-internal buffer and doubles it."""
    home = torch.zeros(N, device="cuda")
    out = torch.empty(N, device="cuda")
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        inner = torch.empty(N, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        inner.copy_(home)
        out.copy_(inner * 2)
    graph.instantiate()
    return graph, home, inner, out


def _affine(t):
    return t * 3 + 1


def _replay(graph, out):
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def test_the_default_is_cuda_bindings_when_installed():
    found = _available()
    assert cuda_binding().name == found[0]


def test_both_bindings_see_the_same_graph(copy_graph):
    graph, home, inner, _ = copy_graph
    seen = {}
    for name in _available():
        b = cuda_binding(prefer=name)
        seen[name] = (
            b.node_count(int(graph.raw_cuda_graph())),
            b.memcpy_nodes(int(graph.raw_cuda_graph())),
            b.driver_version(),
        )
        count, nodes, version = seen[name]
        assert count == 3, f"{name}: a copy, a kernel and a copy, got {count} nodes"
        ins = [n for n in nodes if n.src == home.data_ptr()]
        assert len(ins) == 1 and ins[0].dst == inner.data_ptr() and ins[0].nbytes == N * 4
        assert version >= 12000
        assert 0 < b.free_memory() <= torch.cuda.get_device_properties(0).total_memory
    assert len({repr(v) for v in seen.values()}) == 1, seen


def test_setter_moves_the_source_and_back(binding, copy_graph):
    graph, home, _, out = copy_graph
    (node,) = [
        n for n in binding.memcpy_nodes(int(graph.raw_cuda_graph())) if n.src == home.data_ptr()
    ]
    set_source = binding.memcpy_source_setter(int(graph.raw_cuda_graph_exec()), node)
    other = torch.full((N,), 5.0, device="cuda")
    assert set_source(other.data_ptr()) is None
    assert_bitwise_equal(_replay(graph, out), other * 2, "replay reading the new source")
    home.fill_(-1.0)
    assert set_source(home.data_ptr()) is None
    assert_bitwise_equal(_replay(graph, out), home * 2, "replay reading the buffer again")


def test_refused_update_is_named_and_leaves_torch_usable(binding, copy_graph):
    graph, home, _, out = copy_graph
    kernels = [h for h in binding._nodes(int(graph.raw_cuda_graph())) if binding._node_type(h) != 1]
    assert kernels, "the graph has a kernel node"
    # A kernel node given as a memcpy node: CUDA refuses the update.
    fake = MemcpyNode(kernels[0], home.data_ptr(), home.data_ptr() + 4 * N, 4 * N)
    set_source = binding.memcpy_source_setter(int(graph.raw_cuda_graph_exec()), fake)
    error = set_source(torch.empty(N, device="cuda").data_ptr())
    assert error is not None and error.startswith("cudaError"), error
    # The refusal was cleared: torch's next checked call and the graph still work.
    assert torch.ones(3, device="cuda").sum().item() == 3.0
    home.fill_(2.0)
    assert_bitwise_equal(_replay(graph, out), home * 2, "replay after a refused update")


def test_failed_call_names_the_cuda_error(binding):
    with pytest.raises(CudaCallError, match=r"cuGraphGetNodes failed with CUDA_ERROR_\w+ \(\d+\)"):
        binding.node_count(0)
    with pytest.raises(CudaCallError, match=r"cudaGraphGetNodes failed with cudaError\w+ \(\d+\)"):
        binding.memcpy_nodes(0)
    assert torch.ones(3, device="cuda").sum().item() == 3.0


def test_program_stages_in_the_graph_through_each_binding(binding, monkeypatch):
    import cudagraphs.program.staging as staging

    monkeypatch.setattr(staging, "cuda_binding", lambda: cuda_binding(prefer=binding.name))
    x = torch.randn(N, device="cuda")
    program = CudaGraphProgram.capture(_affine, example_inputs=(x,), staging="graph")
    try:
        assert program.staging == "graph" and len(program._staging.inputs) == 1
        before = program._staging.rebinds
        for seed in range(3):
            fresh = torch.randn(N, generator=torch.Generator().manual_seed(seed)).cuda()
            assert_bitwise_equal(program.replay(fresh), _affine(fresh), f"{binding.name} {seed}")
        assert program._staging.rebinds == before + 3
    finally:
        program.close()
