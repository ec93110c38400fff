"""The "model" scope on the CPU (eager or scripted capture backends): the scope's name
checks, planning (the part as a first target, its refusals with the reason and fix),
the manager graphing a whole HF model with its layers in reserve, capture-time refusals
(failed capture, activation checkpointing, opaque outputs), copies of a whole part's
outputs, and targets called with state (a KV cache) turned off at capture."""

import copy
import logging

import pytest
import torch
from torch import nn

from cudagraphs.errors import CudaGraphCaptureError, CudaGraphsValueError
from cudagraphs.partial import MODEL_SCOPE, SCOPES, PartialCudaGraphManager, check_scopes
from cudagraphs.partial.discovery import discover_blocks
from cudagraphs.partial.graphing import holds_tensors
from cudagraphs.partial.planning import plan_targets
from cudagraphs.partial.vocabulary import ModelScopeOff, Target
from helpers.hf_models import tiny
from helpers.partial_training import backend, loss_of, train_and_compare

WIDEST = (*SCOPES, "model")
LOGGER = "cudagraphs.partial.manager"
LLAMA = "partial[LlamaForCausalLM]"  # the qualname of the whole model's adapter
NAMES = ["LlamaForCausalLM", "model.layers.0", "model.layers.1"]


def totals(captured, replayed, **more):
    return {"captured": captured, "disabled": 0, "replayed": replayed, "fallbacks": 0, **more}


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- the scope's name -----------------------------------------------------------------
def test_model_is_a_scope_alone_or_beside_the_layer_scopes():
    assert MODEL_SCOPE == "model"
    assert check_scopes(("model",)) == ("model",)
    assert check_scopes([*SCOPES, "model"]) == (*SCOPES, "model")


def test_an_unknown_scope_lists_model_and_a_typo_is_corrected():
    with pytest.raises(CudaGraphsValueError) as unknown:
        check_scopes(("layer", "xyz"))
    assert str(unknown.value) == (
        "scopes[1] is 'xyz', not a scope; the scopes are "
        "attention, moe_router, mlp, moe, layer, model"
    )
    with pytest.raises(CudaGraphsValueError, match=r"did you mean 'model'\?"):
        check_scopes(("modle",))
    with pytest.raises(CudaGraphsValueError, match=r"repeats 'model' \(already scopes\[0\]\)"):
        check_scopes(("model", "model"))


# ---- planning -------------------------------------------------------------------------
def test_the_part_is_the_first_target_and_its_layers_follow():
    model = tiny("llama")
    plan = plan_targets(model, scopes=WIDEST)
    assert plan.targets[0] == Target("", model, "model")
    layers = model.model.layers
    assert plan.targets[1:] == [
        Target(f"model.layers.{i}", layers[i], "layer", f"model.layers.{i}") for i in (0, 1)
    ]
    assert plan.model_off is None and plan.skipped == [] and plan.narrowed == []


def test_the_model_scope_alone_is_one_target_and_skips_no_block():
    # Every block lies inside the part graphed whole: none is reported skipped.
    model = tiny("llama")
    plan = plan_targets(model, scopes=("model",))
    assert plan.targets == [Target("", model, "model")]
    assert plan.model_off is None and plan.skipped == [] and plan.narrowed == []


def refusal(part, **kwargs):
    off = plan_targets(part, scopes=WIDEST, **kwargs).model_off
    assert isinstance(off, ModelScopeOff) and "Fix: " in off.detail, off
    return off


def test_include_refuses_the_part_and_keeps_the_layers_and_the_custom_target():
    model = tiny("llama")
    plan = plan_targets(model, scopes=WIDEST, include="model.norm")
    kinds = [(t.name, t.kind) for t in plan.targets]
    assert kinds == [(n, "layer") for n in NAMES[1:]] + [("model.norm", "custom")]
    off = refusal(model, include="model.norm")
    assert (off.part, off.reason) == ("LlamaForCausalLM", "include")
    assert "drop include= or the 'model' scope" in off.detail


