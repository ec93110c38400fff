"""make_graphed_callables and graph_stack on float32 grouped_mm MoE layers, on the CPU:
with the device checks stood in for and the probe answering as torch 2.11 on an H200
(no float32 grouped GEMM), the layers are refused before any warmup with an
UnsupportedModelError naming the experts and the fixes; bfloat16 and batched_mm layers
pass the checks. The refusal on a GPU is in test_cuda_moe_fp32.py."""

import pytest
import torch

from cudagraphs import graph_stack, make_graphed_callables
from cudagraphs.core import api
from cudagraphs.errors import UnsupportedModelError
from helpers.moe_models import FIXES, moe, probe_says, roped_layers


class PastTheChecks(Exception):
    pass


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The device checks pass on the CPU; the step after the checks (entering the
    device around warmup and capture) raises PastTheChecks."""
    monkeypatch.setattr(api, "require_cuda", lambda what: None)
    monkeypatch.setattr(api, "check_devices", lambda plan: torch.device("cpu"))
    monkeypatch.setattr(api, "graphs_disabled", lambda: False)

    def device(index):
        raise PastTheChecks

    monkeypatch.setattr(torch.cuda, "device", device)


def layers_and_input(dtype=torch.float32, implementation=None, family="olmoe"):
    model = moe(family, dtype=dtype, implementation=implementation)
    hidden = torch.randn(2, 8, 64, dtype=dtype, requires_grad=True)
    return roped_layers(model, hidden), hidden


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral"])
def test_float32_grouped_mm_layers_are_refused_before_warmup(monkeypatch, on_a_gpu, family):
    probe_says(monkeypatch)
    layers, hidden = layers_and_input(family=family)
    sample = tuple((hidden,) for _ in layers)
    with pytest.raises(UnsupportedModelError) as err:
        make_graphed_callables(tuple(layers), sample)
    text = str(err.value)
    assert text.startswith("make_graphed_callables: the MoE experts at callables[0] (RopedLayer)")
    assert "callables[0] (RopedLayer).layer.mlp.experts" in text
    assert "callables[1] (RopedLayer).layer.mlp.experts" in text
    assert all(fix in text for fix in FIXES), text


def test_graph_stack_refuses_them_through_the_core(monkeypatch, on_a_gpu):
    probe_says(monkeypatch)
    layers, hidden = layers_and_input()
    with pytest.raises(UnsupportedModelError, match=r"\(GraphedStack\)\.layers\.0\.layer\.mlp"):
        graph_stack(layers, (hidden,))


@pytest.mark.parametrize(
    "dtype, implementation", [(torch.bfloat16, None), (torch.float32, "batched_mm")]
)
def test_the_fixed_layers_pass_the_checks(monkeypatch, on_a_gpu, dtype, implementation):
    asked = probe_says(monkeypatch)
    layers, hidden = layers_and_input(dtype, implementation)
    with pytest.raises(PastTheChecks):
        make_graphed_callables(layers[0], (hidden,))
    with pytest.raises(PastTheChecks):
        graph_stack(layers, (hidden,))
    assert all(d == torch.bfloat16 for d, _ in asked)  # batched_mm: nothing asked


def test_plain_functions_and_dense_modules_are_not_scanned(monkeypatch, on_a_gpu):
    asked = probe_says(monkeypatch)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(PastTheChecks):
        make_graphed_callables((lambda t: t * 2, torch.nn.Linear(8, 8)), ((x,), (x,)))
    assert asked == []
