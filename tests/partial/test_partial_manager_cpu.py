"""PartialCudaGraphManager's recording, dispatch and fallback logic on the CPU, with an
eager capture backend standing in for the core (GPU runs use the real one)."""

import copy
import logging

import pytest
import torch
from torch import nn

from cudagraphs.errors import CudaGraphInputError, CudaGraphsStateError, CudaGraphsValueError
from cudagraphs.partial import PartialCudaGraphManager, TargetSelectionError
from helpers.hf_models import tiny
from helpers.partial_manager import NARROW, eager_backend, pinning_backend, recorded, step
from helpers.toy_models import Attn, Toy


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_replays_match_eager_outputs_and_gradients(kind):
    model, ref = tiny(kind), None
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mgr = recorded(model, ids)
    out, ref_out = step(model, ids), step(ref, ids)
    assert torch.equal(out, ref_out)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    stats = mgr.stats()
    targets = 2 if kind == "llama" else 4  # attention (+ router) per layer
    assert stats["captured"] == targets and stats["replayed"] == targets
    assert stats["fallbacks"] == 0
    mgr.close()


def test_a_new_sequence_length_falls_back_and_is_counted():
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    step(model, torch.randint(0, 128, (1, 12)))
    assert mgr.stats() == {
        "captured": 2,
        "disabled": 0,
        "replayed": 0,
        "fallbacks": 2,
        "fallback_shape": 2,
    }
    step(model, torch.randint(0, 128, (1, 8)))
    assert mgr.stats()["replayed"] == 2


def test_eval_mode_falls_back_with_reason_training():
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    model.eval()  # grad stays enabled: only the training flag differs
    model(input_ids=torch.randint(0, 128, (1, 8)), use_cache=False)
    assert mgr.stats() == {
        "captured": 2,
        "disabled": 0,
        "replayed": 0,
        "fallbacks": 2,
        "fallback_training": 2,
    }


def test_no_grad_evaluation_falls_back_first_on_requires_grad():
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 8)), use_cache=False)
    # Hidden states no longer require grad, which REASONS orders before grad_mode.
    assert mgr.stats()["fallback_requires_grad"] == 2


def test_a_second_recording_adds_a_variant():
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    mgr.start_recording()
    step(model, torch.randint(0, 128, (1, 12)))
    mgr.capture()
    step(model, torch.randint(0, 128, (1, 12)))
    step(model, torch.randint(0, 128, (1, 8)))
    stats = mgr.stats()
    assert stats["captured"] == 4 and stats["replayed"] == 4
    # Only the recording iteration at the new length ran eagerly: its call was
    # recorded (a new variant) before any graph existed for it.
    assert stats["fallbacks"] == 2 and stats["fallback_not_captured"] == 2


def test_variants_are_bounded():
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], max_variants=1, capture_backend=eager_backend, scopes=NARROW
    )
    for seq in (8, 12):
        mgr.start_recording()
        step(model, torch.randint(0, 128, (1, seq)))
        mgr.capture()
    assert mgr.stats()["captured"] == 2  # one variant per target; seq 12 was refused
    step(model, torch.randint(0, 128, (1, 12)))
    # 2 from the refused recording iteration, 2 from this step.
    assert mgr.stats()["fallback_shape"] == 4


def test_parameters_are_explicit_graph_inputs():
    eager_backend.calls.clear()
    model = tiny()
    recorded(model, torch.randint(0, 128, (1, 8)))
    count, sample_args, _ = eager_backend.calls[-1]
    attn = model.model.layers[0].self_attn
    params = sample_args[0][0]
    assert count == 2
    assert [id(p) for p in params] == [id(p) for p in attn.parameters()]


def test_capture_without_recording_is_an_error():
    mgr = PartialCudaGraphManager.from_model_parts(
        [tiny()], capture_backend=eager_backend, scopes=NARROW
    )
    with pytest.raises(CudaGraphsStateError, match="nothing was recorded"):
        mgr.capture()


def test_a_target_called_twice_per_forward_is_rejected_at_capture():
    model = Toy(twice=True)
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    with pytest.raises(TargetSelectionError, match=r"layers\.0\.self_attn.*more than once"):
        mgr.capture()


def test_meta_parameters_are_refused_before_capture():
    with torch.device("meta"):
        model = Toy()
    with pytest.raises(
        CudaGraphsValueError, match=r"layers\.0\.self_attn\.q\.weight is on the meta device"
    ):
        PartialCudaGraphManager.from_model_parts(
            [model], capture_backend=eager_backend, scopes=NARROW
        )