def test_a_bare_module_list_of_layers_has_no_forward_to_graph():
    layers = tiny("llama").model.layers
    # Discovery does find the HF layers in a bare ModuleList (a pipeline stage), so
    # the refusal is "no_forward", not "no_blocks"; the layers stay graphed.
    assert [b.name for b in discover_blocks(layers)] == ["0", "1"]
    off = refusal(layers)
    assert (off.part, off.reason) == ("ModuleList", "no_forward")
    assert "pass a module whose forward runs the layers" in off.detail
    assert [t.name for t in plan_targets(layers, scopes=WIDEST).targets] == ["0", "1"]


def test_a_part_without_blocks_is_refused():
    off = refusal(nn.Linear(4, 4))
    assert (off.part, off.reason) == ("Linear", "no_blocks")
    assert "pass the model (or its decoder) as the model part" in off.detail


def test_eager_experts_refuse_the_part_naming_every_narrowed_layer():
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    off = refusal(model)
    assert (off.part, off.reason) == ("Qwen3MoeForCausalLM", "layers_not_whole")
    assert "2 block(s) of Qwen3MoeForCausalLM" in off.detail
    assert "(model.layers.0, model.layers.1;" in off.detail
    assert "experts_implementation='grouped_mm'" in off.detail


# ---- the manager ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_whole_model_trains_equal_to_eager_with_its_layers_off(family):
    model = tiny(family)
    if family == "qwen3_moe":
        # CPU weights: GroupedMMProbe asks no question of them (on_device is True).
        model.set_experts_implementation("grouped_mm")
    ref = copy.deepcopy(model)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=WIDEST)
    try:
        part = type(model).__name__
        assert [e.name for e in mgr.recordings] == [part, "model.layers.0", "model.layers.1"]
        assert [e.target.kind for e in mgr.recordings] == ["model", "layer", "layer"]
        assert mgr.model_off == [] and mgr.narrowed == [] and mgr.skipped == []
        assert train_and_compare(model, ref, mgr) == totals(1, 2, off_in_model_graph=2)
        assert [e.off_reason for e in mgr.recordings] == [None, "in_model_graph", "in_model_graph"]
        # Another length runs the whole part eagerly (its layers too), counted once.
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        assert torch.equal(loss_of(model, ids), loss_of(ref, ids))
        assert mgr.stats()["fallback_shape"] == 1 and mgr.stats()["fallbacks"] == 1
    finally:
        mgr.close()


MOE_PIECES = [f"model.layers.{i}.{n}" for i in (0, 1) for n in ("self_attn", "mlp.gate")]
REFUSALS = {  # reason: family, from_model_parts arguments, the targets kept
    "include": ("llama", {"include": "model.norm"}, [*NAMES[1:], "model.norm"]),
    "layers_not_whole": ("qwen3_moe", {}, MOE_PIECES),
}


@pytest.mark.parametrize("reason", list(REFUSALS))
def test_a_planning_refusal_is_kept_counted_and_said(caplog, reason):
    family, kwargs, entries = REFUSALS[reason]
    model = tiny(family)
    if family == "qwen3_moe":
        model.set_experts_implementation("eager")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mgr = PartialCudaGraphManager.from_model_parts(
            model, capture_backend=backend, scopes=WIDEST, **kwargs
        )
    assert [e.name for e in mgr.recordings] == entries
    (off,) = mgr.model_off
    assert off == plan_targets(model, scopes=WIDEST, **kwargs).model_off
    assert mgr.stats()[f"model_refused_{reason}"] == 1
    said = [m for m in warnings_of(caplog) if "is not graphed whole" in m]
    part = type(model).__name__
    assert said == [
        f"partial graphs: {part} is not graphed whole "
        f"(stats()['model_refused_{reason}']): {off.detail}"
    ]
    mgr.close()


@pytest.mark.usefixtures("process_group")
def test_fsdp2_refuses_the_part_and_graphs_its_layers():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    model = tiny("llama")
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=WIDEST)
    assert [e.name for e in mgr.recordings] == NAMES[1:]
    assert [e.fsdp for e in mgr.recordings] == [True, True]
    (off,) = mgr.model_off
    # fully_shard swaps in a subclass: the part is named by that class.
    assert (off.part, off.reason) == ("FSDPLlamaForCausalLM", "fsdp")
    assert "unshard hooks would run inside one graph" in off.detail
    assert mgr.stats()["model_refused_fsdp"] == 1
    mgr.close()


