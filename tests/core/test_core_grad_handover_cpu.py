"""How the replay path hands parameter gradients to autograd, on the CPU: the graphs
are stand-ins that write what a captured backward would, into the same static
buffers, so the handover logic runs exactly as on the GPU.

The rules under test. By default (Transformer Engine 2.20's contract) every parameter
gradient leaves a backward replay as an owned copy, one fused launch per replay: what
a hook or ``.grad`` keeps survives later replays. In lent mode
(``clone_param_grads_on_return=False``) a gradient goes out as a view of its static
buffer (no copy), and a ``.grad`` that still is that buffer when the next replay that
could overwrite it comes is moved to an owned copy first. ``autograd.grad()`` gets
owned copies at once in both modes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from cudagraphs.core.graphed import GraphedCallable
from cudagraphs.core.lent_grads import LentGrads
from cudagraphs.core.runtime import EntryGraphs
from helpers.stand_in_graphs import OpNames, ScaleBackward, ScaleForward, positional_entry

_Ops = OpNames


_Forward = ScaleForward
_Backward = ScaleBackward


def _graphed(clone: bool = True, forward_overwrites_grad: bool = False):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.zeros(3)
    out, grad_out, grad_w = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    scratch = grad_w if forward_overwrites_grad else None
    graphs = positional_entry(
        "callables[0] (scale)",
        x,
        out,
        _Forward(w, x, out, scratch),
        params=(w,),
        bwd_graph=_Backward(x, grad_out, grad_w),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        static_grad_inputs=(grad_w,),
        clone_param_grads=clone,
        lent=LentGrads(),
    )

    return GraphedCallable(graphs, eager=lambda t: w * t, module=None, captured_training=None), w


def _step(fn, x):
    fn(x).sum().backward()


def _lent(**kwargs):
    return _graphed(clone=False, **kwargs)


# ---- the default: owned gradients ------------------------------------------------------


def test_by_default_every_backward_hands_out_owned_copies_in_one_launch():
    fn, w = _graphed()
    buffer = fn.graphs.static_grad_inputs[0]
    for k in range(3):
        x = torch.full((3,), float(k + 1))
        with _Ops() as ops:
            _step(fn, x)
        copies = [n for n in ops.names if n in ("cat", "clone", "_foreach_mul")]
        assert len(copies) == 1, f"step {k}: one copy per replay, got {copies}"
        assert w.grad.data_ptr() != buffer.data_ptr(), f"step {k}: .grad must be owned"
        assert w.grad.tolist() == x.tolist()
        w.grad = None
    assert fn.graphs.lent.params == [], "nothing is lent by default"


def test_by_default_a_hook_kept_gradient_survives_later_replays():
    # Transformer Engine's own test of clone_param_grads_on_return=True: a weight hook
    # keeps what it receives; later replays must change neither values nor storage.
    fn, w = _graphed()
    kept = []
    w.register_hook(lambda g: kept.append(g))
    xs = [torch.full((3,), float(k + 1)) for k in range(3)]
    for x in xs:
        _step(fn, x)
        w.grad = None
    assert [g.tolist() for g in kept] == [x.tolist() for x in xs]
    assert len({g.untyped_storage().data_ptr() for g in kept}) == 3, "one storage per step"


def test_by_default_accumulation_sums_exactly_and_zeroing_in_place_too():
    fn, w = _graphed()
    xs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0]), torch.ones(3)]
    for x in xs:
        _step(fn, x)
    assert w.grad.tolist() == (xs[0] + xs[1] + xs[2]).tolist()
    w.grad.zero_()
    _step(fn, torch.full((3,), 2.0))
    assert w.grad.tolist() == [2.0, 2.0, 2.0]


def test_by_default_a_forward_that_reuses_the_buffer_memory_changes_no_grad():
    fn, w = _graphed(forward_overwrites_grad=True)
    _step(fn, torch.ones(3))
    with _Ops() as ops:
        fn(torch.full((3,), 5.0))  # scribbles over the buffer
    assert "_foreach_mul" not in ops.names, "an owned .grad needs no settling"
    assert w.grad.tolist() == [1.0, 1.0, 1.0]


# ---- lent mode (clone_param_grads_on_return=False) -------------------------------------


def test_lent_mode_overwrites_a_hook_kept_gradient_as_documented():
    # The documented risk of lending: a gradient kept past the next backward replay
    # sees that replay's values, and every step's gradient is one storage.
    fn, w = _lent()
    kept = []
    w.register_hook(lambda g: kept.append(g))
    for k in range(3):
        _step(fn, torch.full((3,), float(k + 1)))
        w.grad = None
    assert [g.tolist() for g in kept] == [[3.0, 3.0, 3.0]] * 3
    assert len({g.untyped_storage().data_ptr() for g in kept}) == 1


def test_a_fresh_gradient_is_handed_over_without_a_copy():
    fn, w = _lent()
    buffer = fn.graphs.static_grad_inputs[0]
    with _Ops() as ops:
        _step(fn, torch.tensor([4.0, 5.0, 6.0]))
    assert w.grad.data_ptr() == buffer.data_ptr()  # the buffer itself, no copy made
    assert w.grad.tolist() == [4.0, 5.0, 6.0]
    assert "_foreach_mul" not in ops.names and "clone" not in ops.names


def test_set_to_none_steps_never_copy_and_stay_exact():
    fn, w = _lent()
    for k in range(3):
        x = torch.full((3,), float(k + 1))
        with _Ops() as ops:
            _step(fn, x)
        assert w.grad.tolist() == x.tolist()
        assert "_foreach_mul" not in ops.names
        w.grad = None  # zero_grad(set_to_none=True)


def test_accumulation_moves_the_grad_off_the_buffer_once_and_sums_exactly():
    fn, w = _lent()
    buffer = fn.graphs.static_grad_inputs[0]
    xs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0]), torch.ones(3)]
    _step(fn, xs[0])
    with _Ops() as ops:
        _step(fn, xs[1])  # .grad is the buffer: moved before the replay overwrites it
    assert ops.names.count("_foreach_mul") == 1
    assert w.grad.data_ptr() != buffer.data_ptr()
    with _Ops() as ops:
        _step(fn, xs[2])  # .grad is owned now: nothing to move
    assert "_foreach_mul" not in ops.names
    assert w.grad.tolist() == (xs[0] + xs[1] + xs[2]).tolist()


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_forward_that_reuses_the_buffer_memory_never_corrupts_grad(set_to_none):
    # A graph captured earlier into the pool may use the gradient buffer's memory for
    # temporaries: the next forward replay overwrites it, before any backward.
    fn, w = _lent(forward_overwrites_grad=True)
    buffer = fn.graphs.static_grad_inputs[0]
    total = torch.zeros(3)
    for k in range(4):
        x = torch.full((3,), float(k + 1))
        with _Ops() as ops:
            out = fn(x)  # settles: moves a .grad that still is the buffer
        moved = not set_to_none and k > 0
        assert ops.names.count("_foreach_mul") == (1 if k == 1 and moved else 0)
        out.sum().backward()
        total = x if set_to_none else total + x
        assert w.grad.tolist() == total.tolist(), f"step {k}"
        if set_to_none:
            assert w.grad.data_ptr() == buffer.data_ptr()  # lent as is, never copied
            w.grad = None
    assert fn.graphs.lent.params == [w]  # lent again by the last backward


def test_zeroing_in_place_keeps_the_sum_right_too():
    fn, w = _lent()
    _step(fn, torch.ones(3))
    w.grad.zero_()  # zero_grad(set_to_none=False): .grad is still the buffer
    _step(fn, torch.full((3,), 2.0))
    _step(fn, torch.full((3,), 3.0))
    assert w.grad.tolist() == [5.0, 5.0, 5.0]


@pytest.mark.parametrize("clone", [True, False])
def test_autograd_grad_returns_owned_copies(clone):
    fn, w = _graphed(clone)
    buffer = fn.graphs.static_grad_inputs[0]
    (g1,) = torch.autograd.grad(fn(torch.ones(3)).sum(), (w,))
    (g2,) = torch.autograd.grad(fn(torch.full((3,), 7.0)).sum(), (w,))
    assert g1.data_ptr() != buffer.data_ptr() and g2.data_ptr() != buffer.data_ptr()
    assert g1.tolist() == [1.0, 1.0, 1.0] and g2.tolist() == [7.0, 7.0, 7.0]
    assert w.grad is None and fn.graphs.lent.params == []  # nothing lent


@pytest.mark.parametrize("clone", [True, False])
def test_a_released_entry_hands_out_nothing(clone):
    fn, w = _graphed(clone)
    fn.reset()
    assert fn.graphs._probe_accumulator is None and fn.graphs._param_grad_ptrs == []


def test_graphs_of_one_pool_object_share_one_registry():
    from cudagraphs import GraphMemoryPool
    from cudagraphs.core.lent_grads import lent_grads_of

    pool, other = GraphMemoryPool(), GraphMemoryPool()
    assert lent_grads_of(pool) is lent_grads_of(pool)
    assert lent_grads_of(pool) is not lent_grads_of(other)


def test_settling_moves_only_what_still_aliases_and_forgets_everything():
    from cudagraphs.core.lent_grads import LentGrads

    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    buffers = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])]
    a.grad, b.grad, c.grad = buffers[0], None, buffers[2].clone()
    registry = LentGrads()
    registry.lend([a, b, c], [t.data_ptr() for t in buffers])
    with _Ops() as ops:
        registry.settle()
    assert ops.names.count("_foreach_mul") == 1
    assert a.grad.data_ptr() != buffers[0].data_ptr() and a.grad.tolist() == [1.0, 2.0]
    assert b.grad is None and c.grad.tolist() == [5.0, 6.0]
    assert registry.params == [] and registry.ptrs == []


# ---- parameters passed as inputs (explicit-parameter adapters: partial graphs) --------


def _graphed_input(clone: bool = True, forward_overwrites_grad: bool = False):
    """``f(w, x) = w * x`` with the parameter ``w`` an input read in place (pinned),
    as partial graphs pass their targets' parameters."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    alias = w.detach().requires_grad_()
    x = torch.zeros(3)
    out, grad_out, grad_w = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    scratch = grad_w if forward_overwrites_grad else None
    leaves, in_spec = pytree.tree_flatten(((w, x), {}))
    graphs = EntryGraphs(
        name="callables[0] (scale)",
        in_spec=in_spec,
        leaves=leaves,
        tensor_positions=(0, 1),
        paths=("args[0]", "args[1]"),
        input_meta=((w.shape, w.dtype, True), (x.shape, x.dtype, False)),
        static_inputs=[alias, x],
        params=(),
        pinned=((0, w.data_ptr(), w),),
        fwd_graph=_Forward(alias, x, out, scratch),
        bwd_graph=_Backward(x, grad_out, grad_w),
        out_spec=pytree.tree_flatten(out)[1],
        out_leaves=[out],
        out_tensor_positions=(0,),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        diff_input_positions=(0,),
        static_grad_inputs=(grad_w,),
        clone_param_grads=clone,
        positional_only=True,
        lent=LentGrads(),
    )
    fn = GraphedCallable(graphs, eager=lambda p, t: p * t, module=None, captured_training=None)
    return (lambda t: fn(w, t)), fn, w