def test_nothing_graphable_returns_none_and_logs(caplog):
    # Issue 13: a model that silently trains without graphs is said at WARNING.
    with caplog.at_level(logging.INFO, logger="cudagraphs.partial.manager"):
        assert PartialCudaGraphManager.from_model_parts([nn.Linear(2, 2)], scopes=NARROW) is None
    assert "nothing graphable" in caplog.text
    (record,) = [r for r in caplog.records if "nothing graphable" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "Linear with 0 block(s)" in record.getMessage() and "include=" in record.getMessage()


def test_close_restores_eager_modules_and_is_idempotent():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    assert "forward" in model.layers[0].self_attn.__dict__
    mgr.close()
    mgr.close()
    assert "forward" not in model.layers[0].self_attn.__dict__
    assert model.layers[0].self_attn._forward_pre_hooks == {}
    with pytest.raises(CudaGraphsStateError, match="closed"):
        mgr.start_recording()


def _captured_toy():
    """A Toy and its manager (the pinning stand-in backend), recorded and captured."""
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=pinning_backend, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    return model, mgr


@pytest.mark.parametrize("replacement", ["parameter", "plain_tensor"])
def test_a_parameter_object_replaced_after_capture_falls_back_and_trains_the_new_one(
    caplog, replacement
):
    # load_state_dict(assign=True) or layer.weight = nn.Parameter(...): the graph must
    # not read the old parameter (stale weights, the new one left without a gradient).
    model, mgr = _captured_toy()
    q = model.layers[0].self_attn.q
    new = torch.randn(8, 8)
    if replacement == "parameter":
        q.weight = nn.Parameter(new.clone())
    else:  # a plain tensor attribute now: no longer a parameter of the module
        del q.weight
        q.weight = new.clone().requires_grad_()
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        out = model(x)
    assert mgr.stats()["fallback_param_storage"] == 1, mgr.stats()
    out.sum().backward()
    assert q.weight.grad is not None  # the new weight is the one trained
    mgr.close()
    assert torch.equal(out, model(x))


def test_a_parameter_deleted_after_capture_falls_back_naming_it(caplog):
    model, mgr = _captured_toy()
    q = model.layers[0].self_attn.q
    del q.weight
    q.weight = None  # a forward that reads it fails eagerly, as without graphs
    with (
        caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"),
        pytest.raises(Exception) as err,
    ):
        model(torch.randn(2, 8))
    assert not isinstance(err.value, CudaGraphInputError)  # the eager forward's own error
    assert mgr.stats()["fallback_param_storage"] == 1
    (said,) = fallback_warnings(caplog, "param_storage")
    assert "'weight' of Linear is no longer a parameter (now NoneType)" in said.getMessage()
    mgr.close()


def test_a_replaced_parameter_storage_falls_back_with_its_reason(caplog):
    model, mgr = _captured_toy()
    model(torch.randn(2, 8))
    assert mgr.stats()["replayed"] == 2
    model.layers[0].self_attn.q.weight.data = torch.randn(8, 8)  # e.g. a reshard
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        out = model(x)
        stats = mgr.stats()
        assert stats["fallback_param_storage"] == 1 and stats["replayed"] == 3
        model(x)
    assert mgr.stats()["fallback_param_storage"] == 2 and mgr.stats()["replayed"] == 4
    (said,) = fallback_warnings(caplog, "param_storage")
    text = said.getMessage()
    assert "layers.0.self_attn ran eagerly" in text and "parameter re-allocated" in text
    mgr.close()
    assert torch.equal(out, model(x))  # the fallback ran the real (eager) module


def test_checkpoint_recompute_is_not_a_second_call_and_gets_a_pool_per_target():
    model = tiny()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    eager_backend.calls.clear()
    mgr = recorded(model, ids)  # the recompute in backward must not count as a call
    assert mgr.activation_checkpointing, "the recompute should have been noticed"
    assert [n for n, _, _ in eager_backend.calls] == [1, 1], "one capture per target"
    out, ref_out = step(model, ids), step(ref, ids)
    assert torch.equal(out, ref_out)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    stats = mgr.stats()
    # Each target replays twice per step: the forward and its recompute in backward.
    assert stats["replayed"] == 4 and stats["fallbacks"] == 0, stats
    mgr.close()


# --- quiet eager runs are said once per cause (issue 13) ------------------------------


def fallback_warnings(caplog, reason):
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and f"ran eagerly (reason {reason!r})" in r.getMessage()
    ]


