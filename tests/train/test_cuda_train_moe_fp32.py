"""graph_train_step on the GPU over a tiny OLMoE (2 layers, hidden 64, 4 experts):
float32 with transformers' default grouped_mm experts ends in the UnsupportedModelError
naming the experts and the fixes, before the warmup (parameters untouched, no
gradients; or, on a torch whose grouped GEMM runs float32 on the device, a replaying
step); the two fixes (bfloat16 weights, batched_mm experts) capture one graph whose
steps replay and train as the eager loop does."""

import copy

import pytest
import torch

import cudagraphs
from cudagraphs.errors import UnsupportedModelError
from cudagraphs.moe_kernels import GroupedMMProbe
from cudagraphs.train import prepare_optimizer
from helpers.moe_models import FIXES, moe

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

STEPS = 4


def lm_step(model):
    def step(batch):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss

    return step


def batches(n=STEPS):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (2, 16), generator=g).cuda() for _ in range(n)]


def on_device(dtype):
    return GroupedMMProbe().on_device(torch.zeros(1, device="cuda", dtype=dtype))


def test_a_float32_grouped_mm_step_ends_in_the_named_fixes():
    if on_device(torch.float32):
        pytest.skip("this torch runs float32 grouped GEMMs on the device: the step graphs")
    model = moe("olmoe", device="cuda").train()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UnsupportedModelError) as err:
        cudagraphs.graph_train_step(lm_step(model), batches(1)[0], optimizer=opt)
    text = str(err.value)
    assert text.startswith("graph_train_step: the MoE experts at model.model.layers.0.mlp.experts")
    assert "float32 on cuda:0" in text and all(fix in text for fix in FIXES), text
    assert all(p.grad is None for p in model.parameters()), "no warmup step ran"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize(
    "dtype, implementation",
    [(torch.bfloat16, None), (torch.float32, "batched_mm")],
    ids=["bfloat16_grouped_mm", "float32_batched_mm"],
)
def test_the_fixed_models_replay_and_train_as_the_eager_loop(dtype, implementation):
    if implementation is None and not on_device(dtype):
        pytest.skip("torch's bfloat16 grouped GEMM is not on the device on this GPU")
    model = moe("olmoe", dtype, implementation, device="cuda").train()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    prepare_optimizer(ref_opt)
    data = batches()
    step = cudagraphs.graph_train_step(lm_step(model), data[0], optimizer=opt)
    assert step.graphed and step.stats.graphs == 1
    losses, ref_losses = [], []
    for batch in data:
        losses.append(step(batch).item())
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(lm_step(ref_model)(batch).item())
        ref_opt.step()
    assert len(set(losses)) == STEPS, "each replay trained on its own batch"
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert losses == pytest.approx(ref_losses, rel=tolerance)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=tolerance, atol=tolerance, msg=name)
