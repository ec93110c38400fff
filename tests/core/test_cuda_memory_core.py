"""On the GPU, the mechanisms behind the memory contract, in process: a warmup inside a
fresh pool leaves no cache beside the graphs; a pool that already holds a graph warms
up outside it; owned parameter gradients copied at every replay and staged through one
buffer equal eager's and leave no per-parameter buffer behind; a failed warmup inside a pool leaves it usable."""

from __future__ import annotations

import pytest
import torch

import cudagraphs
from cudagraphs.graph_pool import GraphMemoryPool
from cudagraphs.torch_private import clear_cublas_workspaces
from helpers.core_cuda import count_backward_replays

pytestmark = pytest.mark.cuda


def _mlp(width: int = 1024, depth: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    return torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.GELU())]).cuda()


def _cached_outside(handles) -> int:
    wanted = {tuple(h) for h in handles}
    return sum(
        s["total_size"] - s["allocated_size"]
        for s in torch.cuda.memory_snapshot()
        if tuple(s["segment_pool_id"]) not in wanted
    )


def test_a_warmup_in_a_fresh_pool_leaves_no_cache_beside_the_graphs():
    # The same capture with its warmup inside a fresh pool and outside one (a pool
    # around a handle passed in is never fresh): what stays cached outside the pool
    # after the first is allocator rounding of the static buffers; after the second,
    # also the warmup's activations and gradients.
    left = {}
    for fresh in (True, False):
        torch.cuda.synchronize()
        # Earlier tests' eager cuBLAS workspaces go too: a pool's first streams drop
        # them (GraphMemoryPool.capture_stream), and freed inside the phase they would
        # count as the phase's cache.
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
        model = _mlp(width=2048)
        x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
        pool = (
            GraphMemoryPool() if fresh else GraphMemoryPool(handle=torch.cuda.graph_pool_handle())
        )
        assert pool.fresh is fresh
        before = _cached_outside(())
        graphed = cudagraphs.make_graphed_callables(model, (x,), pool=pool)
        assert not pool.fresh
        account = graphed.cuda_graph.memory
        assert account.pool_reserved_bytes > 0
        left[fresh] = account.unused_cache_bytes - before
        counts = count_backward_replays(graphed.cuda_graph.graphs)
        graphed(x).sum().backward()
        assert counts() == 1
        del model, graphed, x, pool
    warmup_bytes = 2048 * 2048 * 4 * 8  # its activations alone
    assert left[True] < left[False] - warmup_bytes // 2, left


def test_a_pool_holding_a_graph_warms_up_outside_it_and_gives_the_cache_back():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    first, second = _mlp(), _mlp()
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    pool = GraphMemoryPool()
    cudagraphs.make_graphed_callables(first, (x,), pool=pool)
    assert not pool.fresh
    graphed = cudagraphs.make_graphed_callables(second, (x,), pool=pool)
    account = graphed.cuda_graph.memory
    # The second warmup ran on the warmup stream; what it cached there went back.
    assert account.unused_cache_bytes > 0 and account.released_bytes > 0, account
    # Static buffers the graphs own: the input, the output, the output's incoming
    # gradient and the input's gradient, 2 MiB each.
    assert account.static_bytes == 4 * 512 * 1024 * 4, account
    y = graphed(first(x))
    y.sum().backward()


def test_staged_owned_gradients_equal_eager_and_leave_one_shared_buffer(monkeypatch):
    # Staging serves owned gradients copied at every replay (the default, or a pool
    # passed in); deferred copies need a buffer per parameter.
    monkeypatch.setenv("CUDAGRAPHS_OWNED_GRADS", "copy")
    torch.manual_seed(0)
    models = [_mlp(depth=2) for _ in range(3)]
    refs = [_mlp(depth=2) for _ in range(3)]
    for m, r in zip(models, refs):
        r.load_state_dict(m.state_dict())
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    samples = tuple((torch.randn(256, 1024, device="cuda", requires_grad=True),) for _ in models)
    graphed = cudagraphs.make_graphed_callables(tuple(models), samples)
    entries = [g.cuda_graph.graphs for g in graphed]
    ptrs = {
        b.untyped_storage().data_ptr()
        for e in entries
        for b in e.static_grad_inputs[len(e.diff_input_positions) :]
        if b is not None
    }
    assert len(ptrs) == 1  # every entry's parameter gradients are views of one buffer
    counts = [count_backward_replays(e) for e in entries]
    kept = []
    for _ in range(2):
        for seq in (graphed, refs):
            h = x
            for layer in seq:
                h = layer(h)
            h.pow(2).mean().backward()
        kept.append([p.grad for p in graphed[0].parameters()])
        for g, r in zip(graphed, refs):
            for pg, pr in zip(g.parameters(), r.parameters()):
                torch.testing.assert_close(pg.grad, pr.grad, rtol=0, atol=0)
            g.zero_grad(set_to_none=True)
            r.zero_grad(set_to_none=True)
    assert [c() for c in counts] == [2, 2, 2], "every step replays every backward graph"
    # Owned: each step's gradients have storage of their own, apart from the buffer.
    for a, b in zip(*kept):
        assert a.data_ptr() != b.data_ptr()
        assert a.untyped_storage().data_ptr() not in ptrs


def test_a_failed_warmup_inside_a_pool_leaves_allocator_and_pool_usable():
    model = _mlp()
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    pool = GraphMemoryPool()

    def fails():
        raise RuntimeError("warmup hook failed")

    with pytest.raises(RuntimeError, match="warmup hook failed"):
        cudagraphs.make_graphed_callables(model, (x,), pool=pool, pre_warmup_hook=fails)
    assert pool.fresh
    # The routing into the pool ended: an eager allocation now goes to the default pool.
    t = torch.empty(1 << 20, device="cuda")
    seg = next(
        s
        for s in torch.cuda.memory_snapshot()
        if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]
    )
    assert tuple(seg["segment_pool_id"]) == (0, 0)
    graphed = cudagraphs.make_graphed_callables(model, (x,), pool=pool)
    graphed(x).sum().backward()
