"""Owned gradients with deferred copies, on the CPU: the default hand-out when the pool
is the call's own (``cudagraphs.core.deferred_grads``).

The stand-in graphs write what a captured graph would, into the same static buffers,
through the graph's own tensor objects: after a move those point at the graph memory
again, as a real graph's recorded addresses do.

The contract under test is the owned one (Transformer Engine 2.20's): a gradient that
``.grad``, a hook or any tensor keeps is never changed by a later replay. What it
costs is the point: a copy only when something still refers to a gradient buffer at a
replay that could overwrite it, so ``zero_grad(set_to_none=True)`` loops copy nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraphs.core import deferred_grads
from cudagraphs.core.deferred_grads import (
    DeferredCopies,
    DeferredCopyStats,
    held_storages,
    move_out,
)
from cudagraphs.core.graphed import GraphedCallable
from cudagraphs.core.lent_grads import LentGrads
from cudagraphs.errors import KeptGradientViewError
from cudagraphs.settings import OWNED_GRADS_ENV
from helpers.stand_in_graphs import OpNames, ScaleBackward, ScaleForward, positional_entry

_COPIES = ("clone", "_foreach_mul", "_foreach_copy_", "copy_")


class _Ops(OpNames):
    def copies(self) -> list[str]:
        return [n for n in self.names if n in _COPIES]


_Forward = ScaleForward
_Backward = ScaleBackward


@pytest.fixture(params=["exchange", "repoint"])
def exchange(request, monkeypatch):
    """Both ways a move can go: exchanging storage memory (torch 2.13), or pointing
    each tensor handed out at the copy (torch 2.11, which lacks the exchange)."""
    on = request.param == "exchange"
    monkeypatch.setattr(deferred_grads, "can_move_storages", lambda: on)
    return on


def _entry(w, lent, *, fwd_seq, bwd_seq, scratch_of=None, name="scale", defer=True):
    x = torch.zeros(3)
    out, grad_out, grad_w = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    graphs = positional_entry(
        f"callables[0] ({name})",
        x,
        out,
        _Forward(w, x, out, scratch_of),
        params=(w,),
        bwd_graph=_Backward(x, grad_out, grad_w),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        static_grad_inputs=(grad_w,),
        clone_param_grads=True,
        lent=lent,
        defer_copies=defer,
        fwd_seq=fwd_seq,
        bwd_seq=bwd_seq,
    )
    return GraphedCallable(graphs, eager=lambda t: w * t, module=None, captured_training=None)


def _graphed(forward_overwrites_grad=False, defer=True):
    """One entry: forward captured first (1), backward second (2). With
    ``forward_overwrites_grad`` the forward's temporaries sit where the gradient
    buffer is, as a graph captured before the buffer may."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    fn = _entry(w, LentGrads(), fwd_seq=1, bwd_seq=2, defer=defer)
    if forward_overwrites_grad:
        fn.graphs.fwd_graph.scratch = fn.graphs.static_grad_inputs[0]
    return fn, w


def _step(fn, x):
    fn(x).sum().backward()


def test_set_to_none_steps_hand_out_the_buffer_and_copy_nothing():
    fn, w = _graphed()
    buffer = fn.graphs.static_grad_inputs[0]
    ptr = buffer.data_ptr()
    for k in range(3):
        x = torch.full((3,), float(k + 1))
        with _Ops() as ops:
            _step(fn, x)
        assert not {"_foreach_mul", "_foreach_copy_", "clone"} & set(ops.names), f"step {k}"
        assert w.grad.data_ptr() == ptr and w.grad.tolist() == x.tolist()
        w.grad = None
    assert fn.graphs.lent.deferred.moves == 0
    assert buffer.data_ptr() == ptr


def test_a_hook_kept_gradient_survives_later_replays(exchange):
    # Transformer Engine's test of clone_param_grads_on_return=True: a weight hook
    # keeps what it receives; later replays change neither its values nor its storage.
    fn, w = _graphed(forward_overwrites_grad=True)
    ptr = fn.graphs.static_grad_inputs[0].data_ptr()
    kept = []
    w.register_hook(lambda g: kept.append(g))
    xs = [torch.full((3,), float(k + 1)) for k in range(4)]
    for x in xs:
        _step(fn, x)
        w.grad = None
    fn(torch.full((3,), 9.0))  # one more forward: scribbles over the buffer
    assert [g.tolist() for g in kept] == [x.tolist() for x in xs]
    assert len({g.untyped_storage().data_ptr() for g in kept}) == 4, "one storage per step"
    assert ptr not in {g.data_ptr() for g in kept}, "each was moved off the graph memory"
    assert fn.graphs.static_grad_inputs[0].data_ptr() == ptr, "the graph keeps its address"


