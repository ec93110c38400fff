"""Details of the "model" scope (CPU, eager capture backend): the exact texts of its
refusals and warnings, two model parts each graphed (or refused) on their own, a speed
verdict against the whole part, a target turned off for another reason left so, and a
dict-valued experts implementation read through the part."""

import copy
import logging
import types

import pytest
import torch

from cudagraphs.errors import CudaGraphCaptureError
from cudagraphs.partial import SCOPES, PartialCudaGraphManager
from cudagraphs.partial import graphing as graphing_module
from cudagraphs.partial.graphing import holds_tensors, refuse_whole_part
from cudagraphs.partial.model_scope import fsdp_refusal, opaque_output_fix
from cudagraphs.partial.planning import plan_targets
from cudagraphs.partial.speed import SpeedVerdict
from helpers.hf_models import tiny
from helpers.partial_training import backend, loss_of

WIDEST = (*SCOPES, "model")
LOGGER = "cudagraphs.partial.manager"


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- texts ----------------------------------------------------------------------------
def test_every_planning_refusal_says_what_and_the_fix_in_full():
    model = tiny("llama")
    assert plan_targets(torch.nn.Linear(2, 2), scopes=WIDEST).model_off.detail == (
        "Linear holds no decoder blocks, so nothing says its forward is a model's. Fix: "
        "pass the model (or its decoder) as the model part."
    )
    assert plan_targets(model, scopes=WIDEST, include="lm_head").model_off.detail == (
        "include= names targets inside LlamaForCausalLM, which one graph of the whole "
        "part would contain. Fix: drop include= or the 'model' scope."
    )
    layers = model.model.layers
    assert plan_targets(layers, scopes=WIDEST).model_off.detail == (
        "ModuleList is a container with no forward of its own (a pipeline stage as a list "
        "of layers). Fix: pass a module whose forward runs the layers."
    )
    moe = tiny("qwen3_moe")
    moe.set_experts_implementation("eager")
    assert plan_targets(moe, scopes=WIDEST).model_off.detail == (
        "2 block(s) of Qwen3MoeForCausalLM cannot be graphed whole (model.layers.0, "
        "model.layers.1; see the narrowed and skipped blocks for why), so neither can the "
        "part. Fix: make every layer graph-safe (experts_implementation='grouped_mm' for "
        "an MoE)."
    )
    assert fsdp_refusal(model).detail == (
        "LlamaForCausalLM holds FSDP2 units, whose unshard hooks would run inside one "
        "graph of the whole part. Its layers are graphed instead (parameters copied in "
        "per call)."
    )


def test_the_opaque_output_fix_names_every_type():
    assert opaque_output_fix(["DynamicCache", "Thing"]) == (
        "its forward returns DynamicCache, Thing object(s), which a graph would hand back "
        "as they were at capture (stale). Fix: call the model with use_cache=False (or set "
        "model.config.use_cache = False for training), so that it returns tensors only."
    )


def test_a_refusal_turns_the_part_off_and_says_so_once_without_a_doubled_stop(caplog):
    mgr = PartialCudaGraphManager.from_model_parts(
        tiny("llama"), capture_backend=backend, scopes=WIDEST
    )
    part = mgr.recordings[0]
    caplog.set_level(logging.WARNING, logger=LOGGER)
    refuse_whole_part(part, "model_x", ".it failed.", logging.getLogger(LOGGER))
    assert part.off_reason == "model_x"
    assert warnings_of(caplog) == [
        "partial graphs: LlamaForCausalLM is not graphed whole (stats()['off_model_x']): "
        ".it failed. The targets inside it are graphed instead where they are graph-safe "
        "(those an earlier graph of it stood for from the next recorded step on)."
    ]


class Holder:
    def __init__(self, value):
        self.value = value


class Box:
    def __init__(self):
        self.items = {"k": torch.zeros(1)}


class Slots:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def test_objects_without_a_dict_hold_no_tensors_seen():
    # __slots__ objects and plain object()s have no __dict__: nothing is looked into.
    assert holds_tensors(object()) is False
    assert holds_tensors(Slots(torch.zeros(1))) is False
    assert holds_tensors(Holder(Holder(torch.zeros(1)))) is True
    # Three levels down by default: a tensor in the third holder is found, in a fourth not.
    assert holds_tensors(Holder(Holder(Holder(torch.zeros(1))))) is True
    assert holds_tensors(Holder(Holder(Holder(Holder(torch.zeros(1)))))) is False