# ---- capture-time refusals ------------------------------------------------------------
def scripted(model_graph):
    """A backend that hands the whole model's adapter to ``model_graph`` (recording
    every qualname it sees in ``.seen``) and returns the layers' adapters as they are."""

    def capture(callables, sample_args, sample_kwargs):
        capture.seen += [c.__qualname__ for c in callables]
        return [model_graph(c) if c.__qualname__ == LLAMA else c for c in callables]

    capture.seen = []
    return capture


def layers_graphed(caplog, reason, **kwargs):
    """Train tiny llama, the model refused at capture for ``reason``: its WARNING."""
    model = tiny("llama")
    ref = copy.deepcopy(model)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mgr = PartialCudaGraphManager.from_model_parts(model, scopes=WIDEST, **kwargs)
    try:
        assert train_and_compare(model, ref, mgr) == totals(2, 4, **{f"off_{reason}": 1})
        assert [e.off_reason for e in mgr.recordings] == [reason, None, None]
        assert mgr.recordings[0].graphs() == [] and mgr.model_off == []
    finally:
        mgr.close()
    (said,) = [m for m in warnings_of(caplog) if "is not graphed whole" in m]
    head = f"partial graphs: LlamaForCausalLM is not graphed whole (stats()['off_{reason}']): "
    assert said.startswith(head)
    assert said.endswith("from the next recorded step on).")
    return said


def test_a_failed_capture_of_the_model_graphs_its_layers(caplog):
    def fail(adapter):
        raise CudaGraphCaptureError("capture of the model failed: a host sync")

    capture = scripted(fail)
    said = layers_graphed(caplog, "model_capture_failed", capture_backend=capture)
    assert "CudaGraphCaptureError: capture of the model failed: a host sync" in said
    assert capture.seen == [LLAMA, "partial[model.layers.0]", "partial[model.layers.1]"]


def test_activation_checkpointing_graphs_the_layers_and_never_the_model(caplog):
    capture = scripted(lambda adapter: pytest.fail("the model was captured"))
    reason = "model_activation_checkpointing"
    said = layers_graphed(caplog, reason, capture_backend=capture, activation_checkpointing=True)
    assert "activation checkpointing is on" in said
    # One pool per call under checkpointing: the layers come one group each.
    assert capture.seen == ["partial[model.layers.0]", "partial[model.layers.1]"]


class FakeGraph:
    """A graphed callable's face: ``graphs.out_leaves``, and calls run the adapter."""

    def __init__(self, adapter, leaves):
        self.adapter, self.graphs = adapter, type("Graphs", (), {"out_leaves": leaves})()

    def __call__(self, *args, **kwargs):
        return self.adapter(*args, **kwargs)


def test_an_opaque_output_of_the_model_graphs_its_layers(caplog):
    capture = scripted(lambda adapter: FakeGraph(adapter, [torch.zeros(1), object()]))
    said = layers_graphed(caplog, "model_opaque_output", capture_backend=capture)
    assert "its forward returns object object(s)" in said
    assert "call the model with use_cache=False" in said


def test_a_model_refused_at_a_later_capture_keeps_its_layers_in_reserve(caplog):
    fail = {"now": False}

    def model_graph(adapter):
        if fail["now"]:
            raise CudaGraphCaptureError("second variant failed")
        return adapter

    model = tiny("llama")
    capture = scripted(model_graph)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=capture, scopes=WIDEST)
    assert train_and_compare(model, copy.deepcopy(model), mgr)["off_in_model_graph"] == 2
    fail["now"] = True
    mgr.start_recording()
    loss_of(model, torch.randint(0, 128, (2, 12))).backward()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mgr.capture()
    assert any("from the next recorded step on" in m for m in warnings_of(caplog))
    # What that warning says: the layers are back in reserve, not off inside a
    # graph that no longer exists; the next recorded step graphs them.
    assert [e.off_reason for e in mgr.recordings] == ["model_capture_failed", None, None]
    mgr.start_recording()
    loss_of(model, torch.randint(0, 128, (2, 12))).backward()
    mgr.capture()
    stats = mgr.stats()
    assert stats["captured"] == 2 and "off_in_model_graph" not in stats, stats
    mgr.close()


