"""Recording that survives real training loops, on the CPU with an eager capture
backend: several micro-batches in the recorded step (gradient accumulation), an
evaluation during it (ignored or recorded as an inference variant), stop_recording(),
and the real reuse (one target called twice within one forward) still refused."""

import copy
import logging

import pytest
import torch
from torch import nn

from cudagraphs.errors import CudaGraphsValueError
from cudagraphs.partial import PartialCudaGraphManager, TargetSelectionError
from cudagraphs.partial.graphing import capture_groups, capture_modes
from cudagraphs.partial.recording import ForwardClock, is_inference_call
from helpers.hf_models import tiny
from helpers.toy_models import Toy

# Attention and router targets (the scopes these tests are about; the default is
# every scope, which graphs these small blocks whole).
NARROW = ("attention", "moe_router")


class Backend:
    """An eager capture backend that remembers each call and the modes it ran in."""

    def __init__(self):
        self.calls = []

    def __call__(self, callables, sample_args, sample_kwargs):
        self.calls.append(
            {
                "count": len(callables),
                "grad": torch.is_grad_enabled(),
                "names": [c.__qualname__ for c in callables],
            }
        )
        return list(callables)


def loss_of(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


def accumulate(model, batches):
    """One optimizer step's forwards and backwards over micro-batches (no step)."""
    losses = []
    for ids in batches:
        loss = loss_of(model, ids) / len(batches)
        loss.backward()
        losses.append(loss.detach())
    return losses


def batches(seed, *shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, shape, generator=gen) for shape in shapes]


def assert_same_grads(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


# --- gradient accumulation -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_micro_batches_of_equal_shape_record_one_variant_and_replay_equal_to_eager(kind):
    model = tiny(kind)
    ref = copy.deepcopy(model)
    backend = Backend()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=NARROW)
    mgr.start_recording()
    first = batches(0, (2, 8), (2, 8))
    assert all(torch.equal(a, b) for a, b in zip(accumulate(model, first), accumulate(ref, first)))
    mgr.capture()  # no "ran more than once": each call was in a forward of its own
    assert all(len(e.contracts.variants) == 1 for e in mgr.recordings)
    assert [c["count"] for c in backend.calls] == [len(mgr.recordings)]
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    later = batches(1, (2, 8), (2, 8))
    got, want = accumulate(model, later), accumulate(ref, later)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_same_grads(model, ref)
    stats = mgr.stats()
    assert stats["replayed"] == 2 * len(mgr.recordings) and stats["fallbacks"] == 0, stats
    mgr.close()


def test_micro_batches_of_distinct_shapes_record_a_variant_each():
    model = tiny()
    ref = copy.deepcopy(model)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=Backend(), scopes=NARROW)
    mgr.start_recording()
    accumulate(model, batches(0, (2, 8), (2, 12), (2, 8)))
    mgr.capture()
    assert all(len(e.contracts.variants) == 2 for e in mgr.recordings)
    assert all(e.recorded_calls == 3 and not e.repeated for e in mgr.recordings)
    model.zero_grad(set_to_none=True)
    later = batches(1, (2, 12), (2, 8))
    accumulate(model, later)
    accumulate(ref, later)
    assert_same_grads(model, ref)
    stats = mgr.stats()
    assert stats["captured"] == 4 and stats["replayed"] == 4 and stats["fallbacks"] == 0


def test_micro_batches_beyond_max_variants_are_not_recorded_and_said_once(caplog):
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=Backend(), max_variants=1, scopes=NARROW
    )
    mgr.start_recording()
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        accumulate(model, batches(0, (1, 8), (1, 12), (1, 16)))
    mgr.capture()
    assert all(len(e.contracts.variants) == 1 for e in mgr.recordings)
    assert sum("max_variants=1" in r.getMessage() for r in caplog.records) == 1


def test_a_reuse_within_one_forward_is_refused_under_accumulation_too():
    model = Toy(twice=True)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=Backend(), scopes=NARROW)
    mgr.start_recording()
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(TargetSelectionError, match=r"\['layers\.0\.self_attn'\] ran more") as err:
        mgr.capture()
    assert "within one forward of the model" in str(err.value)
    assert "layers.1" not in str(err.value)


