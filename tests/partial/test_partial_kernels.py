"""The grouped-GEMM probe (CPU): which weight it reads, which devices it asks about,
that it asks torch once per (dtype, device), and that it leaves the sync debug mode as
it found it. Its answers on a GPU are checked in test_cuda_partial_kernels.py."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from cudagraphs.partial import kernels
from cudagraphs.partial.kernels import GroupedMMProbe, experts_weight


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.index = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
        self.gate_up = nn.Parameter(torch.zeros(2, 4, 4, dtype=torch.bfloat16))


class Moe(nn.Module):
    def __init__(self, experts=True):
        super().__init__()
        self.gate = nn.Linear(4, 2)  # float32: must not be the weight read
        if experts:
            self.experts = Experts()


def test_experts_weight_is_the_first_floating_parameter_of_the_experts_child():
    moe = Moe()
    assert experts_weight(moe) is moe.experts.gate_up


def test_experts_weight_falls_back_to_the_module_itself_and_to_none():
    moe = Moe(experts=False)
    assert experts_weight(moe) is moe.gate.weight
    assert experts_weight(nn.ReLU()) is None


def test_weights_off_cuda_and_no_weight_raise_no_question(monkeypatch):
    asked = []
    monkeypatch.setattr(kernels, "_runs_on_device", lambda *key: asked.append(key))
    probe = GroupedMMProbe()
    assert probe.on_device(None) is True
    assert probe.on_device(torch.zeros(2)) is True
    assert probe.on_device(torch.zeros(2, device="meta")) is True
    assert asked == []


@pytest.mark.parametrize("answer", [True, False])
def test_torch_is_asked_once_per_dtype_and_device(monkeypatch, answer):
    asked = []

    def runs(dtype, device):
        asked.append((dtype, device))
        return answer

    monkeypatch.setattr(kernels, "_runs_on_device", runs)
    probe = GroupedMMProbe()
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    weights = [
        SimpleNamespace(dtype=torch.bfloat16, device=cuda0),
        SimpleNamespace(dtype=torch.bfloat16, device=cuda0),
        SimpleNamespace(dtype=torch.float32, device=cuda0),
        SimpleNamespace(dtype=torch.bfloat16, device=cuda1),
    ]
    assert [probe.on_device(w) for w in weights] == [answer] * 4
    assert asked == [(torch.bfloat16, cuda0), (torch.float32, cuda0), (torch.bfloat16, cuda1)]
    # A second probe (the next discovery pass) asks again: answers are not global.
    GroupedMMProbe().on_device(weights[0])
    assert len(asked) == 4


def test_without_grouped_mm_in_torch_the_answer_is_no(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert kernels._runs_on_device(torch.bfloat16, torch.device("cuda", 0)) is False


def asked_weights(monkeypatch):
    asked = []

    def on_device(self, weight):
        asked.append((id(self), weight))
        return True

    monkeypatch.setattr(GroupedMMProbe, "on_device", on_device)
    return asked


def test_discovery_asks_one_probe_about_each_grouped_mm_layers_experts(monkeypatch):
    from _hf_models import tiny
    from cudagraphs.partial.planning import plan_targets
    from cudagraphs.partial.scopes import SCOPES

    asked = asked_weights(monkeypatch)
    model = tiny("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    plan_targets(model, scopes=SCOPES)
    layers = model.model.layers
    assert len(asked) == len(layers)
    assert all(w is experts_weight(layer.mlp) for (_, w), layer in zip(asked, layers))
    assert all(w is not None for _, w in asked)
    assert len({probe for probe, _ in asked}) == 1, "one probe per discovery pass"


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_other_experts_implementations_raise_no_device_question(monkeypatch, implementation):
    from _hf_models import tiny
    from cudagraphs.partial.planning import plan_targets
    from cudagraphs.partial.scopes import SCOPES

    asked = asked_weights(monkeypatch)
    model = tiny("qwen3_moe")
    model.set_experts_implementation(implementation)
    plan_targets(model, scopes=SCOPES)
    assert asked == []