def test_a_kept_view_of_grad_keeps_its_values(exchange):
    fn, w = _graphed(forward_overwrites_grad=True)
    _step(fn, torch.tensor([4.0, 5.0, 6.0]))
    tail = w.grad[1:]  # a view: no .grad left to move, the storage is what is kept
    w.grad = None
    if not exchange:
        # No call re-points a view: refused before the forward would overwrite it.
        with pytest.raises(KeptGradientViewError, match="callables.0. .scale.") as err:
            _step(fn, torch.ones(3))
        assert "CUDAGRAPHS_OWNED_GRADS=copy" in str(err.value)
        assert tail.tolist() == [5.0, 6.0], "nothing replayed"
        tail = tail.clone()  # the fix the error names; the next call works
    _step(fn, torch.ones(3))
    assert tail.tolist() == [5.0, 6.0]
    assert w.grad.tolist() == [1.0, 1.0, 1.0]


def test_accumulation_moves_the_grad_once_and_sums_exactly(exchange):
    fn, w = _graphed()
    ptr = fn.graphs.static_grad_inputs[0].data_ptr()
    xs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0]), torch.ones(3)]
    _step(fn, xs[0])
    with _Ops() as ops:
        _step(fn, xs[1])  # .grad is the buffer: moved before the forward replays
    assert ops.names.count("_foreach_copy_") == 1
    assert w.grad.data_ptr() != ptr
    with _Ops() as ops:
        _step(fn, xs[2])  # .grad is its own now: nothing to move
    assert "_foreach_copy_" not in ops.names
    assert w.grad.tolist() == (xs[0] + xs[1] + xs[2]).tolist()
    assert fn.graphs.lent.deferred.moves == 1
    assert fn.graphs.lent.deferred.moved_bytes == 3 * 4
    assert fn.deferred_copies == DeferredCopyStats(deferred=True, moves=1, moved_bytes=12)


def test_zeroing_in_place_keeps_the_sum_right(exchange):
    fn, w = _graphed(forward_overwrites_grad=True)
    _step(fn, torch.ones(3))
    w.grad.zero_()  # zero_grad(set_to_none=False): .grad is still the buffer
    _step(fn, torch.full((3,), 2.0))
    _step(fn, torch.full((3,), 3.0))
    assert w.grad.tolist() == [5.0, 5.0, 5.0]


def test_autograd_grad_returns_owned_copies():
    fn, w = _graphed()
    buffer = fn.graphs.static_grad_inputs[0]
    (g1,) = torch.autograd.grad(fn(torch.ones(3)).sum(), (w,))
    (g2,) = torch.autograd.grad(fn(torch.full((3,), 7.0)).sum(), (w,))
    assert g1.data_ptr() != buffer.data_ptr() and g2.data_ptr() != buffer.data_ptr()
    assert g1.tolist() == [1.0, 1.0, 1.0] and g2.tolist() == [7.0, 7.0, 7.0]
    assert not fn.graphs.lent.deferred.held


def test_copies_at_every_replay_without_deferral():
    fn, w = _graphed(defer=False)
    assert fn.deferred_copies == DeferredCopyStats(deferred=False, moves=0, moved_bytes=0)
    buffer = fn.graphs.static_grad_inputs[0]
    with _Ops() as ops:
        _step(fn, torch.ones(3))
    assert "_foreach_mul" in ops.names and w.grad.data_ptr() != buffer.data_ptr()