def test_without_model_parts_a_second_forward_counts_as_a_reuse_and_says_why():
    model = Toy()
    built = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=Backend(), scopes=NARROW
    )
    mgr = PartialCudaGraphManager(built.dispatchers, capture_backend=Backend())
    mgr.start_recording()
    model(torch.randn(2, 8))
    model(torch.randn(2, 8))
    with pytest.raises(TargetSelectionError, match="built without its model parts") as err:
        mgr.capture()
    assert "from_model_parts" in str(err.value)


def test_a_forward_that_raises_does_not_leave_the_clock_inside_it():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=Backend(), scopes=NARROW)
    mgr.start_recording()

    def fail(module, args, output):
        raise RuntimeError("a forward that fails after the targets ran")

    handle = model.layers[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="fails after"):
        model(torch.randn(2, 8))
    handle.remove()
    model(torch.randn(2, 8))
    model(torch.randn(2, 8))
    mgr.capture()  # three forwards, no reuse
    assert all(e.recorded_calls == 3 and not e.repeated for e in mgr.recordings)
    assert mgr.stats()["captured"] == 2


# --- evaluation during the recorded step -----------------------------------------------


def evaluate(model, ids):
    """An evaluation as a Trainer runs one: eval mode, no grad; every flag restored."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits
    finally:
        for m, flag in flags:
            m.training = flag


def test_an_evaluation_while_recording_is_ignored_by_default(caplog):
    model = tiny()
    ref = copy.deepcopy(model)
    backend = Backend()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=NARROW)
    assert mgr.inference_calls == "ignore"
    mgr.start_recording()
    with caplog.at_level(logging.INFO, logger="cudagraphs.partial.manager"):
        accumulate(model, batches(0, (1, 8)))
        evaluate(model, batches(1, (1, 8))[0])
        evaluate(model, batches(2, (1, 8))[0])
    mgr.capture()
    said = [r for r in caplog.records if "inference_calls='record'" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert said[0].getMessage().startswith("partial graphs: model.layers.0.self_attn was")
    assert all(len(e.contracts.variants) == 1 for e in mgr.recordings)
    assert len(backend.calls) == 1 and backend.calls[0]["grad"]
    ids = batches(3, (1, 8))[0]
    assert torch.equal(evaluate(model, ids), evaluate(ref, ids))
    stats = mgr.stats()
    assert stats["replayed"] == 0 and stats["fallbacks"] == 2, stats


def test_an_evaluation_while_recording_is_an_inference_variant_when_asked():
    model = tiny()
    ref = copy.deepcopy(model)
    backend = Backend()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=backend, inference_calls="record", scopes=NARROW
    )
    # A submodule of a target in a mode of its own must keep it.
    model.model.layers[0].self_attn.o_proj.eval()
    ref.model.layers[0].self_attn.o_proj.eval()
    mgr.start_recording()
    accumulate(model, batches(0, (1, 8)))
    evaluate(model, batches(1, (1, 8))[0])
    seen_training = []

    def spy(callables, sample_args, sample_kwargs):
        seen_training.append([e.target.module.training for e in mgr.recordings])
        return backend(callables, sample_args, sample_kwargs)

    mgr._backend = spy
    mgr.capture()
    # Training calls first (grad on, modules training), then the inference group in
    # a capture (pool) of its own, with grad off and the modules in eval mode.
    assert [(c["count"], c["grad"]) for c in backend.calls] == [(2, True), (2, False)]
    assert seen_training == [[True, True], [False, False]]
    attn = model.model.layers[0].self_attn
    assert attn.training and not attn.o_proj.training, "modes restored"
    assert all(len(e.contracts.variants) == 2 for e in mgr.recordings)
    ids = batches(2, (1, 8))[0]
    assert torch.equal(evaluate(model, ids), evaluate(ref, ids))
    model.zero_grad(set_to_none=True)
    later = batches(3, (1, 8))
    accumulate(model, later)
    accumulate(ref, later)
    assert_same_grads(model, ref)
    stats = mgr.stats()
    assert stats["replayed"] == 4 and stats["fallbacks"] == 0, stats


@pytest.mark.parametrize("bad", ["eager", None, True, "Record"])
def test_inference_calls_must_be_ignore_or_record(bad):
    with pytest.raises(CudaGraphsValueError, match=r"inference_calls must be one of"):
        PartialCudaGraphManager.from_model_parts(
            Toy(), capture_backend=Backend(), inference_calls=bad, scopes=NARROW
        )


# --- stop_recording -----------------------------------------------------------------


def test_stop_recording_keeps_what_was_recorded_and_records_nothing_after():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=Backend(), scopes=NARROW)
    assert mgr.recording is False
    mgr.stop_recording()  # a no-op when not recording
    mgr.start_recording()
    assert mgr.recording is True
    model(torch.randn(2, 8))
    mgr.stop_recording()
    assert mgr.recording is False
    model(torch.randn(3, 8))  # not recorded: no second variant
    assert all(e.target.module._forward_pre_hooks == {} for e in mgr.recordings)
    assert model._forward_pre_hooks == {} and model._forward_hooks == {}
    mgr.capture()
    assert all(len(e.contracts.variants) == 1 for e in mgr.recordings)
    model(torch.randn(2, 8))
    assert mgr.stats()["replayed"] == 2
    mgr.close()
    mgr.stop_recording()  # after close too


# --- the pieces -------------------------------------------------------------------------


def test_forward_clock_numbers_outermost_forwards_and_direct_calls():
    outer = Toy()
    clock = ForwardClock()
    assert clock.current() == 1, "a call outside any forward is a forward of its own"
    clock.install([outer, outer.layers[0]])  # a part nested in another
    seen = []
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda m, a: seen.append(clock.current()))
        for layer in outer.layers
    ]
    outer(torch.randn(1, 8))  # layer 1's call comes after the nested part returned
    outer(torch.randn(1, 8))
    outer.layers[0].self_attn(torch.randn(1, 8))  # direct: a forward of its own
    outer.layers[0].self_attn(torch.randn(1, 8))
    assert seen == [2, 2, 3, 3, 4, 5]
    clock.remove()
    for handle in handles:
        handle.remove()
    assert outer._forward_pre_hooks == {} and outer._forward_hooks == {}


def test_an_evaluation_style_call_is_grad_off_or_eval_mode():
    module = nn.Linear(2, 2)
    assert not is_inference_call(module)
    with torch.no_grad():
        assert is_inference_call(module), "grad off alone"
    module.eval()
    assert is_inference_call(module), "eval mode alone"


class Variant:
    def __init__(self, grad_enabled, training, autocast=()):
        self.grad_enabled, self.training, self.autocast = grad_enabled, training, autocast


class Recorded:
    """What capture_groups reads of a target: its recorded contracts' modes."""

    def __init__(self, *modes):
        self.contracts = type("C", (), {"variants": [Variant(*m) for m in modes]})()


