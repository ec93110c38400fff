"""PartialCudaGraphManager's recording, dispatch and fallback logic on the CPU, with an
eager capture backend standing in for the core (GPU runs use the real one)."""

import copy
import logging

import pytest
import torch
from torch import nn

from cudagraphs.partial import PartialCudaGraphManager, TargetSelectionError

transformers = pytest.importorskip("transformers")

from _hf_models import tiny  # noqa: E402


def eager_backend(callables, sample_args, sample_kwargs):
    eager_backend.calls.append((len(callables), sample_args, sample_kwargs))
    return list(callables)


eager_backend.calls = []


def step(model, ids):
    out = model(input_ids=ids, use_cache=False).logits
    out.float().pow(2).mean().backward()
    return out.detach()


def recorded(model, ids):
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=eager_backend)
    mgr.start_recording()
    step(model, ids)
    mgr.capture()
    model.zero_grad(set_to_none=True)
    return mgr


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
    assert mgr.stats() == {"captured": 2, "replayed": 0, "fallbacks": 2, "fallback_shape": 2}
    step(model, torch.randint(0, 128, (1, 8)))
    assert mgr.stats()["replayed"] == 2


def test_eval_mode_falls_back_with_reason_training():
    model = tiny()
    mgr = recorded(model, torch.randint(0, 128, (1, 8)))
    model.eval()  # grad stays enabled: only the training flag differs
    model(input_ids=torch.randint(0, 128, (1, 8)), use_cache=False)
    assert mgr.stats() == {"captured": 2, "replayed": 0, "fallbacks": 2, "fallback_training": 2}


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
        [model], max_variants=1, capture_backend=eager_backend
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
    mgr = PartialCudaGraphManager.from_model_parts([tiny()], capture_backend=eager_backend)
    with pytest.raises(RuntimeError, match="nothing was recorded"):
        mgr.capture()


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None):
        return self.o(torch.tanh(self.q(hidden_states)))


class Block(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.self_attn, self.twice = Attn(), twice

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.self_attn(x) if self.twice else x


class Toy(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        self.layers = nn.ModuleList([Block(twice), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_target_called_twice_per_forward_is_rejected_at_capture():
    model = Toy(twice=True)
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=eager_backend)
    mgr.start_recording()
    model(torch.randn(2, 8))
    with pytest.raises(TargetSelectionError, match=r"layers\.0\.self_attn.*more than once"):
        mgr.capture()


def test_meta_parameters_are_refused_before_capture():
    with torch.device("meta"):
        model = Toy()
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q\.weight is on the meta device"):
        PartialCudaGraphManager.from_model_parts([model], capture_backend=eager_backend)


def test_nothing_graphable_returns_none_and_logs(caplog):
    with caplog.at_level(logging.INFO, logger="cudagraphs.partial.manager"):
        assert PartialCudaGraphManager.from_model_parts([nn.Linear(2, 2)]) is None
    assert "nothing graphable" in caplog.text


def test_close_restores_eager_modules_and_is_idempotent():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=eager_backend)
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    assert "forward" in model.layers[0].self_attn.__dict__
    mgr.close()
    mgr.close()
    assert "forward" not in model.layers[0].self_attn.__dict__
    assert model.layers[0].self_attn._forward_pre_hooks == {}
    with pytest.raises(RuntimeError, match="closed"):
        mgr.start_recording()


def test_a_replaced_parameter_storage_falls_back_with_its_reason():
    from cudagraphs import CudaGraphInputError

    def pinning_backend(callables, sample_args, sample_kwargs):
        # Like the core: the graph reads its parameters in place and refuses a call
        # whose parameters were re-allocated since capture.
        graphs = []
        for fn, args in zip(callables, sample_args):
            ptrs = [p.data_ptr() for p in args[0]]

            def graphed(params, *a, _fn=fn, _ptrs=ptrs, **kw):
                if [p.data_ptr() for p in params] != _ptrs:
                    raise CudaGraphInputError("parameter re-allocated")
                return _fn(params, *a, **kw)

            graphs.append(graphed)
        return graphs

    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts([model], capture_backend=pinning_backend)
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    model(torch.randn(2, 8))
    assert mgr.stats()["replayed"] == 2
    model.layers[0].self_attn.q.weight.data = torch.randn(8, 8)  # e.g. a reshard
    x = torch.randn(2, 8)
    out = model(x)
    stats = mgr.stats()
    assert stats["fallback_param_storage"] == 1 and stats["replayed"] == 3
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
