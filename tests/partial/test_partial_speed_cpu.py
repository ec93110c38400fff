"""Never slower than eager (partial/speed.py) on the CPU: the interleaved timing with
an injected clock, forward+backward without touching .grad, the random-number state
restored, and the manager turning off a target whose graph loses."""

import functools
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError
from cudagraphs.partial import PartialCudaGraphManager
from cudagraphs.partial.speed import SpeedCheck, SpeedVerdict, forward_backward
from helpers.toy_models import Toy

# Attention and router targets (the scopes these tests are about; the default is
# every scope, which graphs these small blocks whole).
NARROW = ("attention", "moe_router")


class FakeClock:
    """Time that moves only when the code under test says it spent some."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def spend(self, seconds):
        self.now += seconds


def no_sync():
    pass


def test_measure_takes_medians_of_interleaved_rounds_and_restores_the_rng():
    clock, order = FakeClock(), []

    def graph():
        order.append("g")
        torch.rand(1)
        clock.spend(0.002)

    def eager():
        order.append("e")
        clock.spend(0.003)

    check = SpeedCheck(rounds=3, iters=2, warmup=1, clock=clock, synchronize=no_sync)
    state = torch.random.get_rng_state()
    verdict = check.measure(graph, eager)
    assert torch.equal(torch.random.get_rng_state(), state), "random state restored"
    assert verdict == SpeedVerdict(graph_ms=pytest.approx(2.0), eager_ms=pytest.approx(3.0))
    assert not verdict.slower
    # warmup g e; round 0 g-first, round 1 e-first, round 2 g-first
    assert "".join(order) == "ge" + "ggee" + "eegg" + "ggee"


def test_a_tie_keeps_the_graph_and_a_loss_does_not():
    assert not SpeedVerdict(1.0, 1.0).slower
    assert SpeedVerdict(1.01, 1.0).slower


@pytest.mark.parametrize("field, value", [("rounds", 0), ("iters", 0), ("warmup", -1)])
def test_speed_check_arguments_are_checked(field, value):
    with pytest.raises(CudaGraphsValueError, match=rf"^{field} must be an int >= "):
        SpeedCheck(**{field: value})


def test_forward_backward_computes_gradients_without_writing_grad():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(g.shape))
    w = lin.weight  # an input, as the parameters are for a partial graph's adapter
    forward_backward(lambda t, weight: t @ weight.t(), (x, w), {})()
    assert seen == [torch.Size([2, 4])], "gradients of the inputs were computed"
    assert lin.weight.grad is None and x.grad is None
    calls = []
    forward_backward(lambda t: calls.append(t) or t * 2, (torch.ones(2),), {})()
    assert len(calls) == 1, "nothing requires grad: the forward alone"


# --- the manager ------------------------------------------------------------------------


def slow_backend(clock, slow_name):
    """An eager "graph" per call that costs 1 ms, 3 ms for ``slow_name``; the eager
    adapter costs 2 ms (each target's forward spends it)."""

    def backend(callables, sample_args, sample_kwargs):
        graphs = []
        for fn in callables:
            cost = 0.003 if slow_name in fn.__qualname__ else 0.001

            def graph(*args, _fn=fn, _cost=cost, **kwargs):
                clock.spend(_cost - 0.002)  # the forward adds 2 ms to every run
                return _fn(*args, **kwargs)

            graphs.append(graph)
        return graphs

    return backend


def test_a_target_whose_graph_loses_runs_eagerly_from_then_on(caplog):
    model, clock = Toy(), FakeClock()
    costly_forwards = []
    for layer in model.layers:
        # The cost in forward itself: the graphed function runs forward, not the
        # module's hooks (those run around the real call, once).
        forward = layer.self_attn.forward

        @functools.wraps(forward)  # discovery reads the signature
        def costly(*args, _forward=forward, **kwargs):
            clock.spend(0.002)
            return _forward(*args, **kwargs)

        layer.self_attn.forward = costly
        costly_forwards.append(costly)
    check = SpeedCheck(rounds=3, iters=1, warmup=0, clock=clock, synchronize=no_sync)
    mgr = PartialCudaGraphManager.from_model_parts(
        model,
        capture_backend=slow_backend(clock, "layers.1.self_attn"),
        speed_check=check,
        scopes=NARROW,
    )
    mgr.start_recording()
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        mgr.capture()
    slow, fast = mgr.recordings[1], mgr.recordings[0]
    assert slow.off_reason == "slower_than_eager" and fast.off_reason is None
    assert slow.target.module.forward is costly_forwards[1], "its eager forward is back"
    assert slow.graphs() == [] and len(fast.graphs()) == 1
    (said,) = [r for r in caplog.records if "slower graphed than eager" in r.getMessage()]
    assert "layers.1.self_attn (3.000 ms graphed vs 2.000 ms eager)" in said.getMessage()
    model(torch.randn(2, 8, requires_grad=True))
    stats = mgr.stats()
    assert stats["off_slower_than_eager"] == 1 and stats["captured"] == 1, stats
    assert stats["replayed"] == 1 and stats["fallbacks"] == 0, stats
    mgr.start_recording()  # a later recording leaves the target alone
    model(torch.randn(3, 8))
    mgr.capture()
    assert slow.variants[0].graph is None and len(slow.variants) == 1
    mgr.close()


def test_no_check_when_turned_off_or_on_the_cpu_by_default(monkeypatch):
    def refuse(self, graph, eager):
        raise AssertionError("measured")

    monkeypatch.setattr(SpeedCheck, "measure", refuse)
    for speed_check in (True, False):
        model = Toy()
        mgr = PartialCudaGraphManager.from_model_parts(
            model, capture_backend=lambda c, a, k: list(c), speed_check=speed_check, scopes=NARROW
        )
        mgr.start_recording()
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
        mgr.capture()  # CPU targets: the default check does not run
        assert mgr.stats()["captured"] == 2


def test_an_explicit_speed_check_measures_on_a_torch_without_cuda(monkeypatch):
    # The docs: a SpeedCheck(...) checks on any device. Without CUDA the default
    # synchronize has nothing to wait for (it used to raise torch's AssertionError).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        model,
        capture_backend=lambda c, a, k: list(c),
        speed_check=SpeedCheck(rounds=1, iters=1, warmup=0),
        scopes=NARROW,
    )
    mgr.start_recording()
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    mgr.capture()
    stats = mgr.stats()
    # Measured: each target kept or turned off by its verdict (the stand-in graph is
    # the eager forward, so either can win).
    assert stats["captured"] + stats["off_slower_than_eager"] == 2, stats


