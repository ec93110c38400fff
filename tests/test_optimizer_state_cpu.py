"""Optimizer state packed into one buffer per dtype (``cudagraphs.optimizer_state``):
which tensors move (a property test against a plain rule), that moved tensors keep
their identity, values and 512-byte alignment, that the optimizer's next steps are
bitwise those of an unpacked twin, and which optimizers a recording sees step. The
packing is device-generic, so CPU tensors stand in for CUDA ones."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs import optimizer_state
from cudagraphs.optimizer_state import (
    ALIGN_BYTES,
    MIN_GAIN_BYTES,
    SteppedOptimizers,
    compact_optimizer_state,
    freeable_segments,
    movable_state,
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


def _trained(shapes, dtypes, *, foreach=True, steps=2, seed=0):
    torch.manual_seed(seed)
    params = [torch.randn(s, dtype=d, requires_grad=True) for s, d in zip(shapes, dtypes)]
    opt = torch.optim.AdamW(params, lr=0.1, foreach=foreach)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def _step(params, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(_SHAPES, st.sampled_from(_DTYPES)), min_size=1, max_size=6),
    st.booleans(),
)
def test_packed_state_keeps_identity_values_and_steps_bitwise(layout, foreach):
    shapes, dtypes = zip(*layout)
    params, opt = _trained(shapes, dtypes, foreach=foreach)
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = torch.optim.AdamW(twin_params, lr=0.1, foreach=foreach)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))

    before = {id(t): (t, t.clone()) for t in optimizer_state.movable_state(opt, "cpu")}
    moved = compact_optimizer_state(opt, "cpu")
    assert moved == sum(t.numel() * t.element_size() for t, _ in before.values())
    for t, old in before.values():
        assert torch.equal(t, old) and t.dtype == old.dtype and t.shape == old.shape
    # Identity: the optimizer's own entries are the very tensors that moved.
    state_ids = {id(v) for s in opt.state.values() for v in s.values()}
    assert set(before) <= state_ids
    # One storage per dtype, each tensor on a 512-byte boundary, none overlapping.
    per_dtype: dict[torch.dtype, set[int]] = {}
    spans = []
    for t, _ in before.values():
        per_dtype.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
        start = t.data_ptr()
        assert (start - t.untyped_storage().data_ptr()) % ALIGN_BYTES == 0
        spans.append((start, start + t.numel() * t.element_size()))
    assert all(len(ptrs) == 1 for ptrs in per_dtype.values())
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))

    for seed in (1, 2):
        _step(params, opt, seed)
        _step(twin_params, twin, seed)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    for (_, s), (_, u) in zip(opt.state.items(), twin.state.items()):
        for key in s:
            assert torch.equal(s[key], u[key])


# Each state tensor is made with a set of traits; the rule, as a plain predicate.
_TRAITS = st.fixed_dictionaries(
    {
        "kept_view": st.booleans(),
        "shared": st.booleans(),
        "strided": st.booleans(),
        "offset": st.booleans(),
        "grad": st.booleans(),
        "meta": st.booleans(),
        "subclass": st.booleans(),
        "empty": st.booleans(),
    }
)


class _Sub(torch.Tensor):
    pass


@settings(max_examples=60, deadline=None)
@given(st.lists(_TRAITS, min_size=1, max_size=6), st.booleans(), st.booleans())
def test_which_state_moves_follows_the_rule(traits, capturable, in_no_graph):
    params = [torch.zeros(2, requires_grad=True) for _ in traits]
    opt = torch.optim.SGD(params, lr=0.1)
    opt.param_groups[0]["capturable"] = capturable
    keep, expected = [], set()
    shared = torch.zeros(8)
    for p, tr in zip(params, traits):
        if tr["meta"]:
            t = torch.zeros(4, device="meta")
        elif tr["empty"]:
            t = torch.zeros(0)
        elif tr["shared"]:
            t = shared[:4] if not tr["offset"] else shared[4:]
        elif tr["strided"]:
            t = torch.zeros(4, 2)[:, 0]
        elif tr["offset"]:
            t = torch.zeros(6)[2:]
        else:
            t = torch.zeros(4)
        if tr["grad"] and t.is_floating_point():
            t = t.requires_grad_() if t._base is None else t.detach().requires_grad_()
        if tr["subclass"]:
            t = t.as_subclass(_Sub)
        if tr["kept_view"]:
            keep.append(t.view(-1))
        opt.state[p] = {"buf": t}
    # The rule: a plain CPU tensor, contiguous, no grad, filling a storage of bytes
    # only it holds, of an optimizer that is not capturable (or that no graph holds,
    # the caller says).
    for p in params:
        t = opt.state[p]["buf"]
        alone = (
            sum(
                opt.state[q]["buf"].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                for q in params
                if opt.state[q]["buf"].device.type == "cpu"
            )
            == 1
        )
        if (
            (not capturable or in_no_graph)
            and type(t) is torch.Tensor
            and t.device.type == "cpu"
            and not t.requires_grad
            and t.is_contiguous()
            and t.storage_offset() == 0
            and t.numel() > 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and alone
            and not any(
                k.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for k in keep
            )
        ):
            expected.add(id(t))
    moving = {id(t) for t in movable_state(opt, "cpu", in_no_graph=in_no_graph)}
    assert moving == expected
    if in_no_graph:
        expected = {id(t) for t in movable_state(opt, "cpu")}
    # What does not move keeps its storage.
    others = [(t, t.untyped_storage().data_ptr()) for s in opt.state.values() for t in s.values()]
    compact_optimizer_state(opt, "cpu")
    for t, ptr in others:
        if id(t) not in expected:
            assert t.untyped_storage().data_ptr() == ptr


def test_packing_twice_moves_nothing_the_second_time():
    _, opt = _trained([(3, 4), (5,)], [torch.float32, torch.float32])
    assert compact_optimizer_state(opt, "cpu") > 0
    # Now all share one storage: nothing is alone on its storage any more.
    assert compact_optimizer_state(opt, "cpu") == 0


def test_state_on_another_device_is_left_alone():
    _, opt = _trained([(3,)], [torch.float32])
    assert movable_state(opt, "meta") == []
    assert compact_optimizer_state(opt, "meta") == 0


def test_the_recording_sees_only_the_optimizers_that_stepped_inside():
    params_a, opt_a = _trained([(2,)], [torch.float32], steps=0)
    params_b, opt_b = _trained([(2,)], [torch.float32], steps=0)
    seen = SteppedOptimizers()
    _step(params_a, opt_a, 0)  # before: not seen
    seen.enter()
    seen.enter()  # idempotent: one hook
    _step(params_b, opt_b, 0)
    seen.leave()
    seen.leave()
    _step(params_a, opt_a, 1)  # after: not seen
    assert seen.optimizers() == [opt_b]
    assert seen.handle is None


def test_an_optimizer_dropped_by_its_owner_is_not_kept_alive():
    seen = SteppedOptimizers()
    seen.enter()
    params, opt = _trained([(2,)], [torch.float32], steps=1)
    seen.leave()
    assert len(seen.optimizers()) == 1
    del opt, params
    import gc

    gc.collect()
    assert seen.optimizers() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_two_optimizers_sums_the_bytes(dtype):
    _, a = _trained([(3, 4)], [dtype])
    _, b = _trained([(5,)], [dtype])
    moved = optimizer_state.pack(movable_state(a, "cpu") + movable_state(b, "cpu"))
    # AdamW's exp_avg and exp_avg_sq of each parameter; step stays on the CPU as a
    # float32 scalar tensor and moves too.
    size = torch.empty((), dtype=dtype).element_size()
    assert moved == 2 * (12 + 5) * size + 2 * 4


def test_a_manager_packs_only_the_optimizers_of_its_parameters():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD([{"params": [b.weight]}, {"params": [a.bias]}], lr=0.1)
    opt_c = torch.optim.SGD(b.parameters(), lr=0.1)
    assert optimizer_state.optimizers_of([opt_a, opt_b, opt_c], a.parameters()) == [
        opt_a,
        opt_b,
    ]


# A segment as a list of blocks, each (owner, size): "state" (a movable state tensor),
# "other" (a live tensor of anyone else) or "free"; and its pool.
_BLOCK = st.tuples(
    st.sampled_from(["state", "other", "free"]),
    st.integers(1, 12).map(lambda k: k * (1 << 19)),
)
_SEGMENT = st.tuples(st.lists(_BLOCK, min_size=1, max_size=6), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(_SEGMENT, max_size=6), st.integers(0, 4 << 20))
def test_freeable_segments_match_a_plain_reading_of_the_layout(layout, min_gain):
    segments, movable, expected = [], {}, []
    base = 1 << 30
    for blocks, graph_pool in layout:
        addresses, addr = [], base
        for _, size in blocks:
            addresses.append(addr)
            addr += size
        total = addr - base
        segments.append(
            {
                "address": base,
                "total_size": total,
                "segment_pool_id": (1, 0) if graph_pool else (0, 0),
                "blocks": [
                    {"size": size, "state": "inactive" if owner == "free" else "active_allocated"}
                    for owner, size in blocks
                ],
            }
        )
        states = [a for a, (owner, _) in zip(addresses, blocks) if owner == "state"]
        for a, (owner, size) in zip(addresses, blocks):
            if owner == "state":
                movable[a] = size
        free = sum(size for owner, size in blocks if owner == "free")
        others = any(owner == "other" for owner, _ in blocks)
        if not graph_pool and states and not others and free >= min_gain:
            expected.append((free, states))
        base = addr + (64 << 20)
    got = freeable_segments(segments, movable, min_gain)
    assert sorted(got) == sorted(expected)
    assert [gain for gain, _ in got] == sorted((gain for gain, _ in got), reverse=True)


def test_the_default_gain_leaves_exact_size_segments_alone():
    # A 22.5 MiB tensor in its own 24 MiB segment: 1.5 MiB of rounding, not worth it.
    seg = {
        "address": 0,
        "total_size": 24 << 20,
        "segment_pool_id": (0, 0),
        "blocks": [
            {"size": 45 << 19, "state": "active_allocated"},
            {"size": 3 << 19, "state": "inactive"},
        ],
    }
    assert freeable_segments([seg], {0: 45 << 19}) == []
    assert freeable_segments([seg], {0: 45 << 19}, min_gain=1 << 20) == [(3 << 19, [0])]
    assert MIN_GAIN_BYTES == 2 << 20


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3 << 20), st.sampled_from(_DTYPES)), max_size=6))
def test_buffer_bytes_bounds_what_packing_allocates(layout):
    tensors = [torch.empty(n // 8 + 1, dtype=d) for n, d in layout]
    bound = optimizer_state.buffer_bytes(tensors)
    # Per dtype: the 512-byte aligned sizes, summed, rounded up to 2 MiB.
    want = 0
    for dtype in {t.dtype for t in tensors}:
        total = sum(-(-t.nbytes // 512) * 512 for t in tensors if t.dtype == dtype)
        want += -(-total // (2 << 20)) * (2 << 20)
    assert bound == want
    assert bound >= sum(t.nbytes for t in tensors)


class _Allocator:
    """A stand-in for the CUDA allocator's counters around ``compact_fragmented``: the
    plan's segments are reserved; each packing grows reserved by the buffers it makes
    (``buffer_bytes``); a release gives back every planned segment whose tensors all
    moved. Records reserved after every change."""

    def __init__(self, plan, tensors, peak, base):
        self.plan, self.tensors = plan, tensors
        self.reserved = base + sum(size for size, _ in plan)
        self.peak = max(peak, self.reserved)
        self.moved: set[int] = set()
        self.given_back: set[int] = set()
        self.history = [self.reserved]

    def pack(self, tensors):
        self.reserved += optimizer_state.buffer_bytes(tensors)
        self.moved |= {id(t) for t in tensors}
        self.history.append(self.reserved)
        return sum(t.nbytes for t in tensors)

    def release(self, device, what):
        freed = 0
        for i, (size, ptrs) in enumerate(self.plan):
            if i not in self.given_back and all(id(self.tensors[p]) in self.moved for p in ptrs):
                self.given_back.add(i)
                freed += size
        self.reserved -= freed
        self.history.append(self.reserved)
        return freed


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 4)).map(
            lambda r: (r[0] * (1 << 20), r[1])  # state bytes per tensor, holes in MiB
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 24),
)
def test_packing_never_rises_above_the_peak_and_packs_what_fits(layout, headroom_mib):
    with pytest.MonkeyPatch.context() as monkeypatch:
        _check_packing_under_the_peak(layout, headroom_mib, monkeypatch)


def _check_packing_under_the_peak(layout, headroom_mib, monkeypatch):
    # One segment per row: two state tensors of the row's size and its holes.
    tensors, plan, opt_state = {}, [], {}
    params = []
    for nbytes, holes in layout:
        ptrs = []
        for _ in range(2):
            t = torch.zeros(nbytes // 4)
            tensors[t.data_ptr()] = t
            ptrs.append(t.data_ptr())
            p = torch.zeros(1, requires_grad=True)
            params.append(p)
            opt_state[p] = {"exp_avg": t}
        plan.append((2 * nbytes + holes * (1 << 20), ptrs))
    opt = torch.optim.SGD(params, lr=0.1)
    for p, s in opt_state.items():
        opt.state[p] = s
    base = 100 << 20
    alloc = _Allocator(plan, tensors, 0, base)
    alloc.peak = alloc.reserved + headroom_mib * (1 << 20)
    real_pack = optimizer_state.pack

    def pack(batch):
        alloc.pack(batch)
        return real_pack(batch)

    monkeypatch.setattr(optimizer_state, "pack", pack)
    monkeypatch.setattr(optimizer_state, "release_unused_cache", alloc.release)
    monkeypatch.setattr(
        optimizer_state,
        "movable_state",
        lambda o, d, in_no_graph=False: [tensors[p] for _, ptrs in plan for p in ptrs],
    )
    monkeypatch.setattr(optimizer_state, "freeable_segments", lambda segs, movable: list(plan))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: alloc.reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: alloc.peak)

    moved, released = optimizer_state.compact_fragmented([opt], 0, "test")

    assert max(alloc.history) <= alloc.peak
    assert released == sum(plan[i][0] for i in alloc.given_back)
    assert moved == sum(tensors[p].nbytes for i in alloc.given_back for p in plan[i][1])
    # A segment left alone is one whose own buffer did not fit the room at its turn;
    # the largest gain first, so the first segment is packed whenever it fits at all.
    first = optimizer_state.buffer_bytes([tensors[p] for p in plan[0][1]])
    assert (0 in alloc.given_back) == (first <= alloc.peak - (base + sum(s for s, _ in plan)))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), max_size=4), min_size=1, max_size=4),
    st.sets(st.integers(0, 5)),
)
def test_optimizers_of_keeps_those_updating_any_wanted_parameter(groups_of, wanted):
    params = [torch.zeros(1, requires_grad=True) for _ in range(6)]
    # One optimizer per entry, each parameter group a distinct set of indices.
    optimizers, owners = [], []
    for indices in groups_of:
        unique = sorted(set(indices))
        groups = [{"params": [params[i]]} for i in unique] or [{"params": []}]
        optimizers.append(torch.optim.SGD(groups, lr=0.1))
        owners.append(set(unique))
    got = optimizer_state.optimizers_of(optimizers, [params[i] for i in wanted])
    assert got == [o for o, own in zip(optimizers, owners) if own & wanted]
