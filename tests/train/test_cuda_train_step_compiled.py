"""GPU tests of compiled steps inside graph_train_step: a ``torch.compile``d model
(inductor's kernels, mode="default") graphs with its optimizer step in one graph
(compiled under ``optimizer_impl="auto"``, the fused kernel under ``"fused"``) and
trains bit for bit like the same compiled model stepped eagerly, HF Llama and
Qwen3-MoE (grouped_mm experts) included; ``optimizer_impl="compiled"`` (the optimizer
step compiled too) trains like the eager loop calling the same compiled step; a step
that still compiles before capture is refused by name, and the next good call works."""

import copy

import pytest
import torch

import cudagraphs
from cudagraphs import CompiledCaptureError
from cudagraphs.models import BlockConfig, make_block_stack
from cudagraphs.train import compiled_optimizer_step, prepare_optimizer
from helpers.asserts import assert_bitwise_equal, contain_failed_capture
from helpers.hf_models import tiny

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cfg = BlockConfig(hidden=64, heads=4, ffn=128)
        self.blocks = make_block_stack(2, cfg, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def batches(n=8, seed=3):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn((2, 16, 64), generator=g).to("cuda", torch.bfloat16) for _ in range(n)]


def stepper(model, calls):
    def step(batch):
        calls[0] += 1
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        return loss

    return step


def eager_loop(step, model, opt, data, optimizer_step=None):
    """The reference: each batch from ``.grad`` None, ``step`` then ``opt.step()`` (or
    ``optimizer_step()``: the compiled one)."""
    optimizer_step = optimizer_step or opt.step
    losses = []
    for b in data:
        for p in model.parameters():
            p.grad = None
        losses.append(step(b).detach())
        optimizer_step()
    return losses


def assert_same_steps(model, ref, losses, ref_losses, what):
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_bitwise_equal(a, b, f"{what}loss of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), f"{what}parameter {name}")


def reference_optimizer_step(ref_opt, impl):
    """The eager loop's optimizer step for ``optimizer_impl=impl`` on a compiled model:
    ``"auto"`` compiles it there (the step compiles), ``"fused"`` keeps the kernel."""
    plan = "compiled" if impl == "auto" else impl
    prepare_optimizer(ref_opt, plan)
    return compiled_optimizer_step(ref_opt) if plan == "compiled" else None


def hf_step(model, count):
    """A step over an HF causal LM with its own loss from labels; counts its calls."""

    def step(batch):
        count[0] += 1
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        return loss

    return step


def hf_batches(n=5, seed=3):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, 128, (2, 32), generator=g).cuda() for _ in range(n)]


