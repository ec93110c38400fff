"""Owned outputs, on the CPU: a forward replay hands out its static outputs, and the
next replay that could overwrite one moves out what is still referenced
(``EntryGraphs.owned_outputs``; partial graphs' ``"model"`` scope hands its logits and
loss out this way).

The contract under test: an output the caller keeps is never changed by a later
replay, as with a copy per replay. What it costs is the point: nothing when the caller
drops its outputs before the next step (``loss = model(...).loss``), one copy when it
keeps them.

The stand-in graphs write what a captured graph would, into the same static buffers,
through the graph's own tensor objects.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudagraphs
from cudagraphs.core import deferred_grads, runtime
from cudagraphs.core.capture_phase import check_entry_indices
from cudagraphs.core.graphed import GraphedCallable
from cudagraphs.core.lent_grads import LentGrads
from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError, KeptOutputViewError
from helpers.stand_in_graphs import OpNames, ScaleBackward, ScaleForward, positional_entry


@pytest.fixture(params=["exchange", "repoint"])
def exchange(request, monkeypatch):
    """Both ways a move can go: exchanging storage memory (torch 2.13), or pointing
    each tensor handed out at the copy (torch 2.11; these outputs of 12 bytes are
    handed out there too, as outputs of SMALL_OUTPUT_BYTES and more are)."""
    on = request.param == "exchange"
    monkeypatch.setattr(deferred_grads, "can_move_storages", lambda: on)
    monkeypatch.setattr(runtime, "SMALL_OUTPUT_BYTES", 0)
    return on


def _owned(lent=None, *, fwd_seq=1, defer=True, w=(1.0, 2.0, 3.0), name="scale", scratch=None):
    """An entry ``w * x`` with owned outputs, forward-only (x needs no gradient)."""
    w = torch.tensor(w)
    x, out = torch.zeros(3), torch.zeros(3)
    graphs = positional_entry(
        f"callables[0] ({name})",
        x,
        out,
        ScaleForward(w, x, out, scratch),
        lent=LentGrads() if lent is None else lent,
        defer_copies=defer,
        owned_outputs=True,
        fwd_seq=fwd_seq,
    )
    return GraphedCallable(graphs, eager=lambda t: w * t, module=None, captured_training=None), w


def _x(k: float) -> torch.Tensor:
    return torch.full((3,), float(k))


def test_dropped_outputs_are_the_static_buffer_and_cost_nothing():
    fn, w = _owned()
    static = fn.graphs.out_leaves[0]
    for k in range(1, 4):
        with OpNames() as ops:
            y = fn(_x(k))
        assert fn.graphs.outputs_deferred
        assert y.data_ptr() == static.data_ptr(), "handed out as the static output"
        assert y.tolist() == (w * k).tolist()
        assert "clone" not in ops.names and "_foreach_copy_" not in ops.names
        del y
    assert fn.graphs.lent.deferred.moves == 0


def test_a_kept_output_keeps_its_values_and_the_graph_its_address(exchange):
    fn, w = _owned()
    ptr = fn.graphs.out_leaves[0].data_ptr()
    kept = [fn(_x(k)) for k in range(1, 5)]  # each kept past the next replay
    assert [t.tolist() for t in kept] == [(w * k).tolist() for k in range(1, 5)]
    assert fn.graphs.out_leaves[0].data_ptr() == ptr, "the graph keeps its memory"
    assert kept[-1].data_ptr() == ptr, "the last one is still the static output"
    assert len({t.untyped_storage().data_ptr() for t in kept}) == 4
    assert fn.graphs.lent.deferred.moves == 3


def test_a_kept_output_that_keeps_autograd_history_moves_too(exchange):
    # The training path: the output of the autograd node, kept past the next replay
    # (a loss logged after the next step, say), and its backward still runs.
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    x, out, grad_out, grad_w = torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3)
    graphs = positional_entry(
        "callables[0] (scale)",
        x,
        out,
        ScaleForward(w, x, out),
        params=(w,),
        bwd_graph=ScaleBackward(x, grad_out, grad_w),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        static_grad_inputs=(grad_w,),
        clone_param_grads=False,
        lent=LentGrads(),
        defer_copies=True,
        owned_outputs=True,
        fwd_seq=1,
        bwd_seq=2,
    )
    fn = GraphedCallable(graphs, eager=lambda t: w * t, module=None, captured_training=None)
    y1 = fn(_x(1))
    assert y1.grad_fn is not None and y1.data_ptr() == out.data_ptr()
    y1.sum().backward()
    assert w.grad.tolist() == [1.0, 1.0, 1.0]
    w.grad = None
    y2 = fn(_x(2))  # y1 still referenced: moved out first
    assert y1.tolist() == [1.0, 2.0, 3.0] and y2.tolist() == [2.0, 4.0, 6.0]
    assert y1.data_ptr() != out.data_ptr() and y2.data_ptr() == out.data_ptr()
    y2.sum().backward()
    assert w.grad.tolist() == [2.0, 2.0, 2.0]


def test_without_deferral_outputs_are_copied_at_every_replay():
    fn, w = _owned(defer=False)
    static = fn.graphs.out_leaves[0]
    with OpNames() as ops:
        y1 = fn(_x(1))
    y2 = fn(_x(2))
    assert not fn.graphs.outputs_deferred
    assert "clone" in ops.names
    assert y1.data_ptr() != static.data_ptr() and y2.data_ptr() != static.data_ptr()
    assert y1.tolist() == (w * 1).tolist() and y2.tolist() == (w * 2).tolist()
    assert fn.graphs.lent.deferred.moves == 0


def test_an_output_something_else_refers_to_at_the_first_replay_is_copied():
    fn, w = _owned()
    other = fn.graphs.out_leaves[0].detach()  # not the graph's: the count cannot tell
    y = fn(_x(2))
    assert not fn.graphs.outputs_deferred
    assert y.data_ptr() != other.data_ptr() and y.tolist() == (w * 2).tolist()


def test_not_owned_outputs_are_the_static_buffer_as_before():
    w = torch.tensor([1.0, 2.0, 3.0])
    x, out = torch.zeros(3), torch.zeros(3)
    graphs = positional_entry("f", x, out, ScaleForward(w, x, out), lent=LentGrads())
    fn = GraphedCallable(graphs, eager=lambda t: w * t, module=None, captured_training=None)
    y1 = fn(_x(1))
    fn(_x(2))
    assert y1.data_ptr() == out.data_ptr() and y1.tolist() == (w * 2).tolist(), "overwritten"
    assert not graphs.outputs_deferred


def test_a_view_kept_without_the_exchange_refuses_the_replay_then_copies(monkeypatch):
    monkeypatch.setattr(deferred_grads, "can_move_storages", lambda: False)
    monkeypatch.setattr(runtime, "SMALL_OUTPUT_BYTES", 0)
    fn, w = _owned()
    static = fn.graphs.out_leaves[0]
    view = fn(_x(1))[1:]  # the output itself dies; a view of it is kept
    with pytest.raises(KeptOutputViewError, match=r"outputs of callables\[0\] \(scale\)"):
        fn(_x(2))
    assert view.tolist() == [2.0, 3.0], "the refused replay did not run"
    assert not fn.graphs.outputs_deferred, "copied from now on"
    detached = view.detach()
    del view
    with pytest.raises(KeptOutputViewError, match=r"\.detach\(\)"):
        fn(_x(3))  # still kept: still refused
    assert detached.tolist() == [2.0, 3.0]
    del detached
    y = fn(_x(4))
    assert y.tolist() == (w * 4).tolist(), "the next good call works"
    assert y.data_ptr() != static.data_ptr(), "a copy"
    kept = y[1:]
    assert fn(_x(5)).tolist() == (w * 5).tolist() and kept.tolist() == [8.0, 12.0]
    assert not fn.graphs.lent.deferred.held


def test_small_outputs_are_copied_without_the_exchange_and_large_ones_handed_out(monkeypatch):
    # A loss kept as a .detach() (transformers.Trainer's way) is out of reach there:
    # a copy of so few bytes costs nothing.
    monkeypatch.setattr(deferred_grads, "can_move_storages", lambda: False)
    n = runtime.SMALL_OUTPUT_BYTES // 4
    small, _ = _owned(w=(1.0, 2.0, 3.0))
    w = torch.ones(n)
    x, out = torch.zeros(n), torch.zeros(n)
    big = GraphedCallable(
        positional_entry(
            "big",
            x,
            out,
            ScaleForward(w, x, out),
            lent=LentGrads(),
            defer_copies=True,
            owned_outputs=True,
            fwd_seq=1,
        ),
        eager=lambda t: w * t,
        module=None,
        captured_training=None,
    )
    kept_small = small(_x(1)).detach()
    assert not small.graphs.outputs_deferred
    assert small(_x(2)).tolist() == [2.0, 4.0, 6.0] and kept_small.tolist() == [1.0, 2.0, 3.0]
    y = big(torch.full((n,), 2.0))
    assert big.graphs.outputs_deferred and y.data_ptr() == out.data_ptr()


def test_a_view_kept_with_the_exchange_moves_with_its_output(monkeypatch):
    monkeypatch.setattr(deferred_grads, "can_move_storages", lambda: True)
    fn, w = _owned()
    view = fn(_x(1))[1:].detach()
    fn(_x(2))
    assert view.tolist() == [2.0, 3.0]
    assert fn.graphs.lent.deferred.moves == 1


def test_a_graph_captured_earlier_moves_what_a_later_one_handed_out(exchange):
    # B's outputs sit in memory A's forward (captured first) uses for temporaries.
    lent = LentGrads()
    b, wb = _owned(lent, fwd_seq=2, w=(4.0, 5.0, 6.0), name="b")
    a, wa = _owned(lent, fwd_seq=1, name="a", scratch=b.graphs.out_leaves[0])
    yb = b(_x(1))
    ya = a(_x(1))  # scribbles over B's static output: yb moved out first
    assert yb.tolist() == [4.0, 5.0, 6.0] and ya.tolist() == [1.0, 2.0, 3.0]
    assert lent.deferred.moves == 1


def test_a_graph_captured_later_moves_nothing_of_an_earlier_one():
    lent = LentGrads()
    a, _ = _owned(lent, fwd_seq=1, name="a")
    b, _ = _owned(lent, fwd_seq=2, w=(4.0, 5.0, 6.0), name="b")
    ya = a(_x(1))
    yb = b(_x(1))
    assert ya.data_ptr() == a.graphs.out_leaves[0].data_ptr()
    assert yb.data_ptr() == b.graphs.out_leaves[0].data_ptr()
    assert lent.deferred.moves == 0


def test_release_moves_out_a_kept_output(exchange):
    fn, _ = _owned()
    kept = fn(_x(3))
    registry = fn.graphs.lent.deferred
    fn.graphs.release()
    assert kept.tolist() == [3.0, 6.0, 9.0]
    assert not registry.held and registry.moves == 1


def test_the_owned_grads_switch_turns_output_deferral_off(monkeypatch):
    # The same switch as owned gradients: make_graphed_callables reads it into
    # defer_copies, which output deferral follows.
    monkeypatch.setenv("CUDAGRAPHS_OWNED_GRADS", "copy")
    assert deferred_grads.defers_owned_copies() is False
    fn, _ = _owned(defer=deferred_grads.defers_owned_copies())
    fn(_x(1))
    assert not fn.graphs.outputs_deferred


_CALLS = st.lists(
    st.tuples(st.sampled_from(["call", "keep", "keep_view", "drop_all"]), st.integers(1, 9)),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=_CALLS, scribble=st.booleans())
def test_random_calls_keep_every_kept_output_like_copies(calls, scribble, exchange):
    """The reference is a copy per replay: every output (or view of one) kept holds
    ``w * x`` of its call forever. Without the exchange a kept view is out of reach:
    the next replay refuses, runs once the views are dropped, and copies from then on
    (so later views are of copies)."""
    lent = LentGrads()
    later, _ = _owned(lent, fwd_seq=2, w=(4.0, 5.0, 6.0), name="later")
    fn, w = _owned(lent, fwd_seq=1, scratch=later.graphs.out_leaves[0] if scribble else None)
    kept: list[tuple[torch.Tensor, list[float], bool]] = []  # tensor, values, on static
    for op, k in calls:
        views = [e for e in kept if e[2]]
        if views and not exchange:
            with pytest.raises(KeptOutputViewError):
                fn(_x(k))
            kept = [e for e in kept if not e[2]]  # the fix: drop the views
        del views
        y = fn(_x(k))
        copying = not exchange and not fn.graphs.outputs_deferred
        expect = (w * k).tolist()
        assert y.tolist() == expect
        if op == "keep":
            kept.append((y, expect, False))
        elif op == "keep_view":
            kept.append((y[1:], expect[1:], not copying))
        elif op == "drop_all":
            kept = []
        if scribble:
            later_out = later(_x(k))
            kept.append((later_out, [4.0 * k, 5.0 * k, 6.0 * k], False))
        del y
        _check_kept(kept, (op, k))


def _check_kept(kept: list, where) -> None:
    """Every kept tensor holds its values (a function: a loop variable left in the
    test would be one more reference to a kept tensor)."""
    for t, values, _ in kept:
        assert t.tolist() == values, where


def test_owned_output_indices_are_checked():
    assert check_entry_indices([0, 2], 3, "_owned_outputs") == frozenset({0, 2})
    with pytest.raises(CudaGraphsTypeError, match="collection of entry indices, got int$"):
        check_entry_indices(3, 3, "_owned_outputs")
    with pytest.raises(CudaGraphsTypeError, match="'a' is not an int"):
        check_entry_indices(["a"], 3, "_owned_outputs")
    with pytest.raises(CudaGraphsTypeError, match="True is not an int"):
        check_entry_indices([True], 3, "_owned_outputs")
    with pytest.raises(CudaGraphsValueError, match=r"entry 3 is out of range \(there are 3"):
        check_entry_indices([3], 3, "_owned_outputs")


def test_the_error_is_exported_and_a_state_error():
    assert cudagraphs.KeptOutputViewError is KeptOutputViewError
    assert issubclass(KeptOutputViewError, cudagraphs.CudaGraphsStateError)


def test_a_real_capture_owns_the_outputs_of_the_entries_asked_for(monkeypatch):
    # The capture phase as written (graphs stood in by eager runs): only the entries
    # named own their outputs, and their first replay holds the output storages.
    from cudagraphs.core.canonicalize import canonicalize
    from cudagraphs.core.capture_phase import capture_plan, eager_entry_graphs
    from cudagraphs.core.warmup import run_warmup
    from helpers.stand_in_capture import StandInCapture, cpu_options

    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    sample = (torch.randn(4, 8, requires_grad=True),)
    plan = canonicalize((a, b), (sample, sample))
    run_warmup(plan, 1, allow_unused_input=False)
    StandInCapture().install(monkeypatch)
    first, second = capture_plan(
        plan, cpu_options(defer_owned_copies=True, owned_outputs=frozenset({1}))
    )
    assert (first.owned_outputs, second.owned_outputs) == (False, True)
    monkeypatch.setattr(runtime, "SMALL_OUTPUT_BYTES", 0)
    second.fwd_graph = types.SimpleNamespace(replay=lambda: None, reset=lambda: None)
    fn = GraphedCallable(second, eager=b, module=b, captured_training=True)
    y = fn(torch.randn(4, 8, requires_grad=True))
    assert second.outputs_deferred and y.data_ptr() == second.out_leaves[0].data_ptr()
    for entry in (eager_entry_graphs(plan, 0), eager_entry_graphs(plan, 1)):
        assert not entry.owned_outputs and not entry.defer_copies, "nothing to hold eagerly"


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(st.integers(-3, 8), max_size=6), n=st.integers(0, 6))
def test_owned_output_indices_are_the_set_given_when_every_one_is_in_range(entries, n):
    if all(0 <= e < n for e in entries):
        assert check_entry_indices(entries, n, "_owned_outputs") == set(entries)
        assert check_entry_indices(tuple(entries), n, "_owned_outputs") == set(entries)
    else:
        first = next(e for e in entries if not 0 <= e < n)
        with pytest.raises(CudaGraphsValueError, match=f"entry {first} is out of range"):
            check_entry_indices(entries, n, "_owned_outputs")