def test_each_fallback_reason_is_said_once_and_every_fallback_counted(caplog):
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        for _ in range(3):
            step(model, torch.randint(0, 128, (1, 12)))
        model.eval()
        for _ in range(2):
            model(input_ids=torch.randint(0, 128, (1, 8)), use_cache=False)
        model.train()
        step(model, torch.randint(0, 128, (1, 8)))
    stats = mgr.stats()
    # 2 targets: 3 steps at a new length, 2 forwards in eval mode, then one replayed step.
    assert stats["fallback_shape"] == 6 and stats["fallback_training"] == 4
    assert stats["fallbacks"] == 10 and stats["replayed"] == 2
    (shape,) = fallback_warnings(caplog, "shape")
    (training,) = fallback_warnings(caplog, "training")
    text = shape.getMessage()
    assert "model.layers.0.self_attn ran eagerly" in text, "names the first target"
    assert "kwargs['hidden_states']: shape expected (1, 8, 64), received (1, 12, 64)" in text
    assert "stats()['fallback_shape']" in text and "not logged again" in text
    assert "module.training: training expected True, received False" in training.getMessage()
    ours = [r for r in caplog.records if r.name == "cudagraphs.partial.manager"]
    assert len(ours) == 2, [r.getMessage() for r in ours]
    mgr.close()


def test_the_report_is_built_only_for_the_first_fallback_of_a_cause(monkeypatch):
    from cudagraphs.partial import ContractSet

    built = []
    original = ContractSet.mismatches

    def counting(self, *args, **kwargs):
        built.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ContractSet, "mismatches", counting)
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    for _ in range(3):
        step(model, torch.randint(0, 128, (1, 8)))
    assert built == [] and mgr.stats()["replayed"] == 6, "replays build no report"
    for _ in range(3):
        step(model, torch.randint(0, 128, (1, 12)))
    assert len(built) == 1 and mgr.stats()["fallback_shape"] == 6
    mgr.close()


def test_warnings_are_once_per_manager_not_per_process(caplog):
    model = tiny()
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        for _ in range(2):
            mgr = recorded(model, torch.randint(0, 128, (1, 8)))
            step(model, torch.randint(0, 128, (1, 12)))
            step(model, torch.randint(0, 128, (1, 12)))
            mgr.close()
            model.zero_grad(set_to_none=True)
    assert len(fallback_warnings(caplog, "shape")) == 2


def test_not_captured_fallback_is_said_once(caplog):
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        mgr.start_recording()
        step(model, torch.randint(0, 128, (1, 12)))  # recorded: runs eagerly
        mgr.capture()
    assert mgr.stats()["fallback_not_captured"] == 2
    (record,) = fallback_warnings(caplog, "not_captured")
    assert "recorded but not captured yet" in record.getMessage()
    assert "model.layers.0.self_attn" in record.getMessage()


def test_variants_full_is_said_once(caplog):
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, max_variants=1, capture_backend=eager_backend, scopes=NARROW
    )
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        for seq in (8, 12, 16):
            mgr.start_recording()
            step(model, torch.randint(0, 128, (1, seq)))
            mgr.capture()
    full = [r for r in caplog.records if "already has max_variants=1" in r.getMessage()]
    assert len(full) == 1, "4 refused recordings (2 targets x 2 steps), said once"
    assert "model.layers.0.self_attn" in full[0].getMessage()
    assert mgr.stats()["fallback_shape"] == 4


# --- CUDAGRAPHS_DISABLE=1 --------------------------------------------------------------


def refusing_backend(callables, sample_args, sample_kwargs):
    raise AssertionError("a graphing backend ran under CUDAGRAPHS_DISABLE=1")


@pytest.fixture
def disabled(monkeypatch):
    import cudagraphs.core

    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    # The default backend resolves the core helper at capture: refuse it too.
    monkeypatch.setattr(cudagraphs.core, "make_graphed_callables", refusing_backend)