def test_capture_groups_put_training_calls_first_and_each_inference_mode_apart():
    a = Recorded((False, False), (True, True))
    b = Recorded((True, True), (True, False), (False, False))
    todo = [(a, 0), (a, 1), (b, 0), (b, 1), (b, 2)]
    groups = capture_groups(todo, one_pool_per_call=False)
    assert groups[0] == [(a, 1), (b, 0)]
    assert sorted(map(tuple, groups[1:]), key=len) == [((b, 1),), ((a, 0), (b, 2))]
    single = capture_groups(todo, one_pool_per_call=True)
    assert all(len(g) == 1 for g in single) and single[:2] == [[(a, 1)], [(b, 0)]]
    assert capture_groups([], one_pool_per_call=False) == []
    bf16 = (("cuda", torch.bfloat16),)
    c = Recorded((True, True), (True, True, bf16))
    d = Recorded((True, True, bf16))
    groups = capture_groups([(c, 0), (c, 1), (d, 0)], one_pool_per_call=False)
    assert groups == [[(c, 0)], [(c, 1), (d, 0)]], "one autocast state per capture"


def test_capture_modes_set_and_restore_grad_and_every_flag():
    model = Toy()
    model.layers[1].eval()
    with capture_modes(False, False, [model]):
        assert not torch.is_grad_enabled()
        assert not any(m.training for m in model.modules())
    assert torch.is_grad_enabled()
    assert model.training and model.layers[0].training and not model.layers[1].training
    with capture_modes(True, True, [model]):  # already training: left alone
        assert not model.layers[1].training
    with pytest.raises(KeyError), capture_modes(False, False, [model]):
        raise KeyError("restored on error too")
    assert torch.is_grad_enabled() and model.training and not model.layers[1].training
    with capture_modes(True, True, [model], (("cpu", torch.bfloat16),)):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_cache_enabled(), "cast weights must not be cached"
    assert not torch.is_autocast_enabled("cpu")