def test_a_parameter_input_gets_an_owned_copy_by_default():
    call, fn, w = _graphed_input()
    buffer = fn.graphs.static_grad_inputs[0]
    for k in range(2):
        x = torch.full((3,), float(k + 1))
        with _Ops() as ops:
            _step(call, x)
        assert ops.names.count("_foreach_mul") == 1
        assert w.grad.data_ptr() != buffer.data_ptr() and w.grad.tolist() == x.tolist()
        w.grad = None
    assert fn.graphs.lent.params == []


def test_lent_mode_lends_a_parameter_input_like_a_module_parameter():
    # The parameter's gradient buffer becomes .grad as it is (no copy beside the pool)
    # and is registered, so that the pool's next forward replay can move it away.
    call, fn, w = _graphed_input(clone=False)
    buffer = fn.graphs.static_grad_inputs[0]
    for k in range(3):
        x = torch.full((3,), float(k + 1))
        with _Ops() as ops:
            _step(call, x)
        assert "_foreach_mul" not in ops.names and "clone" not in ops.names, f"step {k}"
        assert w.grad.data_ptr() == buffer.data_ptr() and w.grad.tolist() == x.tolist()
        assert fn.graphs.lent.params == [w]
        w.grad = None


def test_lent_parameter_input_accumulates_exactly_over_its_own_replays():
    call, fn, w = _graphed_input(clone=False)
    buffer = fn.graphs.static_grad_inputs[0]
    xs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0]), torch.ones(3)]
    y = call(xs[0])
    # Two backwards of one forward (retain_graph): no forward between them settles.
    y.sum().backward(retain_graph=True)
    assert w.grad.data_ptr() == buffer.data_ptr()
    y.sum().backward()  # its own replay moves the lent .grad off the buffer first
    assert w.grad.data_ptr() != buffer.data_ptr()
    _step(call, xs[2])
    assert w.grad.tolist() == (xs[0] + xs[0] + xs[2]).tolist()


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_forward_that_reuses_a_lent_parameter_input_buffer_never_corrupts_grad(set_to_none):
    call, fn, w = _graphed_input(clone=False, forward_overwrites_grad=True)
    buffer = fn.graphs.static_grad_inputs[0]
    total = torch.zeros(3)
    for k in range(4):
        x = torch.full((3,), float(k + 1))
        out = call(x)  # settles: moves a .grad that still is the buffer
        out.sum().backward()
        total = x if set_to_none else total + x
        assert w.grad.tolist() == total.tolist(), f"step {k}"
        if set_to_none:
            assert w.grad.data_ptr() == buffer.data_ptr()
            w.grad = None


