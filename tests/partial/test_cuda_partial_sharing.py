"""Buffer sharing on a GPU (``core.sharing``, ``partial.chaining``): the next layer's
static input is the last layer's static output, the targets of one capture share
incoming-gradient buffers, training stays bitwise equal to eager, ``stats()`` reports
the bytes per scope and fewer of them than unshared graphs; a call that passes another
tensor where a graph reads one in place runs eagerly, counted; a gradient that passes
through a graph unchanged is never the shared buffer."""

import copy

import pytest
import torch
from torch import nn

from cudagraphs import ChainedInputError, make_graphed_callables
from cudagraphs.core.sharing import BufferSharing
from cudagraphs.partial import PartialCudaGraphManager
from helpers.partial_model_scope import batch, bf16, hf_loss, train_both

pytestmark = pytest.mark.cuda


def graphs_of(mgr):
    return [e.variants[0].graph.graphs for e in mgr.recordings]


def out0(graphs):
    return graphs.out_leaves[graphs.out_tensor_positions[0]]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_layers_chain_share_gradient_buffers_and_train_bitwise(kind):
    model = bf16(kind)
    ref = copy.deepcopy(model)
    gen = torch.Generator(device="cuda").manual_seed(5)
    batches = [batch(gen, pad=1 + i % 3) for i in range(5)]  # one mask contract
    mgr = PartialCudaGraphManager.from_model_parts(model, speed_check=False)
    try:
        assert [e.target.kind for e in mgr.recordings] == ["layer", "layer"]
        train_both(model, ref, mgr, batches, lambda m, *b: hf_loss(m, *b, use_cache=False))
        first, second = graphs_of(mgr)
        hidden = len(mgr.recordings[1].param_names)  # parameters come first, then hidden_states
        assert [i for i, _ in second.chained] == [hidden] and first.chained == ()
        assert second.static_inputs[hidden].data_ptr() == out0(first).data_ptr()
        assert [g.data_ptr() for g in first.static_grad_outputs] == [
            g.data_ptr() for g in second.static_grad_outputs
        ]
        stats = mgr.stats()
        assert stats["fallbacks"] == 0 and stats["replayed"] == 8, stats
        # The warmup inside the fresh pool reserved its memory; the captures reused it.
        assert stats["pool_bytes_layer"] == stats["pool_bytes"] >= 0, stats
        assert stats["pool_reserved_bytes"] > 0, stats
        assert stats["buffer_bytes_layer"] == stats["buffer_bytes"] > 0, stats
    finally:
        mgr.close()


def test_sharing_saves_one_hidden_state_and_one_gradient_buffer_per_later_layer():
    gen = torch.Generator(device="cuda").manual_seed(6)
    b = batch(gen, pad=1)
    measured = {}
    for shared in (True, False):
        model = bf16("llama")
        # A backend of one's own gets no sharing: the graphs as before it existed.
        backend = (
            None if shared else (lambda c, a, k: make_graphed_callables(c, a, sample_kwargs=k))
        )
        mgr = PartialCudaGraphManager.from_model_parts(
            model, speed_check=False, capture_backend=backend
        )
        mgr.start_recording()
        hf_loss(model, *b, use_cache=False).backward()
        mgr.capture()
        measured[shared] = mgr.stats()["buffer_bytes"]
        mgr.close()
    rows, seq = b[0].shape
    hidden_bytes = rows * seq * model.config.hidden_size * 2  # bf16
    # Two layers: the second's hidden-state input and its incoming-gradient buffer.
    assert measured[False] - measured[True] == 2 * hidden_bytes, measured


class Chain(nn.Module):
    def __init__(self, clone_between=False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        self.clone_between = clone_between

    def forward(self, x):
        for n, layer in enumerate(self.layers):
            x = layer(x.clone() if self.clone_between and n == 2 else x)
        return x


def step(model, x):
    model(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_another_tensor_where_a_graph_reads_in_place_runs_eagerly_counted_and_equal():
    model = Chain().cuda()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16, device="cuda")
    mgr = PartialCudaGraphManager.from_model_parts(
        model,
        scopes=("moe_router",),
        include=["layers.0", "layers.1", "layers.2"],
        speed_check=False,
    )
    mgr.start_recording()
    step(model, x)
    mgr.capture()
    try:
        assert [len(g.chained) for g in graphs_of(mgr)] == [0, 1, 1]
        for clone in (False, True, False):
            model.clone_between = ref.clone_between = clone
            for a, b in zip(step(model, x), step(ref, x)):
                assert torch.equal(a, b)
        stats = mgr.stats()
        # The cloned call of the third layer could not replay: eager once, counted.
        assert stats["fallback_unchained_input"] == 1 and stats["fallbacks"] == 1, stats
        assert stats["replayed"] == 8, stats
        # The second layer's source released: its buffer becomes its own, and a call
        # passing another tensor is copied in and replays.
        mgr.dispatchers[0].turn_off("test")
        assert mgr.recordings[1].variants[0].graph.graphs.chained == ()
        for a, b in zip(step(model, x), step(ref, x)):
            assert torch.equal(a, b)
        assert mgr.stats()["replayed"] == 10 and mgr.stats()["fallbacks"] == 1
    finally:
        mgr.close()


def test_core_chains_refuses_another_tensor_and_unchains_on_release():
    torch.manual_seed(0)
    first, second = nn.Linear(16, 16).cuda(), nn.Linear(16, 16).cuda()
    ref = copy.deepcopy(nn.Sequential(first, second))
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    h = torch.randn(4, 16, device="cuda", requires_grad=True)
    sharing = BufferSharing(grad_outputs=True, chained_inputs={(1, 0): (0, 0)})
    g1, g2 = make_graphed_callables((first, second), ((x,), (h,)), _buffer_sharing=sharing)
    for _ in range(3):
        out = g2(g1(x))
        out.square().sum().backward()
        want = ref(x).square().sum()
        want.backward()
        for p, q in zip(nn.Sequential(first, second).parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    with pytest.raises(ChainedInputError, match="is not that output") as err:
        g2(h)
    assert [m.field for m in err.value.mismatches] == ["chained input"]
    first.cuda_graph.reset()
    # Copied into what is now its own buffer, and replayed.
    assert torch.equal(g2(h), ref[1](h))


def test_a_gradient_passed_through_unchanged_is_never_the_shared_buffer():
    # x + b with a full-shape b: autograd hands the incoming gradient itself to both x
    # and b. Both entries share that buffer; accumulated .grad must still be exact.
    torch.manual_seed(0)

    class AddBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(torch.randn(4, 16))

        def forward(self, x):
            return x + self.b

    mods = [AddBias().cuda(), AddBias().cuda()]
    refs = copy.deepcopy(mods)
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    graphed = make_graphed_callables(
        tuple(mods), ((x,), (x,)), _buffer_sharing=BufferSharing(grad_outputs=True)
    )
    a, b = graphed[0].cuda_graph.graphs, graphed[1].cuda_graph.graphs
    assert a.static_grad_outputs[0] is b.static_grad_outputs[0]
    for k in range(2):  # .grad accumulates over two backward passes
        (mods[1](mods[0](x)) * (k + 2)).sum().backward()
        (refs[1](refs[0](x)) * (k + 2)).sum().backward()
    for m, r in zip(mods, refs):
        assert torch.equal(m.b.grad, r.b.grad)