@pytest.mark.parametrize("bad, said", [(1, "int 1"), ("yes", "str 'yes'"), (None, "NoneType None")])
def test_speed_check_must_be_a_bool_or_a_speed_check(bad, said):
    with pytest.raises(
        CudaGraphsTypeError, match=f"speed_check must be a bool or a SpeedCheck, got {said}$"
    ):
        PartialCudaGraphManager.from_model_parts(Toy(), speed_check=bad, scopes=NARROW)


def test_forward_backward_passes_keywords_and_skips_what_has_no_gradient():
    x = torch.randn(3, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)  # an input the function does not read
    seen = []
    x.register_hook(lambda g: seen.append(g.clone()))

    def fn(a, b, *, scale):
        out = a * scale
        return out, out.detach(), 3  # a tensor without grad and a plain value: left out

    forward_backward(fn, (x, unused), {"scale": 2.0})()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))
    assert x.grad is None and unused.grad is None


def test_forward_backward_leaves_out_the_unreached_outputs_by_tensor_position():
    # A loss and the logits beside it, the logits unreached (tensor position 2: the
    # frozen tensor before them counts, the plain value does not).
    x = torch.randn(3, requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(g.clone()))

    def fn(a):
        logits = a * 3.0
        return {"loss": (a * 2.0).sum(), "n": 7, "frozen": a.detach(), "logits": logits}

    forward_backward(fn, (x,), {}, frozenset({2}))()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))
    seen.clear()
    forward_backward(fn, (x,), {})()
    assert torch.equal(seen[0], torch.full((3,), 5.0))  # the logits' ones add 3 each


