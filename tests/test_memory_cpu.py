"""CPU tests of the memory account and its policies: GraphMemoryPool freshness (where warmups
run), the owned-gradient staging buffer, MemoryAccount arithmetic and MemoryMeter's
release decision (the CUDA calls replaced by a fake device)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraphs.core.grad_staging import GradStaging
from cudagraphs.errors import CudaGraphsValueError
from cudagraphs.graph_pool import GraphMemoryPool
from cudagraphs.memory import (
    KEEP_CACHE_ENV,
    MemoryAccount,
    MemoryMeter,
    release_unused_cache,
    tensor_bytes,
)


# ---- GraphMemoryPool.fresh ------------------------------------------------------------------
def test_a_pool_made_here_is_fresh_until_a_capture_and_again_after_a_retire():
    pool = GraphMemoryPool()
    assert pool.fresh
    pool.mark_captured()
    assert not pool.fresh
    pool.retire()  # the next handle is made here: nothing captured into it yet
    assert pool.fresh


def test_a_pool_around_a_handle_passed_in_is_never_fresh():
    # The handle may hold graphs captured elsewhere; a warmup inside it could take
    # their temporaries' memory.
    assert not GraphMemoryPool(handle=(3, 4)).fresh


def test_handles_lists_the_retired_and_the_current():
    pool = GraphMemoryPool(handle=(1, 2))
    assert pool.handles() == ((1, 2),)
    pool.retire()
    assert pool.handles() == ((1, 2),)  # no new handle made yet
    pool._handle = (5, 6)
    assert pool.handles() == ((1, 2), (5, 6))


# ---- GradStaging ------------------------------------------------------------------------
def _params(*shapes, dtype=torch.float32, requires_grad=True):
    return [
        torch.nn.Parameter(torch.zeros(s, dtype=dtype), requires_grad=requires_grad) for s in shapes
    ]


def test_staging_is_sized_for_the_largest_callable_per_dtype():
    a = _params((4, 3), (5,))  # 17 float32
    b = _params((2, 2)) + _params((10,), dtype=torch.bfloat16)  # 4 float32, 10 bf16
    c = _params((17,)) + _params((10,), dtype=torch.bfloat16)
    d = _params((10,), dtype=torch.bfloat16)
    staging = GradStaging.for_params([a, b, c, d])
    sizes = {k[0]: v.numel() for k, v in staging.buffers.items()}
    assert sizes == {torch.float32: 17, torch.bfloat16: 10}
    assert staging.nbytes() == 17 * 4 + 10 * 2


def test_a_dtype_is_staged_only_where_it_saves_memory():
    # Staged, a dtype costs the buffer and the largest entry's gradients as pool
    # temporaries: only entries adding up to more than twice the largest save.
    one = _params((100,))
    assert GradStaging.for_params([one]) is None  # graph_stack: one callable
    assert GradStaging.for_params([one, _params((100,))]) is None  # 200 == 2 * 100
    assert GradStaging.for_params([one, _params((60,)), _params((41,))]) is not None


def test_no_staging_without_a_contiguous_parameter_that_requires_grad():
    frozen = _params((3,), requires_grad=False)
    strided = [torch.nn.Parameter(torch.zeros(4, 3).t())]
    assert GradStaging.for_params([frozen, strided, []]) is None


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(
            st.integers(1, 4),
            st.integers(1, 4),
            st.sampled_from(["f32", "bf16", "none", "strided"]),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_staged_gradients_equal_the_computed_ones_and_do_not_overlap(shapes, seed):
    # Reference: staging returns, in place of each gradient, a tensor equal to it;
    # staged views of one call never share memory; unstaged ones are the inputs.
    gen = torch.Generator().manual_seed(seed)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    params = [
        torch.nn.Parameter(torch.zeros(r, c, dtype=dtypes.get(kind, torch.float32)))
        for r, c, kind in shapes
    ]
    staging = GradStaging.for_params([params] * 3)  # three callables of these
    grads = []
    for (r, c, kind), p in zip(shapes, params):
        if kind == "none":
            grads.append(None)
            continue
        g = (
            torch.randn(c, r, generator=gen).t()
            if kind == "strided"
            else torch.randn(r, c, generator=gen)
        )
        grads.append(g.to(p.dtype))
    if staging is None:
        return
    out = staging.stage(grads)
    spans = []
    for g, o in zip(grads, out):
        if g is None:
            assert o is None
            continue
        assert torch.equal(o, g)
        if g.is_contiguous():
            assert o is not g and o.is_contiguous()
            start = o.data_ptr()
            spans.append((o.dtype, start, start + o.numel() * o.element_size()))
        else:
            assert o is g  # left as the graph's output
    for i, (d1, s1, e1) in enumerate(spans):
        for d2, s2, e2 in spans[i + 1 :]:
            assert d1 != d2 or e1 <= s2 or e2 <= s1


def test_two_entries_stage_into_the_same_memory():
    # Entries share the buffer: the owned copy is made before another entry replays.
    staging = GradStaging.for_params([_params((3,)), _params((2,)), _params((2,))])
    first = staging.stage([torch.ones(3)])[0]
    second = staging.stage([torch.full((2,), 2.0)])[0]
    assert first.data_ptr() == second.data_ptr()


# ---- MemoryAccount --------------------------------------------------------------------
def test_accounts_add_field_by_field_and_summarize_in_mib():
    a = MemoryAccount(1 << 20, 1 << 19, 2 << 20, 0, 3 << 20, 4 << 20)
    total = a + MemoryAccount(1 << 20, 0, 0, 5 << 20, 0, 1 << 20)
    assert total.as_dict() == {
        "pool_reserved_bytes": 2 << 20,
        "pool_allocated_bytes": 1 << 19,
        "unused_cache_bytes": 2 << 20,
        "released_bytes": 5 << 20,
        "driver_bytes": 3 << 20,
        "static_bytes": 5 << 20,
    }
    assert total.summary() == (
        "pool 2 MiB (0 in use), unused cache 2 MiB (released 5), driver 3 MiB, static buffers 5 MiB"
    )


def test_tensor_bytes_counts_each_storage_once():
    base = torch.zeros(1024)  # 4096 bytes
    other = torch.zeros(10, dtype=torch.float16)  # 20 bytes
    assert tensor_bytes([]) == 0
    assert tensor_bytes([base, base[:10], base.view(32, 32), None, other]) == 4096 + 20
    assert tensor_bytes(iter([other])) == 20


# ---- MemoryMeter and release ---------------------------------------------------------------
class FakeDevice:
    """The torch.cuda memory calls of one device, as numbers the test sets."""

    def __init__(self, monkeypatch):
        self.reserved, self.allocated, self.free, self.emptied = 0, 0, 10_000 << 20, 0
        self.segments = []
        for name, fn in {
            "synchronize": lambda d=None: None,
            "memory_reserved": lambda d=None: self.reserved,
            "memory_allocated": lambda d=None: self.allocated,
            "mem_get_info": lambda d=None: (self.free, 20_000 << 20),
            "empty_cache": self.empty,
            "memory_snapshot": lambda: self.segments,
            "current_device": lambda: 0,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def empty(self):
        self.emptied += 1
        # Private pools keep their segments; the default pool keeps what is in use.
        kept = sum(
            s["total_size"] if s["segment_pool_id"] != (0, 0) else s["allocated_size"]
            for s in self.segments
        )
        kept = kept if self.segments else self.allocated
        self.free += self.reserved - kept
        self.reserved = kept


def test_the_meter_accounts_pools_cache_and_driver_and_releases_what_the_phase_left(monkeypatch):
    dev = FakeDevice(monkeypatch)
    dev.reserved = dev.allocated = 100 << 20
    meter = MemoryMeter.start(0)
    # The phase: a pool of 40 MiB (30 in use), 50 MiB cached outside it, 8 MiB taken
    # by the driver.
    dev.segments = [
        {
            "device": 0,
            "segment_pool_id": (1, 0),
            "total_size": 40 << 20,
            "allocated_size": 30 << 20,
        },
        {
            "device": 0,
            "segment_pool_id": (0, 0),
            "total_size": 150 << 20,
            "allocated_size": 100 << 20,
        },
    ]
    dev.reserved, dev.allocated = 190 << 20, 130 << 20
    dev.free -= (90 << 20) + (8 << 20)
    account = meter.finish([(1, 0)], what="test")
    assert account == MemoryAccount(40 << 20, 30 << 20, 50 << 20, 50 << 20, 8 << 20)
    assert dev.emptied == 1 and dev.reserved == 140 << 20


def test_the_meter_leaves_cache_that_was_there_before_unless_asked(monkeypatch):
    dev = FakeDevice(monkeypatch)
    dev.reserved, dev.allocated = 300 << 20, 100 << 20  # the caller's 200 MiB cached
    meter = MemoryMeter.start(0)
    assert meter.finish([], what="test").released_bytes == 0
    assert dev.emptied == 0
    assert meter.finish([], what="test", release=True).released_bytes == 200 << 20


def test_a_meter_started_with_release_gives_the_cache_back_first_and_remakes_workspaces(
    monkeypatch,
):
    from cudagraphs import memory

    dev = FakeDevice(monkeypatch)
    placed = []
    monkeypatch.setattr(memory, "place_cublas_workspaces", placed.append)
    dev.reserved, dev.allocated = 300 << 20, 100 << 20  # eager steps' 200 MiB cached
    meter = MemoryMeter.start(0, release="make_graphed_callables")
    assert dev.emptied == 1 and dev.reserved == 100 << 20 and placed == [0]
    # The phase leaves nothing cached: the account counts the release before it.
    assert meter.finish([], what="test") == MemoryAccount(0, 0, 0, 200 << 20, 0)
    assert dev.emptied == 1


def test_a_meter_started_without_eager_workspaces_releases_but_places_none(monkeypatch):
    from cudagraphs import memory

    dev = FakeDevice(monkeypatch)
    placed = []
    monkeypatch.setattr(memory, "place_cublas_workspaces", placed.append)
    dev.reserved, dev.allocated = 300 << 20, 100 << 20
    meter = MemoryMeter.start(0, release="graph_train_step", eager_workspaces=False)
    assert (dev.emptied, placed, meter.released_before) == (1, [], 200 << 20)


@pytest.mark.parametrize("cached_mib", [0, 1, 2])
def test_a_meter_started_with_release_leaves_two_mib_or_less(monkeypatch, cached_mib):
    from cudagraphs import memory

    dev = FakeDevice(monkeypatch)
    placed = []
    monkeypatch.setattr(memory, "place_cublas_workspaces", placed.append)
    dev.reserved, dev.allocated = (100 + cached_mib) << 20, 100 << 20
    meter = MemoryMeter.start(0, release="test")
    assert (dev.emptied, placed, meter.released_before) == (0, [], 0)


def test_a_meter_started_with_release_under_keep_cache_releases_nothing(monkeypatch):
    from cudagraphs import memory

    dev = FakeDevice(monkeypatch)
    placed = []
    monkeypatch.setattr(memory, "place_cublas_workspaces", placed.append)
    monkeypatch.setenv(KEEP_CACHE_ENV, "1")
    dev.reserved, dev.allocated = 300 << 20, 100 << 20
    meter = MemoryMeter.start(0, release="test")
    assert (dev.emptied, placed, meter.released_before, dev.reserved) == (0, [], 0, 300 << 20)


def test_what_packing_gave_back_is_counted_and_the_finish_compares_with_the_cache_after_it(
    monkeypatch,
):
    dev = FakeDevice(monkeypatch)
    # Started with 80 MiB of holes between state tensors cached and unused, 2 MiB of
    # them the release can take; packing closes the other 78 and gives them back.
    dev.reserved, dev.allocated = 180 << 20, 100 << 20
    dev.segments = []

    def pack():
        dev.reserved = 100 << 20
        return 78 << 20

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: setattr(dev, "reserved", 178 << 20))
    meter = MemoryMeter.start(0, release="test", eager_workspaces=False, pack=pack)
    assert (meter.unused_cache, meter.released_before) == (0, 80 << 20)
    # The capture then left 30 MiB cached outside any pool: given back at the finish,
    # where the cache before packing (80 MiB) would have kept it.
    monkeypatch.setattr(torch.cuda, "empty_cache", dev.empty)
    dev.reserved = 130 << 20
    account = meter.finish((), what="test")
    assert dev.reserved == 100 << 20
    assert account.released_bytes == (80 + 30) << 20


def test_the_workspaces_are_made_after_packing(monkeypatch):
    # A workspace made before packing would fill a hole between state tensors and pin
    # that segment: packing could no longer give it back.
    from cudagraphs import memory

    dev = FakeDevice(monkeypatch)
    order = []
    monkeypatch.setattr(memory, "place_cublas_workspaces", lambda d: order.append("workspaces"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("release"))
    dev.reserved, dev.allocated = 300 << 20, 100 << 20
    MemoryMeter.start(0, release="test", pack=lambda: order.append("pack") or (1 << 20))
    assert order == ["release", "pack", "workspaces"]


def test_keep_cache_turns_every_release_off(monkeypatch):
    dev = FakeDevice(monkeypatch)
    dev.reserved = 64 << 20
    monkeypatch.setenv(KEEP_CACHE_ENV, "1")
    assert release_unused_cache(0, "test") == 0
    assert dev.emptied == 0
    monkeypatch.setenv(KEEP_CACHE_ENV, "maybe")
    with pytest.raises(CudaGraphsValueError, match=KEEP_CACHE_ENV):
        release_unused_cache(0, "test")


@settings(
    max_examples=200,
    deadline=None,
    # Each example patches inside its own monkeypatch.context().
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    cached=st.integers(0, 8 << 20),
    release=st.sampled_from([None, "layer"]),
    workspaces=st.booleans(),
    keep=st.booleans(),
    packed=st.one_of(st.none(), st.integers(0, 4 << 20)),
)
def test_the_meter_start_releases_and_places_as_its_rule_says(
    monkeypatch, cached, release, workspaces, keep, packed
):
    from cudagraphs import memory

    with monkeypatch.context() as mp:
        dev = FakeDevice(mp)
        placed = []
        mp.setattr(memory, "place_cublas_workspaces", placed.append)
        if keep:
            mp.setenv(KEEP_CACHE_ENV, "1")
        else:
            mp.delenv(KEEP_CACHE_ENV, raising=False)
        dev.reserved, dev.allocated = (100 << 20) + cached, 100 << 20
        calls = []
        pack = None if packed is None else (lambda: calls.append(1) or packed)
        meter = MemoryMeter.start(0, release=release, eager_workspaces=workspaces, pack=pack)
        # The rule, written plainly: asked, more than 2 MiB cached, not kept; packing
        # whenever asked to release; workspaces where either gave anything back.
        releases = release is not None and cached > 2 << 20 and not keep
        packs = release is not None and packed is not None
        gave = (cached if releases else 0) + (packed if packs else 0)
        assert dev.emptied == int(releases)
        assert calls == ([1] if packs else [])
        assert meter.released_before == gave
        assert placed == ([0] if gave and workspaces else [])
        assert meter.unused_cache == (0 if releases else cached)


# ---- tensor_bytes and the gate of packing before a capture, against plain references -----
_VIEWS = st.lists(
    st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 7))), max_size=12
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=4, max_size=4), _VIEWS)
def test_tensor_bytes_is_the_sum_over_the_distinct_bases_viewed(sizes, picks):
    bases = [torch.zeros(n, dtype=torch.float16) for n in sizes]
    tensors = [None if p is None else bases[p[0]][: 1 + p[1] % sizes[p[0]]] for p in picks]
    used = {p[0] for p in picks if p is not None}
    assert tensor_bytes(tensors) == sum(2 * sizes[i] for i in used)


@pytest.mark.parametrize("env", [None, "keep", "no_compact"])
@pytest.mark.parametrize("in_no_graph", [False, True])
def test_packing_before_a_capture_is_gated_by_both_variables_and_passes_in_no_graph(
    monkeypatch, env, in_no_graph
):
    from cudagraphs import optimizer_state
    from cudagraphs.settings import COMPACT_STATE_ENV

    calls = []
    monkeypatch.setattr(
        optimizer_state,
        "compact_fragmented",
        lambda o, d, w, in_no_graph=False: calls.append((len(o), d, w, in_no_graph)) or (8, 4),
    )
    monkeypatch.delenv(KEEP_CACHE_ENV, raising=False)
    monkeypatch.delenv(COMPACT_STATE_ENV, raising=False)
    if env == "keep":
        monkeypatch.setenv(KEEP_CACHE_ENV, "1")
    elif env == "no_compact":
        monkeypatch.setenv(COMPACT_STATE_ENV, "0")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    got = optimizer_state.compact_before_capture([opt], 2, "test", in_no_graph=in_no_graph)
    if env is None:
        assert got == (8, 4) and calls == [(1, 2, "test", in_no_graph)]
    else:
        assert got == (0, 0) and calls == []
    assert optimizer_state.compact_before_capture([], 2, "test") == (0, 0)
