"""GPU tests of torchao's float8 training (``convert_to_float8_training``, dynamic
tensorwise and rowwise scaling, H100/H200 FP8 tensor cores) under the graph layers:
the graphed step equals torchao's own eager step with the same kernels, bit for bit,
and it replays. torchao is an optional extra (``.[torchao]``): skipped without it."""

import copy

import pytest
import torch

import cudagraphs
from cudagraphs.train import prepare_optimizer
from helpers.asserts import assert_bitwise_equal

pytestmark = pytest.mark.cuda

float8 = pytest.importorskip("torchao.float8")

RECIPES = ["tensorwise", "rowwise"]


@pytest.fixture(autouse=True)
def _fp8_device():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or newer")


class MLP(torch.nn.Module):
    """Two blocks of Linear-GELU-Linear; every dimension a multiple of 16 (FP8 GEMMs)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(256, 512, bias=False),
                torch.nn.GELU(),
                torch.nn.Linear(512, 256, bias=False),
            )
            for _ in range(2)
        ).to("cuda", torch.bfloat16)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def converted(recipe):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(model, config=config)
    float8.convert_to_float8_training(ref, config=config)
    return model, ref


def batches(n, seed=5):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn((64, 256), generator=g).to("cuda", torch.bfloat16) for _ in range(n)]


def stepper(model, calls):
    def step(x):
        calls[0] += 1
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize("recipe", RECIPES)
def test_graph_train_step_equals_torchaos_eager_float8_step(recipe):
    model, ref = converted(recipe)
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    prepare_optimizer(ref_opt, "auto")
    data = batches(10)
    calls = [0]
    step = cudagraphs.graph_train_step(stepper(model, calls), data[0], optimizer=opt)
    before = calls[0]
    losses = [step(x).clone() for x in data]
    assert calls[0] == before, "a graphed step ran step_fn's Python: it did not replay"
    ref_step = stepper(ref, [0])
    for i, x in enumerate(data):
        for p in ref.parameters():
            p.grad = None
        ref_loss = ref_step(x).detach()
        ref_opt.step()
        assert_bitwise_equal(losses[i], ref_loss, f"loss of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), f"parameter {name}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_graph_stack_of_float8_blocks_replays_like_the_eager_blocks(recipe):
    model, ref = converted(recipe)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = cudagraphs.graph_stack(model.blocks, (x,))
    for i, data in enumerate(batches(3, seed=9)):
        a = data.clone().requires_grad_()
        b = data.clone().requires_grad_()
        out = graphed(a)
        ref_out = b
        for block in ref.blocks:
            ref_out = block(ref_out)
        assert_bitwise_equal(out, ref_out, f"output {i}")
        out.float().pow(2).mean().backward()
        ref_out.float().pow(2).mean().backward()
        assert_bitwise_equal(a.grad, b.grad, f"input grad {i}")
        for (name, p), q in zip(model.blocks.named_parameters(), ref.blocks.parameters()):
            assert_bitwise_equal(p.grad, q.grad, f"{name}.grad {i}")
            p.grad = q.grad = None