def test_the_speed_check_backpropagates_what_the_graph_was_captured_for(monkeypatch):
    # Both sides time the backward the graph has: with the logits unreached, a graph
    # whose backward refused them would otherwise fail the speed check.
    from cudagraphs.partial import speed as speed_module

    seen = []
    real = speed_module.forward_backward

    def spy(fn, args, kwargs, unreached=frozenset()):
        seen.append(unreached)
        return real(fn, args, kwargs, unreached)

    monkeypatch.setattr(speed_module, "forward_backward", spy)
    variant = SimpleNamespace(args=(torch.randn(2, requires_grad=True),), kwargs={})
    variant.unreached_outputs = lambda: frozenset({1})
    rec = SimpleNamespace(
        variants=[variant],
        contracts=SimpleNamespace(variants=[SimpleNamespace(grad_enabled=True)]),
        capture_params=lambda i: (),
    )
    check = SpeedCheck(rounds=1, iters=1, warmup=0, synchronize=lambda: None)

    def fn(params, t):
        return t.sum(), t * 2

    speed_module.measure_group(check, [(rec, 0)], [fn], [fn])
    assert seen == [frozenset({1}), frozenset({1})]


def test_forward_backward_runs_only_the_forward_when_no_input_needs_grad():
    w = torch.randn(3, requires_grad=True)  # read inside, not passed: no input needs grad
    calls = []

    def fn(a):
        calls.append(1)
        return a * w

    forward_backward(fn, (torch.randn(3),), {})()
    assert calls == [1] and w.grad is None


# ---- measure_group on stand-in recordings: which variants are timed, with what --------
class _Param:
    """A parameter stand-in that says it lives on a CUDA device."""

    is_cuda = True


def _recording(name, grad_enabled, variant_args, calls):
    """A recording with one variant per args tuple; its graph and graphed function
    (``eager``) record calls."""
    variants = [
        SimpleNamespace(args=a, kwargs={}, unreached_outputs=frozenset) for a in variant_args
    ]
    contracts = SimpleNamespace(
        variants=[SimpleNamespace(grad_enabled=grad_enabled) for _ in variant_args]
    )
    params = [(_Param(),) for _ in variant_args]  # per variant, as for FSDP targets

    return SimpleNamespace(
        name=name,
        variants=variants,
        contracts=contracts,
        capture_params=lambda i: params[i],  # an index, never None
        eager=lambda *a, **k: calls.append((name, "eager", a)),
    )


def test_measure_group_times_training_variants_after_inference_ones(monkeypatch):
    from cudagraphs.partial.speed import measure_group

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)  # the default check's sync
    calls = []
    inference = _recording("inference", False, [("a",)], calls)
    training = _recording("training", True, [("b",), ("c",)], calls)
    group = [(inference, 0), (training, 1)]

    def graph(*a, **k):
        calls.append(("graph", a))

    eager = [inference.eager, training.eager]
    verdicts = measure_group(True, group, [graph, graph], eager)  # True: the default check
    assert [e.name for e, _ in verdicts] == ["training"]
    assert isinstance(verdicts[0][1], SpeedVerdict)
    # Each call got (the variant's parameters, *its args): variant 1's are ("c",).
    timed = {call[-1][1:] for call in calls}
    assert timed == {("c",)}
    assert {call[-1][0] for call in calls} == {training.capture_params(1)}
    default = SpeedCheck()
    assert len(calls) == 2 * (default.warmup + default.rounds * default.iters)


def test_measure_group_leaves_cpu_targets_to_an_explicit_check():
    from cudagraphs.partial.speed import measure_group

    calls = []
    rec = _recording("cpu", True, [("a",)], calls)
    rec.capture_params = lambda i: (torch.zeros(1),)  # a CPU parameter
    group, graphs, eager = [(rec, 0)], [lambda *a: None], [rec.eager]
    assert measure_group(True, group, graphs, eager) == []
    check = SpeedCheck(rounds=1, iters=1, warmup=0, clock=FakeClock(), synchronize=no_sync)
    assert [r.name for r, _ in measure_group(check, group, graphs, eager)] == ["cpu"]
    assert measure_group(False, group, graphs, eager) == []
