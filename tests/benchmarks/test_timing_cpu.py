"""CPU tests of the timing helpers the benchmarks share (no GPU: synchronize is a
stub, and the profiler's intervals are given directly)."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraphs.timing import (
    _union_length,
    _usable_intervals,
    interleaved_samples_ms,
    quiet_gc,
    summarize,
)


def test_interleaved_samples_give_one_sample_per_round_per_step():
    calls: list[str] = []
    steps = {n: (lambda n=n: calls.append(n)) for n in "xyz"}
    samples = interleaved_samples_ms(
        steps, iters=2, warmup=0, repeats=4, synchronize=lambda: None, shuffle_seed=3
    )
    assert set(samples) == set("xyz")
    assert all(len(v) == 4 and all(t >= 0 for t in v) for v in samples.values())
    assert sorted(calls) == sorted("xyz" * 8)


def test_garbage_collection_is_off_inside_the_timed_rounds_only():
    seen: list[bool] = []
    samples = interleaved_samples_ms(
        {"a": lambda: seen.append(gc.isenabled())},
        iters=1,
        warmup=1,
        repeats=2,
        synchronize=lambda: None,
    )
    assert seen == [True, False, False]  # warmup with gc, then the timed rounds without
    assert gc.isenabled() and len(samples["a"]) == 2


def test_quiet_gc_restores_the_collector_after_an_error_and_keeps_it_off_if_it_was():
    with pytest.raises(RuntimeError), quiet_gc():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with quiet_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_summarize_reports_median_and_range():
    assert summarize([3.0, 1.0, 2.0, 10.0]) == {
        "median": 2.5,
        "min": 1.0,
        "max": 10.0,
        "rounds": 4,
    }
    assert summarize([1.23456789], digits=3)["median"] == 1.235
    with pytest.raises(ValueError, match="at least one sample"):
        summarize([])


def test_zero_start_and_empty_profiler_intervals_are_dropped_before_merging():
    # CUDA 13.0's profiler reports some activities starting at timestamp 0; merged,
    # one of them would count the time from the epoch as busy.
    raw = [(0.0, 1_000_050.0), (1_000_000.0, 1_000_010.0), (5.0, 5.0), (9.0, 7.0), (20.0, 30.0)]
    usable = _usable_intervals(raw)
    assert usable == [(1_000_000.0, 1_000_010.0), (20.0, 30.0)]
    assert _union_length(usable) == 20.0


def test_union_of_overlapping_intervals_counts_each_instant_once():
    assert _union_length([(0.5, 3.0), (1.0, 2.0), (2.5, 4.0), (10.0, 11.0)]) == 4.5


class _Clock:
    """perf_counter stand-in: time moves only when a timed step spends some."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_sample_is_the_mean_milliseconds_per_call(monkeypatch):
    import time

    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    costs = {"fast": 0.002, "slow": 0.005}
    steps = {n: (lambda c=c: setattr(clock, "now", clock.now + c)) for n, c in costs.items()}
    samples = interleaved_samples_ms(steps, iters=4, warmup=1, repeats=3, synchronize=lambda: None)
    assert samples["fast"] == pytest.approx([2.0] * 3)
    assert samples["slow"] == pytest.approx([5.0] * 3)


def test_the_defaults_are_ten_warmups_and_five_rounds_of_fifty():
    from cudagraphs.timing import interleaved_step_times_ms

    calls = []
    samples = interleaved_samples_ms({"a": lambda: calls.append(1)}, synchronize=lambda: None)
    assert len(samples["a"]) == 5 and len(calls) == 10 + 5 * 50
    calls.clear()
    interleaved_step_times_ms({"a": lambda: calls.append(1)}, synchronize=lambda: None)
    assert len(calls) == 10 + 5 * 50


def test_summarize_rounds_to_four_digits_by_default():
    assert summarize([1.234567, 2.345678]) == {
        "median": 1.7901,
        "min": 1.2346,
        "max": 2.3457,
        "rounds": 2,
    }


def test_only_an_interval_starting_at_zero_is_dropped():
    assert _usable_intervals([(0.5, 2.0), (0.0, 2.0)]) == [(0.5, 2.0)]


class _Event:
    def __init__(self, start, end, device_type, name="k"):
        self.time_range = type("Range", (), {"start": start, "end": end})()
        self.device_type = device_type
        self.name = name


class _Profile:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_profile_activity_counts_usable_launches_and_their_union_per_step():
    import torch

    from cudagraphs.timing import KernelActivity, profile_activity, profile_busy_ms

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    prof = _Profile(
        [
            _Event(1000.0, 1500.0, cuda, "gemm"),
            _Event(1400.0, 2000.0, cuda, "adam"),  # overlaps: busy once, two launches
            _Event(3000.0, 3100.0, cuda, "gemm"),
            _Event(0.0, 9000.0, cuda, "gemm"),  # no recorded start: not busy, no launch
            _Event(100.0, 5000.0, cpu, "host"),  # host activity
        ]
    )
    assert profile_activity(prof, steps=2) == KernelActivity(
        busy_ms=0.55,
        launches=1.5,
        heaviest=(("adam", 0.3, 0.5), ("gemm", 0.3, 1.0)),  # a tie: by name
    )
    assert profile_busy_ms(prof) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="steps >= 1"):
        profile_activity(prof, steps=0)


@given(
    st.lists(
        st.tuples(st.floats(0.0, 1e6), st.floats(0.0, 1e4), st.sampled_from("abcdefghijk")),
        max_size=40,
    ),
    st.integers(1, 4),
)
def test_the_heaviest_kernels_are_the_longest_names_summed_over_usable_launches(evts, steps):
    import torch

    from cudagraphs.timing import HEAVIEST_KERNELS, profile_activity

    cuda = torch.autograd.DeviceType.CUDA
    prof = _Profile([_Event(a, a + d, cuda, n) for a, d, n in evts])
    want: dict[str, list[float]] = {}
    for a, d, n in evts:  # the reference: a plain sum per name of what is usable
        if a > 0 and d > 0 and a + d > a:
            want.setdefault(n, [0.0, 0])
            want[n][0] += (a + d) - a
            want[n][1] += 1
    ranked = sorted(want, key=lambda n: (-want[n][0], n))[:HEAVIEST_KERNELS]
    got = profile_activity(prof, steps=steps).heaviest
    assert [name for name, _, _ in got] == ranked
    for name, ms, launches in got:
        assert ms == pytest.approx(want[name][0] / 1e3 / steps)
        assert launches == want[name][1] / steps


def test_kernel_busy_is_the_activity_busy_time(monkeypatch):
    import cudagraphs.timing as timing

    seen = {}

    def fake(step, *, iters, warmup):
        seen.update(iters=iters, warmup=warmup)
        return timing.KernelActivity(0.75, 300.0)

    monkeypatch.setattr(timing, "kernel_activity", fake)
    assert timing.kernel_busy_ms(lambda: None, iters=7, warmup=2) == 0.75
    assert seen == {"iters": 7, "warmup": 2}