class Stack(torch.nn.Module):
    """A toy stage: layers that take a cache-like object (``state``) besides x."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x, state=None):
        for layer in self.layers:
            x = layer(x, state=state)
        return x


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()

    def forward(self, x, state=None):
        return self.self_attn(hidden_states=x, attention_mask=None, state=state)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4)
        self.o_proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, attention_mask=None, state=None):
        return self.o_proj(self.q_proj(hidden_states))


def test_stateful_arguments_are_found_past_a_target_already_off_and_named_by_type(caplog):
    model = Stack()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=SCOPES)
    names = [e.name for e in mgr.recordings]
    assert names == ["layers.0", "layers.1"], names
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mgr.start_recording()
    model(torch.ones(2, 4), state=[Holder(torch.zeros(1)), Slots(1)]).sum().backward()
    # Recorded, then off: passed over by the check, not the end of its walk.
    mgr.recordings[0].turn_off("mine")
    mgr.capture()
    assert [e.off_reason for e in mgr.recordings] == ["mine", "stateful_argument"]
    assert warnings_of(caplog) == [
        "partial graphs: layers.1 is called with Holder object(s) holding "
        "tensors (state the call changes, such as a KV cache), which no graph can follow; "
        "it runs eagerly (stats()['off_stateful_argument']). Fix: for training, call the "
        "model with use_cache=False (or set model.config.use_cache = False)."
    ]


def test_two_kinds_of_stateful_objects_are_both_named(caplog):
    model = Stack()
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=SCOPES)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mgr.start_recording()
    # pytree opens the dict and the list: three leaves, two types holding tensors.
    state = {"a": Holder(torch.zeros(1)), "b": [Box()], "c": Holder(2)}
    model(torch.ones(2, 4), state=state).sum().backward()
    mgr.capture()
    said = warnings_of(caplog)
    assert len(said) == 2 and all("with Box, Holder object(s) holding" in m for m in said)


# ---- two parts --------------------------------------------------------------------------
def two_llamas():
    parts = [tiny("llama", seed=0), tiny("llama", seed=1)]
    return parts, copy.deepcopy(parts)


def step(parts, refs, ids, step_no):
    loss = sum(loss_of(p, ids) for p in parts)
    want = sum(loss_of(r, ids) for r in refs)
    loss.backward()
    want.backward()
    assert torch.equal(loss, want), f"step {step_no}"
    for part, ref in zip(parts, refs):
        for (name, p), q in zip(part.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step_no}: {name}"
        part.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def train_parts(parts, refs, mgr, steps=3):
    gen = torch.Generator().manual_seed(0)
    mgr.start_recording()
    for i in range(steps):
        step(parts, refs, torch.randint(0, 128, (2, 8), generator=gen), i)
        if i == 0:
            mgr.capture()
    return mgr.stats()


def test_two_parts_are_each_graphed_whole():
    parts, refs = two_llamas()
    mgr = PartialCudaGraphManager.from_model_parts(parts, capture_backend=backend, scopes=WIDEST)
    stats = train_parts(parts, refs, mgr)
    assert stats == {
        "captured": 2,
        "disabled": 0,
        "replayed": 4,
        "fallbacks": 0,
        "off_in_model_graph": 4,
    }


def test_a_failed_first_part_does_not_stop_the_second():
    parts, refs = two_llamas()
    first = parts[0]

    def capture(callables, sample_args, sample_kwargs):
        whole = any(c.__qualname__ == "partial[LlamaForCausalLM]" for c in callables)
        if whole and capture.first:
            capture.first = False
            raise CudaGraphCaptureError("first part failed")
        return list(callables)

    capture.first = True
    mgr = PartialCudaGraphManager.from_model_parts(parts, capture_backend=capture, scopes=WIDEST)
    stats = train_parts(parts, refs, mgr)
    assert [e.off_reason for e in mgr.recordings if e.target.module is first] == [
        "model_capture_failed"
    ]
    assert stats["captured"] == 3 and stats["off_in_model_graph"] == 2, stats
    assert stats["replayed"] == 2 * 3, stats


def test_activation_checkpointing_refuses_every_part():
    parts, refs = two_llamas()
    mgr = PartialCudaGraphManager.from_model_parts(
        parts, capture_backend=backend, scopes=WIDEST, activation_checkpointing=True
    )
    stats = train_parts(parts, refs, mgr)
    assert stats["off_model_activation_checkpointing"] == 2 and stats["captured"] == 4, stats


def test_two_parts_refused_for_one_reason_are_counted_twice():
    parts, _ = two_llamas()
    mgr = PartialCudaGraphManager.from_model_parts(
        parts, capture_backend=backend, scopes=WIDEST, include="model.norm"
    )
    assert mgr.stats()["model_refused_include"] == 2


def test_a_part_measured_slower_than_eager_keeps_its_layers(monkeypatch, caplog):
    def verdicts(setting, group, graphed, functions):
        slow = group[0][0].target.kind == "model"
        return [(group[0][0], SpeedVerdict(graph_ms=2.0 if slow else 1.0, eager_ms=1.5))]

    monkeypatch.setattr(graphing_module, "measure_group", verdicts)
    model = tiny("llama")
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=WIDEST)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mgr.start_recording()
    loss_of(model, torch.randint(0, 128, (2, 8))).backward()
    mgr.capture()
    assert [e.off_reason for e in mgr.recordings] == ["slower_than_eager", None, None]
    assert mgr.stats()["captured"] == 2
    (said,) = warnings_of(caplog)
    assert "LlamaForCausalLM (2.000 ms graphed vs 1.500 ms eager)" in said


def test_a_layer_off_for_its_own_reason_stays_so_inside_a_whole_part():
    model = tiny("llama")
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=WIDEST)
    mgr.recordings[1].turn_off("mine")
    mgr.start_recording()
    loss_of(model, torch.randint(0, 128, (2, 8))).backward()
    mgr.capture()
    assert [e.off_reason for e in mgr.recordings] == [None, "mine", "in_model_graph"]


def test_a_dict_valued_experts_implementation_is_read_through_the_part():
    # A config may state the implementation per sub-config ({"": ...} for the main
    # one); reading the key walks the configs above the MoE, from the part itself.
    model = tiny("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    for layer in model.model.layers:
        layer.mlp.experts.config = types.SimpleNamespace(_experts_implementation={"": "grouped_mm"})
    plan = plan_targets(model, scopes=WIDEST)
    assert plan.model_off is None and plan.targets[0].kind == "model"
    for layer in model.model.layers:
        layer.mlp.experts.config._experts_implementation = {"": "eager"}
    assert plan_targets(model, scopes=WIDEST).model_off.reason == "layers_not_whole"


@pytest.mark.parametrize("why, said", [("x.", "x"), ("x", "x"), ("x. ", "x. ")])
def test_only_a_final_stop_is_dropped_from_the_reason(caplog, why, said):
    mgr = PartialCudaGraphManager.from_model_parts(
        tiny("llama"), capture_backend=backend, scopes=WIDEST
    )
    caplog.set_level(logging.WARNING, logger=LOGGER)
    refuse_whole_part(mgr.recordings[0], "model_y", why, logging.getLogger(LOGGER))
    (message,) = warnings_of(caplog)
    assert f"(stats()['off_model_y']): {said}. The targets" in message


def test_planning_says_at_debug_why_a_part_is_not_graphed_whole(caplog):
    moe = tiny("qwen3_moe")
    moe.set_experts_implementation("eager")
    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.planning"):
        off = plan_targets(moe, scopes=WIDEST).model_off
    said = [r.getMessage() for r in caplog.records if "not graphed whole" in r.getMessage()]
    assert said == [f"partial graphs: Qwen3MoeForCausalLM not graphed whole: {off.detail}"]


def test_a_layer_graph_hands_back_its_own_outputs_only_a_whole_part_copies():
    # Copies cost a kernel per output: only a whole part's outputs, which reach the
    # caller's code, are copied; a layer's output goes straight to the next layer.
    kept = {}

    def static_backend(callables, sample_args, sample_kwargs):
        def keep(fn, name):
            def run(*args, **kwargs):
                out = fn(*args, **kwargs)
                buffer = kept.setdefault(name, torch.empty_like(out))
                with torch.no_grad():
                    buffer.copy_(out)
                return buffer

            return run

        return [keep(c, c.__qualname__) for c in callables]

    model = Stack()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=static_backend, scopes=SCOPES
    )
    mgr.start_recording()
    model(torch.ones(2, 4)).sum().backward()
    mgr.capture()
    out = model.layers[0](torch.ones(2, 4), state=None)
    assert out.data_ptr() == kept["partial[layers.0]"].data_ptr()
