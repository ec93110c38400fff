"""Partial graphs' discovery and the grouped-GEMM probe (CPU): one probe per discovery
pass, asked about each grouped_mm layer's experts, and about nothing else. The probe
itself is tested in tests/test_moe_kernels_cpu.py, its answers on a GPU in
test_cuda_partial_kernels.py."""

import pytest

from cudagraphs.moe_kernels import GroupedMMProbe, experts_weight


def asked_weights(monkeypatch):
    asked = []

    def on_device(self, weight):
        asked.append((id(self), weight))
        return True

    monkeypatch.setattr(GroupedMMProbe, "on_device", on_device)
    return asked


def test_discovery_asks_one_probe_about_each_grouped_mm_layers_experts(monkeypatch):
    from cudagraphs.partial.planning import plan_targets
    from cudagraphs.partial.vocabulary import SCOPES
    from helpers.hf_models import tiny

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
    from cudagraphs.partial.planning import plan_targets
    from cudagraphs.partial.vocabulary import SCOPES
    from helpers.hf_models import tiny

    asked = asked_weights(monkeypatch)
    model = tiny("qwen3_moe")
    model.set_experts_implementation(implementation)
    plan_targets(model, scopes=SCOPES)
    assert asked == []