@pytest.mark.parametrize("backend", [None, refusing_backend], ids=["default", "given"])
def test_disabled_runs_every_target_eagerly_through_the_same_path(disabled, caplog, backend):
    model = tiny("qwen3_moe")
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 8), generator=gen) for _ in range(3)]
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend, scopes=NARROW)
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        mgr.start_recording()
        for i, ids in enumerate(batches):
            assert torch.equal(step(model, ids), step(ref, ids)), f"step {i}: output"
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if p.grad is not None:
                    assert torch.equal(p.grad, q.grad), f"step {i}: grad of {name}"
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            if i == 0:
                mgr.capture()
        step(model, torch.randint(0, 128, (2, 12)))  # contract matching still runs
        mgr.start_recording()  # a second capture: no second "disabled" warning
        step(model, torch.randint(0, 128, (2, 12)))
        mgr.capture()
    stats = mgr.stats()
    # 4 targets (attention + router per layer): 2 matching steps, then one new length.
    assert stats["disabled"] == 1 and stats["captured"] == 0, stats
    assert stats["replayed"] == 8 and stats["fallback_shape"] == 4, stats
    for rec in mgr.recordings:
        # The "graph" is the target's graphed function itself, run eagerly.
        assert [g.__qualname__ for g in rec.graphs()] == [f"partial[{rec.name}]"] * 2
    said = [r for r in caplog.records if "partial graphs are disabled" in r.getMessage()]
    assert len(said) == 1 and "CUDAGRAPHS_DISABLE=1" in said[0].getMessage()
    assert len(fallback_warnings(caplog, "shape")) == 1
    mgr.close()


def test_disabled_is_zero_when_graphs_are_on(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    model = tiny()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=eager_backend, scopes=NARROW
    )
    assert mgr.stats()["disabled"] == 0
    mgr.start_recording()
    step(model, torch.randint(0, 128, (1, 8)))
    mgr.capture()
    assert mgr.stats()["disabled"] == 0 and mgr.stats()["captured"] == 2


def test_disabled_flag_changed_between_captures_is_refused(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    mgr.start_recording()
    step(model, torch.randint(0, 128, (1, 12)))
    with pytest.raises(CudaGraphsStateError, match="CUDAGRAPHS_DISABLE changed"):
        mgr.capture()
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "0")
    mgr.capture()  # refused without side effects: the recorded variant captures now
    assert mgr.stats()["captured"] == 4
    mgr.close()


# --- what from_model_parts accepts ------------------------------------------------------


def test_a_single_module_is_one_model_part():
    model = tiny("qwen3_moe")
    one = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=eager_backend, scopes=NARROW
    )
    many = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=eager_backend, scopes=NARROW
    )
    assert [e.name for e in one.recordings] == [e.name for e in many.recordings]
    assert len(one.recordings) == 4


def test_include_string_graphs_the_named_modules_and_equals_eager():
    model = tiny()
    ref = copy.deepcopy(model)
    mgr = PartialCudaGraphManager.from_model_parts(
        model, scopes=("moe_router",), include="model.layers.*.mlp", capture_backend=eager_backend
    )
    assert [e.name for e in mgr.recordings] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, 128, (2, 8))
    mgr.start_recording()
    step(model, ids)
    mgr.capture()
    model.zero_grad(set_to_none=True)
    assert torch.equal(step(model, ids), step(ref, ids))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert mgr.stats()["replayed"] == 2 and mgr.stats()["fallbacks"] == 0
    mgr.close()


def test_nothing_found_reasons(caplog):
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        assert PartialCudaGraphManager.from_model_parts([], scopes=NARROW) is None
        assert PartialCudaGraphManager.from_model_parts(tiny(), scopes=("moe_router",)) is None
        assert (
            PartialCudaGraphManager.from_model_parts(
                tiny(), include="no.such.module", scopes=NARROW
            )
            is not None
        )
        assert PartialCudaGraphManager.from_model_parts(tiny(), scopes=(), include=None) is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 3
    assert "no model parts were given" in said[0]
    assert "LlamaForCausalLM with 2 block(s), looking for scopes moe_router" in said[1]
    assert "nothing asked for" in said[2]


class BadRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


class CtlBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attn()

    def forward(self, x, ctl):
        return x + self.self_attn(x, attention_mask=ctl)


def test_a_failing_report_still_warns_and_runs_the_module(caplog):
    layers = nn.ModuleList([CtlBlock(), CtlBlock()])
    mgr = PartialCudaGraphManager.from_model_parts(
        layers, capture_backend=eager_backend, scopes=NARROW
    )
    x, ctl = torch.randn(2, 8), BadRepr()
    mgr.start_recording()
    layers[0](x, ctl)
    mgr.capture()
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        out = layers[0](x, BadRepr())  # another object: a control difference
    assert mgr.stats()["fallback_control"] == 1
    (said,) = fallback_warnings(caplog, "control")
    assert said.getMessage().startswith("partial graphs: 0.self_attn ran eagerly")
    assert "report failed (RuntimeError: no repr)" in said.getMessage()
    mgr.close()
    assert torch.equal(out, layers[0](x, ctl))