def test_a_buffer_something_else_refers_to_is_copied_at_every_replay():
    # The use count could not tell a keeper from that reference: no deferral.
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    lent = LentGrads()
    grad_w = torch.zeros(3)
    other = grad_w.view(3)  # noqa: F841  (kept alive on purpose)
    x, out, grad_out = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    graphs = positional_entry(
        "callables[0] (scale)",
        x,
        out,
        _Forward(w, x, out),
        params=(w,),
        bwd_graph=_Backward(x, grad_out, grad_w),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        static_grad_inputs=(grad_w,),
        lent=lent,
        defer_copies=True,
        bwd_seq=2,
    )
    fn = GraphedCallable(graphs, eager=lambda t: w * t, module=None, captured_training=None)
    _step(fn, torch.ones(3))
    assert w.grad.data_ptr() != grad_w.data_ptr() and not lent.deferred.held


def _two_entries(scribbles: bool):
    """Two entries in one pool, captured as make_graphed_callables does: forward A (1),
    forward B (2), backward B (3), backward A (4). With ``scribbles`` backward B's
    temporaries sit where backward A's gradient buffer is: B was captured first."""
    wa = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    wb = torch.nn.Parameter(torch.tensor([4.0, 5.0, 6.0]))
    lent = LentGrads()
    a = _entry(wa, lent, fwd_seq=1, bwd_seq=4, name="a")
    b = _entry(wb, lent, fwd_seq=2, bwd_seq=3, name="b")
    if scribbles:
        buffer_a = a.graphs.static_grad_inputs[0]
        bwd_b = b.graphs.bwd_graph
        plain = bwd_b.replay

        def replay():
            buffer_a.fill_(-1234.0)
            plain()

        bwd_b.replay = replay
    return a, b, wa, wb, lent


def test_the_usual_order_moves_nothing_within_a_step():
    a, b, wa, wb, lent = _two_entries(scribbles=True)
    for k in range(3):
        x = torch.full((3,), float(k + 1))
        with _Ops() as ops:
            (a(x).sum() + b(x).sum()).backward()  # backward B, then backward A
        assert "_foreach_copy_" not in ops.names, f"step {k}"
        assert wa.grad.tolist() == x.tolist() and wb.grad.tolist() == x.tolist()
        wa.grad = wb.grad = None
    assert lent.deferred.moves == 0


def test_a_graph_captured_earlier_moves_what_a_later_one_handed_out(exchange):
    # An order a step of one stack never has: backward A hands out its gradient,
    # then backward B (captured before A's buffer existed) replays.
    a, b, wa, wb, lent = _two_entries(scribbles=True)
    ya, yb = a(torch.ones(3)), b(torch.full((3,), 2.0))
    ya.sum().backward()
    kept_a = wa.grad
    yb.sum().backward()  # may write over A's buffer: A's .grad moves first
    assert kept_a.tolist() == [1.0, 1.0, 1.0] and wa.grad is kept_a
    assert wb.grad.tolist() == [2.0, 2.0, 2.0]
    assert lent.deferred.moves == 1


def test_release_moves_out_what_is_kept_and_forgets_it(exchange):
    fn, w = _graphed()
    _step(fn, torch.tensor([1.0, 2.0, 3.0]))
    kept = w.grad
    registry = fn.graphs.lent.deferred
    fn.graphs.release()
    assert kept.tolist() == [1.0, 2.0, 3.0]
    assert not registry.held and registry.moves == 1


def test_the_switch_and_torch_decide_deferral(monkeypatch):
    monkeypatch.delenv(OWNED_GRADS_ENV, raising=False)
    assert deferred_grads.defers_owned_copies() is True, "deferral is the default"
    monkeypatch.setenv(OWNED_GRADS_ENV, "copy")
    assert deferred_grads.defers_owned_copies() is False
    monkeypatch.setenv(OWNED_GRADS_ENV, " Defer ")
    assert deferred_grads.defers_owned_copies() is True
    monkeypatch.setattr(deferred_grads, "can_move_storages", lambda: False)
    assert deferred_grads.defers_owned_copies() is True, "moves without the exchange"
    monkeypatch.setattr(deferred_grads, "can_count_storage_uses", lambda: False)
    assert deferred_grads.defers_owned_copies() is False


# ---- move_out on its own ---------------------------------------------------------------


def test_move_out_leaves_the_keepers_a_copy_and_the_graph_its_memory():
    buffer = torch.arange(6.0)
    ptr = buffer.data_ptr()
    (held,) = held_storages([buffer], seq=1)
    kept = buffer.detach()[2:]
    assert move_out([held], exchange=True) == (1, 24)
    buffer.fill_(-1.0)  # the next replay
    assert kept.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert buffer.data_ptr() == ptr and kept.data_ptr() != ptr + 8
    assert move_out([held], exchange=True) == (0, 0), "nothing refers to it now"


