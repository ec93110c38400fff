"""Static input buffers made inside a fresh pool before the first capture
(``capture_phase.premade_static_inputs``, ``GraphMemoryPool.fresh_allocations``), on
the CPU: the capture path runs as written with ``capture_into_graph`` replaced by the
eager stand-in, and the pool's routing scope replaced by one that records which
buffers were made inside it (every ``Tensor.clone`` is watched).

What is checked: inside a fresh pool every buffer that is not chained is made up
front, inside the scope, once, and the captures use exactly those; chained inputs get
no buffer; a link that does not hold at capture falls back to a buffer made then,
outside the pool; a pool that holds a graph, or a CPU capture, routes nothing; and
the scope refuses a pool that holds a graph.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from cudagraphs.capture import GraphMemoryPool
from cudagraphs.core.canonicalize import canonicalize
from cudagraphs.core.capture_phase import capture_plan, premade_static_inputs
from cudagraphs.core.sharing import BufferSharing
from cudagraphs.errors import CudaGraphsError, CudaGraphsStateError
from helpers.stand_in_capture import StandInCapture, cpu_options


class RecordingPool(GraphMemoryPool):
    """A pool whose routing scope records entries and what was cloned inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.scopes = 0

    @contextlib.contextmanager
    def fresh_allocations(self, device=None):
        assert self.fresh, "routed into a pool that holds a graph"
        self.scopes += 1
        self.inside = True
        try:
            yield None
        finally:
            self.inside = False


class Clones:
    """Every ``Tensor.clone`` while installed: the result and whether it was made
    inside the pool's scope."""

    def __init__(self, pool: RecordingPool) -> None:
        self.pool = pool
        self.made: list[tuple[torch.Tensor, bool]] = []

    def install(self, monkeypatch) -> Clones:
        real = torch.Tensor.clone

        def clone(t, *args, **kwargs):
            out = real(t, *args, **kwargs)
            self.made.append((out, self.pool.inside))
            return out

        monkeypatch.setattr(torch.Tensor, "clone", clone)
        return self

    def inside(self) -> list[torch.Tensor]:
        return [t for t, inside in self.made if inside]

    def outside(self) -> list[torch.Tensor]:
        return [t for t, inside in self.made if not inside]


def _cuda_options(pool: GraphMemoryPool, **fields):
    # A stream stand-in whose device says "cuda": the routing is decided by the type.
    return cpu_options(
        pool=pool, stream=SimpleNamespace(device=SimpleNamespace(type="cuda")), **fields
    )


def _sample(entry: int, width: int = 4) -> torch.Tensor:
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(entry))
    return x.requires_grad_(True)


def _layers(n: int) -> tuple[nn.Module, ...]:
    torch.manual_seed(0)
    return tuple(nn.Linear(4, 4) for _ in range(n))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr()


def test_in_a_fresh_pool_every_entrys_buffers_are_made_first_inside_it_and_used(monkeypatch):
    pool = RecordingPool()
    plan = canonicalize(_layers(3), tuple((_sample(e),) for e in range(3)))
    StandInCapture().install(monkeypatch)
    clones = Clones(pool).install(monkeypatch)
    graphs = capture_plan(plan, _cuda_options(pool))
    assert pool.scopes == 1
    inside = clones.inside()
    # One buffer per entry, all made inside the one scope, none made again later.
    assert len(inside) == 3 and not [t for t in clones.outside() if t.shape == (2, 4)]
    for g, spec, made in zip(graphs, plan.entries, inside):
        (static,), (sample,) = g.static_inputs, spec.tensors
        assert _same(static, made) and not _same(static, sample)
        assert torch.equal(static, sample) and static.requires_grad
    # The buffers are counted as before: the entry's own input bytes.
    assert all(g.buffer_bytes >= 2 * 4 * 4 for g in graphs)