# ---- outputs are copies ---------------------------------------------------------------
class StaticGraph:
    """Like a real graph: each call writes the logits into one static buffer and
    returns an output holding that buffer."""

    def __init__(self, adapter):
        self.adapter, self.logits = adapter, None

    def __call__(self, *args, **kwargs):
        out = self.adapter(*args, **kwargs)
        if self.logits is None:
            self.logits = torch.empty_like(out.logits)
        self.logits.copy_(out.logits)  # autograd flows through the copy
        return type(out)(logits=self.logits)


def test_outputs_of_a_whole_model_are_copies_that_outlive_the_next_call():
    model = tiny("llama")
    ref = copy.deepcopy(model)
    graphs = []
    capture = scripted(lambda adapter: graphs.append(StaticGraph(adapter)) or graphs[-1])
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=capture, scopes=WIDEST)
    gen = torch.Generator().manual_seed(2)
    first, second, third = (torch.randint(0, 128, (2, 8), generator=gen) for _ in range(3))
    try:
        mgr.start_recording()
        loss_of(model, first).backward()
        mgr.capture()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=second, use_cache=False)
        assert type(out).__name__ == "CausalLMOutputWithPast"
        kept, kept_values = out.logits, out.logits.detach().clone()
        later = model(input_ids=third, use_cache=False).logits
        (static,) = graphs  # its buffer holds the latest call's logits, handed back copied
        assert static.logits.data_ptr() not in (kept.data_ptr(), later.data_ptr())
        assert torch.equal(static.logits, later) and not torch.equal(kept, later)
        assert torch.equal(kept, kept_values)
        ref_kept = ref(input_ids=second, use_cache=False).logits
        ref_later = ref(input_ids=third, use_cache=False).logits
        assert torch.equal(kept, ref_kept) and torch.equal(later, ref_later)
        (kept.pow(2).mean() + later.pow(2).mean()).backward()
        (ref_kept.pow(2).mean() + ref_later.pow(2).mean()).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name
        assert mgr.stats()["replayed"] == 2 and mgr.stats()["fallbacks"] == 0
    finally:
        mgr.close()


# ---- state in arguments ---------------------------------------------------------------
class Obj:
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_holds_tensors_finds_tensors_in_objects_and_containers():
    t = torch.zeros(2)
    assert holds_tensors(t)
    cache = Obj(layers=[Obj(keys=t, values=t)])  # a DynamicCache's shape: 3 levels down
    assert holds_tensors(Obj(keys=t)) and holds_tensors(cache)
    assert holds_tensors({"k": t}) and holds_tensors((1, t)) and holds_tensors([None, t])
    for plain in (None, 0, 3, 2.5, True, "text", b"x", Obj(n=7), Obj(layers=[Obj(k="k")]), ()):
        assert not holds_tensors(plain), plain
    assert not holds_tensors({}) and not holds_tensors(cache, depth=2)  # beyond depth
    assert not holds_tensors(Obj(a=Obj(b=t)), depth=1)
    assert holds_tensors(Obj(a=Obj(b=t)), depth=2)


def test_a_kv_cache_in_the_layers_arguments_turns_them_off_at_capture(caplog):
    # use_cache left at the config's True: HF hands each layer a DynamicCache while
    # training, state the layer changes and no graph can follow.
    model = tiny("llama")
    ref = copy.deepcopy(model)
    assert model.training and model.config.use_cache
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=SCOPES)
    gen = torch.Generator().manual_seed(3)
    try:
        mgr.start_recording()
        for step in range(3):
            ids = torch.randint(0, 128, (2, 8), generator=gen)
            out, ref_out = model(input_ids=ids), ref(input_ids=ids)
            assert type(out.past_key_values).__name__ == "DynamicCache"
            loss, ref_loss = out.logits.pow(2).mean(), ref_out.logits.pow(2).mean()
            assert torch.equal(loss, ref_loss), step
            loss.backward()
            ref_loss.backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            if step == 0:
                mgr.capture()
        assert mgr.stats() == totals(0, 0, off_stateful_argument=2)
        assert [e.off_reason for e in mgr.recordings] == ["stateful_argument"] * 2
    finally:
        mgr.close()
    said = [m for m in warnings_of(caplog) if "DynamicCache" in m]
    assert len(said) == 2, said
    for name, message in zip(NAMES[1:], said):
        assert message.startswith(f"partial graphs: {name} is called with DynamicCache object")
        assert "call the model with use_cache=False" in message