def test_move_out_without_the_exchange_repoints_what_was_handed_out():
    buffer = torch.arange(6.0)
    ptr = buffer.data_ptr()
    (held,) = held_storages([buffer], seq=1)
    handed = buffer.detach()
    held.hand(handed)
    alias = handed  # another name of the same tensor follows it
    assert move_out([held], exchange=False) == (1, 24)
    buffer.fill_(-1.0)
    assert alias.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and handed.data_ptr() != ptr
    assert buffer.data_ptr() == ptr and not held.handed
    view = buffer.detach()[1:]  # not handed out: a view no call can re-point
    with pytest.raises(KeptGradientViewError, match=r"\(storage at 0x[0-9a-f]+\)"):
        move_out([held], exchange=False)
    del view
    assert move_out([held], exchange=False) == (0, 0)


def test_held_storages_group_tensors_of_one_storage_and_skip_empty_ones():
    storage = torch.zeros(10).untyped_storage()
    a = torch.empty(0).set_(storage, 0, (4,), (1,))
    b = torch.empty(0).set_(storage, 4, (6,), (1,))
    del storage
    empty = torch.zeros(0)
    (held,) = held_storages([a, b, empty], seq=3)
    assert held.tensors == (a, b) and held.seq == 3 and held.nbytes == 40
    kept = b.detach()
    move_out([held], exchange=True)
    a.fill_(7.0)
    b.fill_(8.0)
    assert kept.tolist() == [0.0] * 6
    assert a.data_ptr() + 16 == b.data_ptr(), "the graph's views stay one storage"


def test_views_count_their_base_as_the_graphs_and_move_it_along(exchange):
    # Autograd hands out many gradients as views (a transposed mm, a reshaped sum);
    # each holds its base tensor, another of the graph's own on the storage.
    flat = torch.zeros(10)
    a, b = flat[:4], flat[4:]
    del flat
    (held,) = held_storages([a, b], seq=1)
    assert len(held.tensors) == 3 and not held.referenced_elsewhere()
    handed = b.detach()
    held.hand(handed)
    move_out([held], exchange=exchange)
    b.fill_(5.0)
    assert handed.tolist() == [0.0] * 6
    assert not held.referenced_elsewhere(), "the base moved with the views"
    assert a.data_ptr() + 16 == b.data_ptr()


def test_something_else_on_the_storage_at_capture_means_no_deferral():
    flat = torch.zeros(10)
    a = flat[:4]
    other = flat.view(10)  # noqa: F841  (another tensor on it, alive)
    assert held_storages([a], seq=1) is None


def test_settle_moves_only_what_later_captures_handed_out():
    registry = DeferredCopies()
    bufs = [torch.zeros(2) for _ in range(3)]
    held = [held_storages([t], seq=s)[0] for t, s in zip(bufs, (2, 5, 9))]
    keepers = [t.detach() for t in bufs]  # noqa: F841  (all still referenced)
    registry.hold(held)
    registry.settle(5)
    assert registry.moves == 1 and set(registry.held) == {id(held[0]), id(held[1])}
    registry.settle(0)
    assert registry.moves == 3 and not registry.held


# ---- against a reference: random loops keep every gradient they keep ------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["step", "keep_grad", "keep_hook", "zero", "none", "forward"]),
        st.integers(1, 9),
    ),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS, scribble=st.booleans())
