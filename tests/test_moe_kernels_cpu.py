"""cudagraphs.moe_kernels on the CPU: the grouped-GEMM probe (which weight it reads,
which devices it asks about, once per (dtype, device)), the experts implementation read
from tiny float32 OLMoE / Qwen3-MoE / Mixtral models, the syncing rule against its
reference, the scan (only grouped_mm experts with CUDA weights are asked about; every
syncing experts module named once), and the refusal's text (what, where, the numbered
fixes). Its probe's answers on a GPU are checked in
tests/partial/test_cuda_partial_kernels.py and the layers' refusals in the
test_cuda_*moe_fp32.py files."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from cudagraphs import moe_kernels
from cudagraphs.errors import CudaGraphsError, UnsupportedModelError
from cudagraphs.moe_kernels import (
    GroupedMMProbe,
    HostGroupedMM,
    check_grouped_mm_experts,
    experts_implementation,
    experts_weight,
    find_host_grouped_mm,
    grouped_mm_syncs,
    host_grouped_mm_message,
)
from helpers.moe_models import FIXES, MOE_CONFIGS, moe, probe_says

FAMILIES = sorted(MOE_CONFIGS)


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


# ---- the probe -------------------------------------------------------------------------
def test_experts_weight_is_the_first_floating_parameter_of_the_experts_child():
    moe_module = Moe()
    assert experts_weight(moe_module) is moe_module.experts.gate_up
    bare = Moe(experts=False)
    assert experts_weight(bare) is bare.gate.weight
    assert experts_weight(nn.ReLU()) is None


def test_weights_off_cuda_and_no_weight_raise_no_question(monkeypatch):
    asked = []
    monkeypatch.setattr(moe_kernels, "_runs_on_device", lambda *key: asked.append(key))
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

    monkeypatch.setattr(moe_kernels, "_runs_on_device", runs)
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
    GroupedMMProbe().on_device(weights[0])  # a new probe asks again: no global answers
    assert len(asked) == 4


def test_without_grouped_mm_in_torch_the_answer_is_no(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert moe_kernels._runs_on_device(torch.bfloat16, torch.device("cuda", 0)) is False


# ---- the implementation in effect --------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("implementation", [None, "grouped_mm", "batched_mm", "eager"])
def test_the_implementation_is_what_the_experts_config_says(family, implementation):
    model = moe(family, implementation=implementation)
    for layer in model.model.layers:
        assert experts_implementation(layer.mlp, model) == (implementation or "grouped_mm")
    model.set_experts_implementation("batched_mm")  # on a loaded model, as HF's decode does
    assert experts_implementation(model.model.layers[0].mlp, model) == "batched_mm"


# ---- the rule ----------------------------------------------------------------------------
def reference_syncs(implementation, on_device):
    """Only grouped_mm calls torch._grouped_mm, whose fallback copies offsets to the host."""
    return implementation == "grouped_mm" and on_device is False


@given(
    implementation=st.sampled_from([None, "", "grouped_mm", "batched_mm", "eager", "sonicmoe"]),
    on_device=st.booleans(),
)
def test_the_syncing_rule_equals_its_reference(implementation, on_device):
    assert grouped_mm_syncs(implementation, on_device) == reference_syncs(implementation, on_device)


# ---- the scan -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_grouped_mm_experts_are_found_in_every_layer(monkeypatch, family):
    asked = probe_says(monkeypatch)
    model = moe(family)
    found = find_host_grouped_mm([("", model)])
    assert [f.path for f in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {(f.dtype, f.device) for f in found} == {(torch.float32, torch.device("cpu"))}
    assert len(asked) == 2


@pytest.mark.parametrize("implementation", ["batched_mm", "eager"])
def test_other_implementations_ask_torch_nothing(monkeypatch, implementation):
    asked = probe_says(monkeypatch)
    assert find_host_grouped_mm([("", moe(implementation=implementation))]) == []
    assert asked == []


def test_bfloat16_experts_are_asked_about_and_pass(monkeypatch):
    asked = probe_says(monkeypatch)
    assert find_host_grouped_mm([("", moe(dtype=torch.bfloat16))]) == []
    assert [dtype for dtype, _ in asked] == [torch.bfloat16] * 2


def test_cpu_weights_never_run_the_probe(monkeypatch):
    def runs(dtype, device):
        raise AssertionError(f"probed {dtype} on {device}")

    monkeypatch.setattr(moe_kernels, "_runs_on_device", runs)
    check_grouped_mm_experts([("", moe())], "here")  # CPU weights: no capture question


def test_dense_models_have_no_experts_to_scan(monkeypatch):
    from helpers.hf_models import tiny

    asked = probe_says(monkeypatch)
    assert find_host_grouped_mm([("", tiny("llama"))]) == []
    assert asked == []


def test_roots_prefix_the_paths_and_a_shared_module_is_named_once(monkeypatch):
    probe_says(monkeypatch)
    model = moe()
    layer = model.model.layers[1]
    found = find_host_grouped_mm([("callables[0] (X)", layer), ("callables[1] (X)", layer)])
    assert [f.path for f in found] == ["callables[0] (X).mlp.experts"]


def test_an_experts_module_graphed_alone_is_found(monkeypatch):
    probe_says(monkeypatch)
    experts = moe().model.layers[0].mlp.experts
    assert [f.path for f in find_host_grouped_mm([("experts", experts)])] == ["experts"]


# ---- the refusal ----------------------------------------------------------------------------
def test_the_refusal_names_what_where_and_the_numbered_fixes(monkeypatch):
    probe_says(monkeypatch)
    with pytest.raises(UnsupportedModelError) as err:
        check_grouped_mm_experts([("m", moe())], "make_graphed_callables")
    assert isinstance(err.value, CudaGraphsError) and isinstance(err.value, ValueError)
    text = str(err.value)
    assert text.startswith("make_graphed_callables: the MoE experts at m.model.layers.0.mlp")
    assert "m.model.layers.1.mlp.experts" in text
    assert "float32 on cpu" in text and "Cannot copy between CPU and CUDA tensors" in text
    assert all(fix in text for fix in FIXES), text
    assert text.index("1. bfloat16") < text.index("2. the batched_mm")


def test_the_bfloat16_fix_is_left_out_where_bfloat16_syncs_too(monkeypatch):
    probe_says(monkeypatch, keeps=())
    with pytest.raises(UnsupportedModelError) as err:
        check_grouped_mm_experts([("", moe())], "here")
    text = str(err.value)
    assert "bfloat16" not in text and "1. the batched_mm experts" in text


def test_many_experts_are_counted_past_the_first_four():
    found = [
        HostGroupedMM(f"layers.{i}.experts", torch.float32, torch.device("cuda", 0))
        for i in range(6)
    ]
    text = host_grouped_mm_message(found, "w", note=". Note")
    assert "layers.3.experts and 2 more" in text and "layers.4" not in text
    assert text.endswith(". Note") and "float32 on cuda:0" in text