def test_autograd_grad_of_a_lent_parameter_input_is_an_owned_copy():
    call, fn, w = _graphed_input(clone=False)
    buffer = fn.graphs.static_grad_inputs[0]
    (g1,) = torch.autograd.grad(call(torch.ones(3)).sum(), (w,))
    (g2,) = torch.autograd.grad(call(torch.full((3,), 7.0)).sum(), (w,))
    assert g1.data_ptr() != buffer.data_ptr() and g2.data_ptr() != buffer.data_ptr()
    assert g1.tolist() == [1.0, 1.0, 1.0] and g2.tolist() == [7.0, 7.0, 7.0]
    assert w.grad is None and fn.graphs.lent.params == []


def test_a_released_entry_lends_no_parameter_input():
    call, fn, w = _graphed_input(clone=False)
    fn.reset()
    assert fn.graphs._lent_inputs == () and fn.graphs._probe_accumulator is None


def test_lent_module_parameters_accumulate_over_two_backwards_without_a_forward_between():
    # The second backward's own replay would overwrite the .grad the first lent: it
    # is moved to an owned copy first.
    fn, w = _lent()
    buffer = fn.graphs.static_grad_inputs[0]
    y = fn(torch.tensor([1.0, 2.0, 3.0]))
    y.sum().backward(retain_graph=True)
    assert w.grad.data_ptr() == buffer.data_ptr()
    y.sum().backward()
    assert w.grad.tolist() == [2.0, 4.0, 6.0]
    assert w.grad.data_ptr() != buffer.data_ptr()