def test_random_loops_keep_every_kept_gradient_like_eager(ops, scribble, exchange):
    """The reference is the plain rule of eager autograd: a backward of ``sum(w * x)``
    adds ``x`` into ``.grad`` (or makes it ``x``), and what anyone kept never changes.
    Without the exchange, a ``.grad`` kept past ``.grad = None`` while it was still
    the buffer is out of reach: the next replay refuses, and runs once it is dropped."""
    fn, w = _graphed(forward_overwrites_grad=scribble)
    hooked: list[torch.Tensor] = []
    keep_hook = [False]
    w.register_hook(lambda g: hooked.append(g) if keep_hook[0] else None)
    kept: list[list] = []  # [tensor, its values once it no longer is .grad, orphan]
    grad: list[float] | None = None  # the reference .grad
    on_buffer = False  # the reference: .grad still is the graph's buffer
    for op, k in ops:
        x = [float(k), float(k + 1), float(k + 2)]
        if op in ("step", "keep_hook", "forward"):
            orphans = [e for e in kept if e[2]]
            if orphans and not exchange:
                try:
                    fn(torch.tensor(x))
                except KeptGradientViewError:
                    pass
                else:
                    raise AssertionError("a kept .grad out of reach was not refused")
                kept = [entry for entry in kept if not entry[2]]  # the fix: drop them
                del orphans
            else:
                for entry in orphans:
                    entry[2] = False  # moved off the buffer
                del orphans
            on_buffer = False
        if op in ("step", "keep_hook"):
            keep_hook[0] = op == "keep_hook"
            before = len(hooked)
            was_none = grad is None
            _step(fn, torch.tensor(x))
            if keep_hook[0]:
                kept.append([hooked[before], list(x), False])
            grad = x if grad is None else [g + v for g, v in zip(grad, x)]
            on_buffer = was_none and not keep_hook[0]
        elif op == "keep_grad" and grad is not None:
            kept.append([w.grad, list(grad), False])  # .grad itself: it changes as .grad
        elif op == "zero" and grad is not None:
            w.grad.zero_()
            grad = [0.0, 0.0, 0.0]
        elif op == "none":
            _drop_grad(kept, w.grad, grad, on_buffer)
            w.grad, grad = None, None
        elif op == "forward":
            fn(torch.tensor(x))  # a forward whose backward never runs
        assert (w.grad is None) == (grad is None)
        if grad is not None:
            assert w.grad.tolist() == grad
        _check_kept(kept, w.grad, (op, k))


def _check_kept(kept: list[list], grad: torch.Tensor | None, where) -> None:
    """Every kept tensor that no longer is ``.grad`` holds its values (a function: a
    loop variable left in the test would be one more reference to a kept tensor)."""
    for t, values, _ in kept:
        if t is not grad:
            assert t.tolist() == values, where


def _drop_grad(kept: list[list], grad: torch.Tensor, values: list[float], on_buffer: bool):
    """``.grad = None`` in the reference: a kept ``.grad`` holds its values from now
    on, and is out of reach (without the exchange) if it still was the buffer."""
    for entry in kept:
        if entry[0] is grad:
            entry[1] = list(values)
            entry[2] = on_buffer


@pytest.mark.parametrize("steps", [1, 3])
def test_a_fresh_pool_loop_never_copies_under_set_to_none(steps):
    fn, w = _graphed(forward_overwrites_grad=True)
    for k in range(steps):
        _step(fn, torch.full((3,), float(k + 1)))
        w.grad = None
        fn(torch.ones(3))  # the forward that overwrites the buffer memory
    assert fn.graphs.lent.deferred.moves == 0


def test_a_real_capture_defers_its_gradients_views_included(monkeypatch):
    # The capture phase as written (graphs stood in by eager runs): Linear gradients
    # come out of autograd as views (a transposed mm, a reshaped sum), each holding
    # its base; the storages must still be held, or deferral silently never engages.
    from cudagraphs.core.canonicalize import canonicalize
    from cudagraphs.core.capture_phase import capture_plan
    from cudagraphs.core.warmup import run_warmup
    from helpers.stand_in_capture import StandInCapture, cpu_options

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    plan = canonicalize((m,), ((torch.randn(4, 8, requires_grad=True),),))
    run_warmup(plan, 1, allow_unused_input=False)
    StandInCapture().install(monkeypatch)
    (entry,) = capture_plan(plan, cpu_options(defer_owned_copies=True))
    assert len(entry._held) == 4, "one held storage per parameter gradient"
    assert all(not h.referenced_elsewhere() for h in entry._held)
    assert {p for h in entry._held for p in h.params} == set(m.parameters())
    (plain,) = capture_plan(plan, cpu_options())
    assert plain._held == (), "copies at every replay unless asked to defer"