def test_a_step_under_autocast_is_captured_under_it_and_replays_equal_to_eager():
    model = tiny()
    ref = copy.deepcopy(model)
    seen = []

    def backend(callables, sample_args, sample_kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return list(callables)

    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=NARROW)
    mgr.start_recording()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        accumulate(model, batches(0, (1, 8)))
    mgr.capture()  # outside autocast, as a Trainer callback runs it
    assert seen == [(True, torch.bfloat16)]
    later = batches(1, (1, 8))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = accumulate(model, later), accumulate(ref, later)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_same_grads(model, ref)
    assert mgr.stats()["replayed"] == 2
    accumulate(model, later)  # without autocast: not the recorded kernels
    assert mgr.stats()["fallback_autocast"] == 2


def test_an_evaluation_fallback_says_how_to_graph_evaluations(caplog):
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=Backend(), scopes=NARROW)
    mgr.start_recording()
    accumulate(model, batches(0, (1, 8)))
    mgr.capture()
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        evaluate(model, batches(1, (1, 8))[0])
    (record,) = [r for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert "inference_calls='record'" in record.getMessage()


def test_samples_are_kept_until_a_capture_succeeds_then_dropped():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=Backend(), scopes=NARROW)

    def failing(callables, sample_args, sample_kwargs):
        raise RuntimeError("capture failed")

    mgr._backend = failing
    mgr.start_recording()
    model(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="capture failed"):
        mgr.capture()
    assert all(v.args is not None and v.graph is None for e in mgr.recordings for v in e.variants)
    mgr._backend = Backend()
    mgr.capture()  # retried from the kept samples
    variants = [v for e in mgr.recordings for v in e.variants]
    assert len(variants) == 2
    assert all(v.graph is not None and v.args is None and v.kwargs is None for v in variants)
    model(torch.randn(2, 8))
    assert mgr.stats()["replayed"] == 2


def test_experts_implementation_switches_the_model_before_discovery(caplog):
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    with caplog.at_level(logging.INFO, logger="cudagraphs.partial.manager"):
        mgr = PartialCudaGraphManager.from_model_parts(
            model, capture_backend=Backend(), experts_implementation="grouped_mm", scopes=NARROW
        )
    assert model.config._experts_implementation == "grouped_mm"
    assert model.model.layers[0].mlp.experts.config._experts_implementation == "grouped_mm"
    assert any("experts implementation of" in r.getMessage() for r in caplog.records)
    assert mgr is not None


def test_experts_implementation_needs_a_model_that_can_switch():
    with pytest.raises(CudaGraphsValueError, match="no module in the model parts has"):
        PartialCudaGraphManager.from_model_parts(
            Toy(), capture_backend=Backend(), experts_implementation="grouped_mm", scopes=NARROW
        )
    with pytest.raises(CudaGraphsValueError, match=r"refused experts_implementation='nope'"):
        PartialCudaGraphManager.from_model_parts(
            tiny("qwen3_moe"),
            capture_backend=Backend(),
            experts_implementation="nope",
            scopes=NARROW,
        )
    from cudagraphs.errors import CudaGraphsTypeError

    with pytest.raises(CudaGraphsTypeError, match="experts_implementation must be a str"):
        PartialCudaGraphManager.from_model_parts(
            tiny("qwen3_moe"), capture_backend=Backend(), experts_implementation=1, scopes=NARROW
        )