class _TwoParamForward:
    """out = w1 * x + w2, into the static output."""

    def __init__(self, w1, w2, x, out):
        self.w1, self.w2, self.x, self.out = w1, w2, x, out

    def replay(self):
        self.out.copy_(self.w1.detach() * self.x + self.w2.detach())

    def reset(self):
        pass


class _TwoParamBackward:
    """dx = g * w1, dw1 = g * x, dw2 = g, into the static gradient buffers."""

    def __init__(self, w1, x, grad_out, grad_x, grad_w1, grad_w2):
        self.w1, self.x, self.grad_out = w1, x, grad_out
        self.grad_x, self.grad_w1, self.grad_w2 = grad_x, grad_w1, grad_w2

    def replay(self):
        self.grad_x.copy_(self.grad_out * self.w1.detach())
        self.grad_w1.copy_(self.grad_out * self.x)
        self.grad_w2.copy_(self.grad_out)

    def reset(self):
        pass


def _two_params(clone: bool):
    w1 = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    w2 = torch.nn.Parameter(torch.tensor([0.5, 0.5, 0.5]))
    x = torch.zeros(3, requires_grad=True)
    out, grad_out = torch.zeros(3), torch.zeros(3)
    grad_x, grad_w1, grad_w2 = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    graphs = positional_entry(
        "callables[0] (affine)",
        x,
        out,
        _TwoParamForward(w1, w2, x, out),
        input_meta=((x.shape, x.dtype, True),),
        params=(w1, w2),
        bwd_graph=_TwoParamBackward(w1, x, grad_out, grad_x, grad_w1, grad_w2),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        diff_input_positions=(0,),
        static_grad_inputs=(grad_x, grad_w1, grad_w2),
        clone_param_grads=clone,
        lent=LentGrads(),
    )
    fn = GraphedCallable(graphs, eager=lambda t: w1 * t + w2, module=None, captured_training=None)
    return fn, w1, w2, grad_x