@settings(max_examples=200, deadline=None)
@given(
    script=st.lists(
        st.tuples(st.sampled_from(["hold", "settle", "own"]), st.integers(0, 6)),
        min_size=1,
        max_size=20,
    )
)
def test_settle_moves_exactly_what_a_later_capture_handed_out(script):
    """Against the rule written out: a replay of the graph captured ``s``-th moves
    every held storage numbered above ``s`` and nothing else; a backward's own check
    moves its own if held. Every storage here is kept, so each move is observable."""
    registry = DeferredCopies()
    bufs = [torch.zeros(1) for _ in range(7)]
    held = [held_storages([t], seq=s)[0] for s, t in enumerate(bufs)]
    keepers = [t.detach() for t in bufs]  # every storage is referenced
    expected_held: set[int] = set()
    expected_moves = 0
    for op, s in script:
        if op == "hold":
            registry.hold([held[s]])
            expected_held.add(s)
        elif op == "settle":
            later = {k for k in expected_held if k > s}
            registry.settle(s)
            expected_held -= later
            expected_moves += len(later)
        else:
            registry.settle_own([held[s]])
            if s in expected_held:
                expected_held.discard(s)
                expected_moves += 1
        assert {h.seq for h in registry.held.values()} == expected_held
        assert registry.top == max(expected_held, default=0)
        assert registry.moves == expected_moves, (op, s)
        keepers[:] = [h.tensors[0].detach() for h in held]  # the moved ones kept too


def test_a_move_keeps_dtype_layout_and_odd_byte_counts(exchange):
    # A transposed bfloat16 gradient of 30 bytes: the copy is byte for byte (not in
    # 4-byte words), and every tensor keeps its dtype, strides and offset.
    buffer = torch.arange(15, dtype=torch.bfloat16).reshape(3, 5).t()  # strides (1, 5)
    (held,) = held_storages([buffer], seq=1)
    handed = buffer.detach()
    held.hand(handed)
    want = handed.clone()
    move_out([held], exchange=exchange)
    buffer.fill_(-1.0)  # the next replay writes the graph memory
    assert handed.dtype == torch.bfloat16 and handed.stride() == (1, 5)
    assert torch.equal(handed, want)
    assert buffer.stride() == (1, 5) and buffer.dtype == torch.bfloat16
    assert buffer.untyped_storage().data_ptr() != handed.untyped_storage().data_ptr()


def test_the_error_names_every_storage_out_of_reach():
    bufs = [torch.zeros(2), torch.zeros(2)]
    held = [held_storages([t], seq=1, label=name)[0] for t, name in zip(bufs, "ab")]
    views = [t.detach()[1:] for t in bufs]  # noqa: F841  (kept: out of reach)
    with pytest.raises(KeptGradientViewError, match=r"\(a, b\)"):
        move_out(held, exchange=False)


def test_views_of_two_bases_on_one_storage_count_both():
    storage = torch.zeros(8).untyped_storage()
    first = torch.empty(0).set_(storage, 0, (4,), (1,))
    second = torch.empty(0).set_(storage, 4, (4,), (1,))
    del storage
    a, b = first[1:], second[1:]
    del first, second
    (held,) = held_storages([a, b], seq=1)
    assert len(held.tensors) == 4 and not held.referenced_elsewhere()


def test_a_one_byte_storage_is_held_and_an_empty_one_is_not():
    (held,) = held_storages([torch.zeros(1, dtype=torch.uint8), torch.zeros(0)], seq=1)
    assert held.nbytes == 1


def test_a_pool_numbers_its_captures_in_order(monkeypatch):
    from cudagraphs.core.canonicalize import canonicalize
    from cudagraphs.core.capture_phase import capture_plan
    from cudagraphs.core.lent_grads import lent_grads_of
    from cudagraphs.core.warmup import run_warmup
    from helpers.stand_in_capture import StandInCapture, cpu_options

    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    x = torch.randn(2, 4, requires_grad=True)
    plan = canonicalize(tuple(layers), ((x,), (x,)))
    run_warmup(plan, 1, allow_unused_input=False)
    StandInCapture().install(monkeypatch)
    opts = cpu_options(defer_owned_copies=True)
    first, second = capture_plan(plan, opts)
    # make_graphed_callables' order: the forwards, then the backwards in reverse.
    assert (first.fwd_seq, second.fwd_seq, second.bwd_seq, first.bwd_seq) == (1, 2, 3, 4)
    assert lent_grads_of(opts.pool).deferred.captures == 4
    assert all(h.seq == 4 for h in first._held) and all(h.seq == 3 for h in second._held)