@pytest.mark.parametrize("impl", ["auto", "fused"])
def test_a_compiled_model_graphs_and_trains_like_its_eager_compiled_loop(impl):
    model = Stack()
    ref = copy.deepcopy(model)
    compiled, ref_compiled = torch.compile(model), torch.compile(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_step = reference_optimizer_step(ref_opt, impl)
    calls, ref_calls = [0], [0]
    data = batches()
    step = cudagraphs.graph_train_step(
        stepper(compiled, calls), data[0], optimizer=opt, optimizer_impl=impl
    )
    assert step.graphed and step.stats.graphs == 1
    assert step.optimizer_compiled is (impl == "auto")
    assert bool(opt.param_groups[0]["fused"]) is (impl == "fused")
    assert step.stats.compiled_frames >= 1 and step.stats.compile_seconds > 0
    assert step.stats.compile_seconds <= step.stats.warmup_seconds
    before = calls[0]
    losses = [step(b).clone() for b in data]
    assert calls[0] == before, "a graphed step ran step_fn's Python: it did not replay"
    ref_losses = eager_loop(stepper(ref_compiled, ref_calls), ref, ref_opt, data, ref_step)
    assert_same_steps(model, ref, losses, ref_losses, f"{impl}: ")


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager_model", "compiled_model"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_a_compiled_optimizer_step_graphs_and_trains_like_its_eager_loop(opt_name, compile_model):
    # optimizer_impl="compiled": the foreach step compiled by inductor, captured in the
    # same graph as forward and backward; the reference calls the same compiled step.
    model = Stack()
    ref = copy.deepcopy(model)
    run, ref_run = (torch.compile(model), torch.compile(ref)) if compile_model else (model, ref)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    prepare_optimizer(ref_opt, "compiled")
    calls = [0]
    data = batches()
    step = cudagraphs.graph_train_step(
        stepper(run, calls), data[0], optimizer=opt, optimizer_impl="compiled"
    )
    assert step.graphed and step.stats.graphs == 1 and step.stats.compiled_frames >= 1
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]
    before = calls[0]
    losses = [step(b).clone() for b in data]
    assert calls[0] == before, "a graphed step ran step_fn's Python: it did not replay"
    opt.param_groups[0]["lr"] = 5e-4  # a new rate reaches the replay (device lr, no guard)
    losses.append(step(data[0]).clone())
    ref_step, ref_fn = compiled_optimizer_step(ref_opt), stepper(ref_run, [0])
    ref_losses = eager_loop(ref_fn, ref, ref_opt, data, ref_step)
    ref_opt.param_groups[0]["lr"].fill_(5e-4)
    ref_losses += eager_loop(ref_fn, ref, ref_opt, data[:1], ref_step)
    assert calls[0] == before
    assert_same_steps(model, ref, losses, ref_losses, f"{opt_name}: ")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_compiled_hf_model_graphs_and_trains_like_its_eager_compiled_loop(family):
    # The benchmarks' compiled HF step (train_step_hf): the model compiled whole, its
    # own loss from labels, AdamW in the graph compiled too ("auto" on a compiling
    # step). Qwen3-MoE runs the grouped_mm
    # experts, whose routing must compile without a host sync to be captured.
    model = tiny(family).to("cuda", torch.bfloat16)
    if family == "qwen3_moe":
        model.set_experts_implementation("grouped_mm")
    model.train()
    ref = copy.deepcopy(model)
    compiled, ref_compiled = torch.compile(model), torch.compile(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_step = reference_optimizer_step(ref_opt, "auto")
    calls = [0]

    data = hf_batches()
    step = cudagraphs.graph_train_step(hf_step(compiled, calls), data[0], optimizer=opt)
    assert step.graphed and step.stats.compiled_frames >= 1 and step.optimizer_compiled
    before = calls[0]
    losses = [step(b).clone() for b in data]
    assert calls[0] == before, "a graphed step ran step_fn's Python: it did not replay"
    ref_losses = eager_loop(hf_step(ref_compiled, [0]), ref, ref_opt, data, ref_step)
    assert_same_steps(model, ref, losses, ref_losses, f"{family}: ")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_stacked_compiled_hf_model_graphs_trains_like_its_eager_loop_with_fewer_gemms(
    family, monkeypatch
):
    # compile_stacked: q/k/v (and Llama's gate/up) one GEMM each, forward, input
    # gradient and weight gradient. Graphed, it trains bit for bit like the same
    # stacked compile stepped eagerly, and within bf16's rounding of the plain compile.
    import torch._inductor.config as inductor

    from cudagraphs.stacking import gemms

    removed = []
    real = gemms.stack_graph
    monkeypatch.setattr(gemms, "stack_graph", lambda g: removed.append(real(g)) or removed[-1])
    # The pass runs only when inductor compiles: a cached FX graph skips it. Only that
    # cache is off: the autotuning cache stays on, so that the reference compile runs
    # the reduction configs the graphed one autotuned (each picks by timing: with all
    # caches off, two compiles of one graph may round differently).
    monkeypatch.setattr(inductor, "fx_graph_cache", False)
    models = []
    for _ in range(3):
        m = tiny(family).to("cuda", torch.bfloat16)
        if family == "qwen3_moe":
            m.set_experts_implementation("grouped_mm")
        models.append(m.train())
    model, ref, plain = models
    compiled = cudagraphs.compile_stacked(model)
    ref_compiled, plain_compiled = cudagraphs.compile_stacked(ref), torch.compile(plain)
    layers = model.config.num_hidden_layers
    # Forward 2 (q/k/v) + 1 (gate/up) fewer a layer, backward twice that; Qwen3-MoE's
    # experts are no sibling linears.
    per_layer = 3 if family == "llama" else 2
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    ref_step = reference_optimizer_step(opts[1], "auto")
    plain_step = reference_optimizer_step(opts[2], "auto")

    data = hf_batches()
    calls = [0]
    step = cudagraphs.graph_train_step(hf_step(compiled, calls), data[0], optimizer=opts[0])
    assert step.graphed and step.optimizer_compiled
    made = list(removed)  # the forward's and the backward's (and the optimizer's: 0)
    assert per_layer * layers in made and 2 * per_layer * layers in made, made
    before = calls[0]
    losses = [step(b).clone() for b in data]
    assert calls[0] == before, "a graphed step ran step_fn's Python: it did not replay"
    ref_losses = eager_loop(hf_step(ref_compiled, [0]), ref, opts[1], data, ref_step)
    assert_same_steps(model, ref, losses, ref_losses, f"{family} stacked: ")
    plain_losses = eager_loop(hf_step(plain_compiled, [0]), plain, opts[2], data, plain_step)
    for i, (a, b) in enumerate(zip(losses, plain_losses)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=f"loss of step {i}")
    assert not compiled.groups.moved()


def test_a_step_that_recompiles_every_call_is_refused_and_the_next_good_one_graphs():
    model = Stack()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = {"n": 0}

    @torch.compile(dynamic=False)
    def scaled_loss(out, n):
        return out.float().pow(2).mean() * (1.0 + 0.0 * n)

    def changing(batch):
        counter["n"] += 1  # a Python int the compiled code guards on: a new value each call
        loss = scaled_loss(model(batch), counter["n"])
        loss.backward()
        return loss

    data = batches(4)
    pool = cudagraphs.new_pool()
    try:
        with pytest.raises(CompiledCaptureError) as err:
            cudagraphs.graph_train_step(changing, data[0], optimizer=opt, pool=pool)
        text = str(err.value)
        assert "the last warmup step" in text and "scaled_loss" in text
        assert "recompiled because" in text
        assert all(p.grad is None for p in model.parameters())
        assert len(opt.state) == 0
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_bitwise_equal(p.detach(), q.detach(), "parameter after the refusal")
        calls = [0]
        step = cudagraphs.graph_train_step(stepper(model, calls), data[0], optimizer=opt, pool=pool)
        before = calls[0]
        step(data[1])
        assert calls[0] == before and step.stats.compiled_frames == 0
    finally:
        contain_failed_capture(pool)