@pytest.mark.parametrize("clone", [True, False])
def test_every_parameter_and_a_non_leaf_input_get_their_gradients(clone):
    fn, w1, w2, _ = _two_params(clone)
    base = torch.tensor([1.0, 1.0, 2.0], requires_grad=True)
    (fn(base * 2.0) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    g = torch.tensor([1.0, 2.0, 3.0])
    assert w1.grad.tolist() == (g * torch.tensor([2.0, 2.0, 4.0])).tolist()
    assert w2.grad.tolist() == g.tolist()
    # The input was not a leaf: its gradient went on to base's producer (times 2).
    assert base.grad.tolist() == (g * w1.detach() * 2.0).tolist()


@pytest.mark.parametrize("clone", [True, False])
def test_a_leaf_inputs_fresh_gradient_is_an_owned_copy(clone):
    fn, w1, _, grad_x = _two_params(clone)
    x = torch.ones(3, requires_grad=True)
    fn(x).sum().backward()
    assert x.grad.tolist() == w1.detach().tolist()
    assert x.grad.data_ptr() != grad_x.data_ptr(), "a leaf's fresh .grad must not alias"


def test_a_lent_parameter_input_leaves_the_other_inputs_gradients_handed_over():
    # The parameter (first input) is lent; the user input after it still gets its
    # gradient, as an owned copy.
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    alias = w.detach().requires_grad_()
    x = torch.zeros(3, requires_grad=True)
    out, grad_out = torch.zeros(3), torch.zeros(3)
    grad_w, grad_x = torch.zeros(3), torch.zeros(3)

    class Backward:
        def replay(self):
            grad_w.copy_(grad_out * x)
            grad_x.copy_(grad_out * alias.detach())

        def reset(self):
            pass

    leaves, in_spec = pytree.tree_flatten(((w, x), {}))
    graphs = EntryGraphs(
        name="callables[0] (scale)",
        in_spec=in_spec,
        leaves=[None, None],
        tensor_positions=(0, 1),
        paths=("args[0]", "args[1]"),
        input_meta=((w.shape, w.dtype, True), (x.shape, x.dtype, True)),
        static_inputs=[alias, x],
        params=(),
        pinned=((0, w.data_ptr(), w),),
        fwd_graph=_Forward(alias, x, out),
        bwd_graph=Backward(),
        out_spec=pytree.tree_flatten(out)[1],
        out_leaves=[out],
        out_tensor_positions=(0,),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        diff_input_positions=(0, 1),
        static_grad_inputs=(grad_w, grad_x),
        clone_param_grads=False,
        positional_only=True,
        lent=LentGrads(),
    )
    fn = GraphedCallable(graphs, eager=lambda p, t: p * t, module=None, captured_training=None)
    user = torch.tensor([4.0, 5.0, 6.0], requires_grad=True)
    fn(w, user).sum().backward()
    assert w.grad.data_ptr() == grad_w.data_ptr() and w.grad.tolist() == [4.0, 5.0, 6.0]
    assert user.grad.tolist() == [1.0, 2.0, 3.0]
    assert user.grad.data_ptr() != grad_x.data_ptr()


@pytest.mark.parametrize("clone", [True, False])
def test_each_gradient_goes_to_its_own_parameter_past_an_unused_one(clone):
    # Three parameters, the middle one unused by the graph (allow_unused): its slot gets
    # nothing, and the third parameter's gradient is not shifted into it.
    w1, w2, w3 = (torch.nn.Parameter(torch.full((3,), float(k + 1))) for k in range(3))
    x = torch.zeros(3)
    out, grad_out, grad_w1, grad_w3 = (torch.zeros(3) for _ in range(4))

    class Forward:
        def replay(self):
            out.copy_(w1.detach() * x + w3.detach())

        def reset(self):
            pass

    class Backward:
        def replay(self):
            grad_w1.copy_(grad_out * x)
            grad_w3.copy_(grad_out)

        def reset(self):
            pass

    graphs = positional_entry(
        "callables[0] (three)",
        x,
        out,
        Forward(),
        params=(w1, w2, w3),
        bwd_graph=Backward(),
        out_differentiable=(True,),
        static_grad_outputs=[grad_out],
        static_grad_inputs=(grad_w1, None, grad_w3),
        clone_param_grads=clone,
        lent=LentGrads(),
    )
    fn = GraphedCallable(graphs, eager=lambda t: w1 * t + w3, module=None, captured_training=None)
    (fn(torch.tensor([1.0, 2.0, 3.0])) * 2.0).sum().backward()
    assert w1.grad.tolist() == [2.0, 4.0, 6.0]
    assert w2.grad is None
    assert w3.grad.tolist() == [2.0, 2.0, 2.0]


# ---- one backward per forward replay --------------------------------------------------


def test_a_backward_after_a_later_forward_replay_of_the_same_graph_is_refused():
    # m(a) and m(b) in one step: the second replay overwrote the inputs the first
    # one's backward reads, so that backward would hand out b's gradient for a.
    from cudagraphs.errors import CudaGraphsStateError

    fn, w = _graphed()
    first = fn(torch.full((3,), 1.0))
    second = fn(torch.full((3,), 5.0))
    with pytest.raises(CudaGraphsStateError, match=r"after 1 later forward replay"):
        (first.sum() + second.sum()).backward()
    w.grad = None
    # Each call's backward before the next call: fine, and the next good step works.
    for k in (2.0, 3.0):
        fn(torch.full((3,), k)).sum().backward()
        assert w.grad.tolist() == [k] * 3
        w.grad = None
    # A no-grad call between a forward and its backward overwrites it too.
    kept = fn(torch.full((3,), 4.0))
    with torch.no_grad():
        fn(torch.full((3,), 7.0))
    with pytest.raises(CudaGraphsStateError, match="overwrote the inputs"):
        kept.sum().backward()
