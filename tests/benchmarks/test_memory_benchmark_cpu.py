"""CPU tests of ``benchmarks/memory.py``'s pure logic: the largest-batch search against
a brute-force reference, the ratios to each variant's eager reference, and the
targets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import script


def _mem():
    return script("memory")


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(0, 600), start=st.integers(1, 64), limit=st.integers(1, 512))
def test_largest_finds_the_brute_force_answer_of_a_monotone_probe(threshold, start, limit):
    mem = _mem()
    best, probes = mem.largest(lambda b: b <= threshold, start, limit)
    want = max((b for b in range(1, limit + 1) if b <= threshold), default=0)
    assert best == want
    # Every probe's answer is the probe's, and no batch is probed twice.
    assert all(ok == (b <= threshold) for b, ok in probes)
    assert len({b for b, _ in probes}) == len(probes)
    assert len(probes) <= 2 * limit.bit_length() + 2


def _run(reserved, allocated=1, ok=True):
    return {
        "ok": ok,
        "reserved": reserved,
        "allocated": allocated,
        "steady_reserved": reserved,
        "steady_allocated": allocated,
    }


def test_ratios_are_to_each_variants_own_eager_reference():
    mem = _mem()
    got = mem.ratios(
        {
            "eager": _run(100, 10),
            "graph_train_step": _run(105, 12),
            "trainer_eager": _run(200),
            "trainer_callback": _run(230),
            "partial_model": _run(300, ok=False),
        }
    )
    assert got["graph_train_step"]["reserved"] == 1.05
    assert got["graph_train_step"]["allocated"] == 1.2
    assert got["trainer_callback"]["reserved"] == 1.15
    assert "partial_model" not in got  # it did not run: no ratio, no target
    # No static buffers recorded: the allocated peak as it is.
    assert got["graph_train_step"]["allocated_less_static"] == 1.2


def test_the_allocated_allowance_is_the_static_buffers_of_the_account_or_the_stats():
    mem = _mem()
    with_account = {**_run(100, 20), "info": {"account": {"static_bytes": 4}}}
    with_stats = {**_run(100, 20), "info": {"stats": {"static_bytes": 9, "captured": 2}}}
    got = mem.ratios(
        {"eager": _run(100, 10), "graph_train_step": with_account, "partial_model": with_stats}
    )
    assert got["graph_train_step"]["allocated_less_static"] == 1.6
    assert got["partial_model"]["allocated_less_static"] == 1.1
    assert mem.static_bytes({"info": {"account": None}}) == 0
    assert mem.static_bytes({}) == 0


def test_targets_take_the_worst_shape_and_need_an_eager_batch():
    mem = _mem()
    shape_ratios = {
        "small": {"graph_train_step": {"reserved": 1.02}, "graph_stack": {"reserved": 1.2}},
        "mid": {"graph_train_step": {"reserved": 1.12}},
    }
    searched = {
        "graph_train_step": {"eager": {"largest_batch": 9}, "graphed": {"largest_batch": 9}},
        "partial_default": {"eager": {"largest_batch": 9}, "graphed": {"largest_batch": 8}},
        "graphed_generator": {"hf_static": {"largest_batch": 0}, "graphed": {"largest_batch": 0}},
    }
    shape_ratios["small"]["graph_stack"]["allocated_less_static"] = 1.04
    shape_ratios["mid"]["graph_train_step"]["allocated_less_static"] = 1.06
    got = mem.targets(shape_ratios, searched)
    assert got == {
        "graph_train_step_peak_reserved_le_1.10x_eager": False,
        "graph_train_step_peak_allocated_le_1.05x_eager_plus_static": False,
        "graph_stack_peak_reserved_le_1.10x_eager": False,
        "graph_stack_peak_allocated_le_1.05x_eager_plus_static": True,
        "graph_train_step_largest_batch_ge_eager": True,
        "partial_default_largest_batch_ge_eager": False,
        "graphed_generator_largest_batch_ge_eager": False,
    }


def test_every_searched_variant_is_searched_once_and_each_layer_gets_its_reference(
    monkeypatch,
):
    mem = _mem()
    calls = []

    def fake_search(variant, shape, cap, start, limit):
        calls.append((variant, shape, cap, start, limit))
        return {"largest_batch": len(variant), "probes": []}

    monkeypatch.setattr(mem, "search", fake_search)
    got = mem.search_all(6.0, 3.5, jobs=3)
    assert sorted(calls) == sorted(
        [
            ("eager", "small", 6.0, 16, 512),
            ("graph_train_step", "small", 6.0, 16, 512),
            ("partial_default", "small", 6.0, 16, 512),
            ("hf_static", "mid", 3.5, 32, 512),
            ("graphed_generator", "mid", 3.5, 32, 512),
        ]
    )
    assert got == {
        layer: {
            ref: {"largest_batch": len(ref), "probes": []},
            "graphed": {"largest_batch": len(layer), "probes": []},
        }
        for layer, ref in mem.SEARCHED.items()
    }


def _block(size, state="active_allocated", where=None):
    block = {"size": size, "state": state}
    if where is not None:
        block["frames"] = [
            {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": where[0], "line": where[1], "name": where[2]},
        ]
    return block


def test_the_census_counts_each_pool_and_names_the_pins_of_mostly_free_segments():
    mem = _mem()
    mib = 1 << 20
    snapshot = {
        "segments": [
            # A 20 MiB default segment held by one 2 MiB block: pinned, 18 MiB for nothing.
            {
                "total_size": 20 * mib,
                "segment_pool_id": (0, 0),
                "blocks": [
                    _block(2 * mib, where=("/w/src/cudagraphs/core/capture_phase.py", 75, "clone")),
                    _block(18 * mib, state="inactive"),
                ],
            },
            # Half used or more: not pinned.
            {
                "total_size": 4 * mib,
                "segment_pool_id": (0, 0),
                "blocks": [_block(2 * mib), _block(2 * mib, state="inactive")],
            },
            # Wholly free: the allocator can give it back, nothing pins it.
            {
                "total_size": 8 * mib,
                "segment_pool_id": (0, 0),
                "blocks": [_block(8 * mib, "inactive")],
            },
            # A graph pool's segment, mostly free: pools are not the eager cache.
            {
                "total_size": 64 * mib,
                "segment_pool_id": (0, 3),
                "blocks": [_block(mib), _block(63 * mib, "inactive")],
            },
        ]
    }
    out = mem.segment_census(snapshot)
    assert out["pools"] == {
        "default": {"segments": 3, "reserved": 32 * mib, "active": 4 * mib},
        "graph(0, 3)": {
            "segments": 1,
            "reserved": 64 * mib,
            "active": mib,
            "sites": [{"where": "?", "bytes": mib, "blocks": 1}],
        },
    }
    assert out["pinned_segments"] == 1 and out["pinned_bytes"] == 18 * mib
    (pin,) = out["pinned"]
    assert pin["segment"] == 20 * mib and pin["active"] == 2 * mib
    assert pin["blocks"] == [{"size": 2 * mib, "where": "core/capture_phase.py:75 clone"}]


def test_the_census_of_an_empty_snapshot_and_of_blocks_without_frames():
    mem = _mem()
    assert mem.segment_census({}) == {
        "pools": {},
        "pinned_segments": 0,
        "pinned_bytes": 0,
        "pinned": [],
    }
    seg = {"total_size": 100, "blocks": [_block(10)]}  # no pool id: the default pool
    out = mem.segment_census({"segments": [seg]})
    assert out["pinned"][0]["blocks"] == [{"size": 10, "where": "?"}]


BLOCK = st.tuples(st.integers(1, 64), st.sampled_from(["active_allocated", "inactive"]))
SEGMENT = st.tuples(st.sampled_from([(0, 0), (0, 1), (0, 7)]), st.lists(BLOCK, max_size=6))


@settings(max_examples=200, deadline=None)
@given(st.lists(SEGMENT, max_size=8))
def test_the_census_matches_a_plain_count_of_every_snapshot(segments):
    mem = _mem()
    snapshot = {
        "segments": [
            {
                "total_size": sum(size for size, _ in blocks),
                "segment_pool_id": pool,
                "blocks": [{"size": size, "state": state} for size, state in blocks],
            }
            for pool, blocks in segments
        ]
    }
    out = mem.segment_census(snapshot)
    pools: dict = {}
    pinned = []
    for pool, blocks in segments:
        name = "default" if pool == (0, 0) else f"graph{pool}"
        total = sum(size for size, _ in blocks)
        live = sum(size for size, state in blocks if state == "active_allocated")
        row = pools.setdefault(name, {"segments": 0, "reserved": 0, "active": 0})
        row["segments"] += 1
        row["reserved"] += total
        row["active"] += live
        if name == "default" and live and live < mem.PINNED_SHARE * total:
            pinned.append(total - live)
        if name != "default":  # blocks without frames: one site, "?"
            row.setdefault("n_live", 0)
            row["n_live"] += sum(1 for _, state in blocks if state == "active_allocated")
    for name, row in pools.items():
        if name != "default":
            n = row.pop("n_live")
            row["sites"] = [{"where": "?", "bytes": row["active"], "blocks": n}] if n else []
    assert out["pools"] == pools
    assert out["pinned_segments"] == len(pinned)
    assert out["pinned_bytes"] == sum(pinned)
    held = [r["held_for_nothing"] for r in out["pinned"]]
    assert held == sorted(pinned, reverse=True)[: mem.CENSUS_TOP]


def test_steady_growth_sums_new_segments_by_pool_and_site_largest_first():
    mem = _mem()
    mib = 1 << 20
    loss = ("/w/benchmarks/memory.py", 200, "eager_step")
    static = ("/w/src/cudagraphs/core/capture_phase.py", 76, "_new_static_input")

    def event(action, size, where=None, pool=None):
        e = {"action": action, "size": size, **_block(size, where=where)}
        e.pop("state")
        if pool is not None:
            e["pool_id"] = pool
        return e

    entries = [
        event("alloc", 64 * mib, loss),  # a block from a cached segment: no growth
        event("segment_alloc", 20 * mib, loss),
        event("segment_alloc", 20 * mib, loss),
        event("segment_map", 2 * mib, static, pool=(0, 1)),
        event("segment_free", 20 * mib, loss),
        event("segment_alloc", 262 * mib),
    ]
    assert mem.steady_growth(entries) == [
        {"pool": "default", "where": "?", "bytes": 262 * mib, "events": 1},
        {
            "pool": "default",
            "where": "benchmarks/memory.py:200 eager_step",
            "bytes": 40 * mib,
            "events": 2,
        },
        {
            "pool": "graph(0, 1)",
            "where": "core/capture_phase.py:76 _new_static_input",
            "bytes": 2 * mib,
            "events": 1,
        },
    ]
    assert mem.steady_growth([]) == []


def test_growth_reads_each_events_pool_from_where_its_address_lies():
    """torch's trace entries carry no pool: an event is attributed to the final
    segment that holds its address (an expandable graph segment maps pages inside
    its range), and to ``released`` when that segment went back to the driver."""
    mem = _mem()
    mib = 1 << 20
    here = ("/w/src/cudagraphs/partial/graphing.py", 391, "forward")
    segments = [
        {"address": 100 * mib, "total_size": 30 * mib, "segment_pool_id": (0, 0)},
        {"address": 1000 * mib, "total_size": 460 * mib, "segment_pool_id": (0, 1)},
    ]

    def event(action, size, addr):
        e = {"action": action, "size": size, "addr": addr, **_block(size, where=here)}
        e.pop("state")
        return e

    entries = [
        event("segment_alloc", 30 * mib, 100 * mib),  # the default segment itself
        event("segment_map", 20 * mib, 1000 * mib),  # the first pages of the pool
        event("segment_map", 20 * mib, 1439 * mib),  # its last pages
        event("segment_alloc", 250 * mib, 5000 * mib),  # given back since
        event("segment_map", 2 * mib, 1460 * mib),  # one past the pool's end
    ]
    assert mem.pool_of(1459 * mib, segments) == "graph(0, 1)"
    assert mem.pool_of(1460 * mib, segments) == "released"
    assert mem.pool_of(99 * mib, segments) == "released"
    where = "partial/graphing.py:391 forward"
    assert mem.steady_growth(entries, segments) == [
        {"pool": "released", "where": where, "bytes": 252 * mib, "events": 2},
        {"pool": "graph(0, 1)", "where": where, "bytes": 40 * mib, "events": 2},
        {"pool": "default", "where": where, "bytes": 30 * mib, "events": 1},
    ]
    # An entry that names its pool keeps it; without segments, the default pool.
    named = {**entries[1], "pool_id": (0, 7)}
    assert mem.steady_growth([named], segments)[0]["pool"] == "graph(0, 7)"
    assert mem.steady_growth(entries[:1])[0]["pool"] == "default"


def test_variants_keep_each_shapes_order_and_refuse_a_name_no_shape_runs():
    mem = _mem()
    every = mem.shape_jobs(["small", "decode"], [])
    assert every == [("small", v) for v in mem.SHAPE_VARIANTS["small"]] + [
        ("decode", v) for v in mem.SERVING_VARIANTS
    ]
    only = mem.shape_jobs(["small", "6b"], ["partial_model", "eager"])
    assert only == [("small", "eager"), ("small", "partial_model"), ("6b", "eager")]
    with pytest.raises(SystemExit, match="graph_runner"):
        mem.shape_jobs(["small"], ["eager", "graph_runner"])


@pytest.mark.parametrize(
    "variant, expected",
    [
        ("graph_stack", ("graph_stack", False, False)),
        ("graph_stack_lent", ("graph_stack", True, False)),
        ("graph_stack_late", ("graph_stack", False, True)),
        ("make_graphed_callables", ("make_graphed_callables", False, False)),
        ("make_graphed_callables_lent", ("make_graphed_callables", True, False)),
        ("make_graphed_callables_late", ("make_graphed_callables", False, True)),
        ("graph_stack_late_lent", None),
        ("graph_train_step", None),
        ("partial_default", None),
        ("eager", None),
    ],
)
def test_per_layer_variants_are_read_from_their_names(variant, expected):
    mem = script("memory")
    assert mem.layer_kind(variant) == expected


def test_late_variants_run_on_small_and_mid_against_eager_with_a_target_each():
    mem = script("memory")
    for late in mem.LATE_LAYERS:
        assert mem.REFERENCE[late] == "eager"
        assert late in mem.SHAPE_VARIANTS["small"] and late in mem.SHAPE_VARIANTS["mid"]
    shape_ratios = {"small": {late: {"reserved": 1.2} for late in mem.LATE_LAYERS}}
    got = mem.targets(shape_ratios, {})
    assert got == {f"{late}_peak_reserved_le_1.10x_eager": False for late in mem.LATE_LAYERS}


# --- the peak census: what was live at the trace's highest reserved memory -------------
MIB = 1 << 20
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "grow", "shrink", "other"]),
        st.integers(0, 7),  # which block or segment slot
        st.sampled_from([1, 3, 8, 20]),  # MiB
        st.sampled_from(["a.py", "b.py"]),
    ),
    max_size=40,
)


def _trace_of(ops):
    """A consistent trace from random operations: blocks at addresses 0..7 MiB * 100
    (an alloc of a live address, a free of a dead one are skipped), segments at
    10_000 MiB + slot, grown and given back whole."""
    entries, live, segs = [], {}, {}
    for op, slot, mib, where in ops:
        frames = [{"filename": f"/x/{where}", "line": slot, "name": "f"}]
        if op == "alloc" and slot not in live:
            live[slot] = mib
            entries.append(
                {"action": "alloc", "addr": slot * 100 * MIB, "size": mib * MIB, "frames": frames}
            )
        elif op == "free" and slot in live:
            entries.append(
                {"action": "free_requested", "addr": slot * 100 * MIB, "size": live[slot] * MIB}
            )
            entries.append(
                {"action": "free_completed", "addr": slot * 100 * MIB, "size": live.pop(slot) * MIB}
            )
        elif op == "grow" and slot not in segs:
            segs[slot] = mib
            entries.append(
                {
                    "action": "segment_map" if mib == 3 else "segment_alloc",
                    "addr": (10_000 + slot) * MIB,
                    "size": mib * MIB,
                }
            )
        elif op == "shrink" and slot in segs:
            action = "segment_unmap" if segs[slot] == 3 else "segment_free"
            entries.append(
                {"action": action, "addr": (10_000 + slot) * MIB, "size": segs.pop(slot) * MIB}
            )
        elif op == "other":
            entries.append({"action": "snapshot", "addr": 0, "size": 0})
    return entries


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_the_peak_census_matches_a_recount_at_every_entry(ops):
    mem = _mem()
    entries = _trace_of(ops)
    # Blocks 0..3 lie in a graph pool's final segment, the rest in none (released).
    segments = [{"address": 0, "total_size": 400 * MIB, "segment_pool_id": (1, 2)}]
    out = mem.peak_census(entries, segments)

    def reserved_after(i):
        sign = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
        return sum(sign.get(e["action"], 0) * e["size"] for e in entries[: i + 1])

    def live_after(i):
        live = {}
        for e in entries[: i + 1]:
            if e["action"] == "alloc":
                live[e["addr"]] = e
            elif e["action"] == "free_completed":
                del live[e["addr"]]
        return live

    levels = [reserved_after(i) for i in range(len(entries))]
    best = max(levels, default=-1)
    at = levels.index(best) if levels else -1
    assert (out["index"], out["of"]) == (at, len(entries))
    assert out["reserved"] == max(best, 0)
    live = live_after(at) if at >= 0 else {}
    assert out["allocated"] == sum(e["size"] for e in live.values())
    for pool, addrs in (("graph(1, 2)", range(0, 4)), ("released", range(4, 8))):
        blocks = [e for a, e in live.items() if a // (100 * MIB) in addrs]
        if not blocks:
            assert pool not in out["pools"]
            continue
        row = out["pools"][pool]
        assert row["live"] == sum(e["size"] for e in blocks)
        assert sum(s["bytes"] for s in row["sites"]) == row["live"]
        assert sum(s["blocks"] for s in row["sites"]) == len(blocks)
        # A big block is named with its size; sites are by bytes, largest first.
        for s in row["sites"]:
            assert s["where"].startswith("x/a.py:") or s["where"].startswith("x/b.py:")
            assert (" [" in s["where"]) == s["where"].endswith(" MiB]")
        assert [s["bytes"] for s in row["sites"]] == sorted(
            (s["bytes"] for s in row["sites"]), reverse=True
        )


def test_the_peak_census_names_what_made_the_peak():
    mem = _mem()
    f = [{"filename": "/m/warmup.py", "line": 108, "name": "_warmup_backward"}]
    entries = [
        {"action": "segment_alloc", "addr": 0, "size": 300 * MIB},
        {"action": "alloc", "addr": 0, "size": 125 * MIB, "frames": f},
        {"action": "alloc", "addr": 200 * MIB, "size": 2 * MIB, "frames": f},
        {"action": "segment_alloc", "addr": 1000 * MIB, "size": 40 * MIB},
        {"action": "free_completed", "addr": 0, "size": 125 * MIB},
        {"action": "segment_free", "addr": 1000 * MIB, "size": 40 * MIB},
    ]
    out = mem.peak_census(
        entries, [{"address": 0, "total_size": 300 * MIB, "segment_pool_id": (0, 0)}]
    )
    assert (out["index"], out["reserved"], out["allocated"]) == (3, 340 * MIB, 127 * MIB)
    assert out["pools"]["default"]["sites"] == [
        {"where": "m/warmup.py:108 _warmup_backward [125 MiB]", "bytes": 125 * MIB, "blocks": 1},
        {"where": "m/warmup.py:108 _warmup_backward", "bytes": 2 * MIB, "blocks": 1},
    ]