def test_chained_inputs_get_no_premade_buffer_and_read_the_source_output(monkeypatch):
    pool = RecordingPool()
    plan = canonicalize(_layers(3), tuple((_sample(e),) for e in range(3)))
    sharing = BufferSharing(grad_outputs=True, chained_inputs={(1, 0): (0, 0), (2, 0): (1, 0)})
    StandInCapture().install(monkeypatch)
    clones = Clones(pool).install(monkeypatch)
    graphs = capture_plan(plan, _cuda_options(pool, sharing=sharing))
    assert len(clones.inside()) == 1  # entry 0's input alone
    assert _same(graphs[0].static_inputs[0], clones.inside()[0])
    for e in (1, 2):
        assert _same(graphs[e].static_inputs[0], graphs[e - 1].out_leaves[0])
    assert [g.buffer_bytes > 0 for g in graphs] == [True, False, True]


def test_a_link_that_does_not_hold_at_capture_gets_a_buffer_made_then(monkeypatch):
    """Entry 1 is declared chained to entry 0's output, whose width differs from the
    sample's: the link is dropped at capture and the input gets a buffer there, made
    outside the pool like any buffer made after the first capture."""
    pool = RecordingPool()
    torch.manual_seed(0)
    modules = (nn.Linear(4, 3), nn.Linear(4, 4))
    plan = canonicalize(modules, ((_sample(0),), (_sample(1),)))
    sharing = BufferSharing(grad_outputs=False, chained_inputs={(1, 0): (0, 0)})
    StandInCapture().install(monkeypatch)
    clones = Clones(pool).install(monkeypatch)
    graphs = capture_plan(plan, _cuda_options(pool, sharing=sharing))
    assert len(clones.inside()) == 1 and _same(graphs[0].static_inputs[0], clones.inside()[0])
    late = [t for t in clones.outside() if t.shape == (2, 4)]
    assert len(late) == 1 and _same(graphs[1].static_inputs[0], late[0])
    assert torch.equal(graphs[1].static_inputs[0], plan.entries[1].tensors[0])
    assert graphs[1].chained == ()


def test_reused_slots_get_one_premade_set_each(monkeypatch):
    pool = RecordingPool()
    torch.manual_seed(0)
    modules = tuple(nn.Linear(4, 4) for _ in range(2))
    samples = tuple((_sample(e),) for e in range(4))
    plan = canonicalize(
        modules,
        samples,
        order=[1, -1, 1, -1],
        num_layers_per_chunk=[2],
        reuse_buffers=True,
    )
    slots = plan.buffer_slots
    StandInCapture().install(monkeypatch)
    clones = Clones(pool).install(monkeypatch)
    graphs = capture_plan(plan, _cuda_options(pool))
    assert len(clones.inside()) == len(set(slots))
    assert not [t for t in clones.outside() if t.shape == (2, 4)]
    for a in range(len(graphs)):
        for b in range(a + 1, len(graphs)):
            shared = graphs[a].static_inputs[0] is graphs[b].static_inputs[0]
            assert shared == (slots[a] == slots[b])


@pytest.mark.parametrize("why", ["holds_a_graph", "cpu_capture"])
def test_nothing_is_routed_into_a_pool_that_holds_a_graph_or_off_cuda(monkeypatch, why):
    pool = RecordingPool()
    if why == "holds_a_graph":
        pool.mark_captured()
        opts = _cuda_options(pool)
    else:
        opts = cpu_options(pool=pool)
    plan = canonicalize(_layers(2), tuple((_sample(e),) for e in range(2)))
    assert premade_static_inputs(plan, opts) == {}
    StandInCapture().install(monkeypatch)
    clones = Clones(pool).install(monkeypatch)
    graphs = capture_plan(plan, opts)
    assert pool.scopes == 0 and not clones.inside()
    for g, spec in zip(graphs, plan.entries):
        assert torch.equal(g.static_inputs[0], spec.tensors[0])


def test_the_scope_refuses_a_pool_that_holds_a_graph_and_says_why():
    pool = GraphMemoryPool()
    pool.mark_captured()
    with pytest.raises(CudaGraphsStateError) as info, pool.fresh_allocations():
        pass
    assert isinstance(info.value, CudaGraphsError)
    message = str(info.value)
    assert "already holds a graph" in message and "before the first capture" in message
