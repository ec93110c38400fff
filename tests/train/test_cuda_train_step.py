"""GPU tests of graph_train_step: the graphed step equals the same eager loop bit for
bit (losses, parameters, optimizer state), for the block stack and HF models, with
clipping, accumulation, schedulers, state loads, and a failed capture."""

import copy

import pytest
import torch

import cudagraphs
from cudagraphs import CudaGraphCaptureError, CudaGraphInputError, CudaGraphsStateError
from cudagraphs.models import BlockConfig, make_block_stack
from cudagraphs.train import prepare_optimizer
from helpers.asserts import assert_bitwise_equal, contain_failed_capture
from helpers.hf_models import tiny

pytestmark = pytest.mark.cuda

STEPS = 20


class Stack(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        cfg = BlockConfig(hidden=64, heads=4, ffn=128, dropout=dropout)
        self.blocks = make_block_stack(2, cfg, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def stack_step(model):
    def step(batch):
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        return loss

    return step


def stack_batches(n=STEPS, seed=7, shape=(2, 16, 64)):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=g).to("cuda", torch.bfloat16) for _ in range(n)]


OPTIMIZERS = {
    "adamw_auto": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), "auto"),
    "adamw_keep": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), "keep"),
    "adam_fused": (lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True, weight_decay=0.01), "auto"),
    "sgd_momentum_auto": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), "auto"),
    "sgd_keep": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True), "keep"),
}


def eager_loop(step, opt, batches, *, max_grad_norm=None, accumulation=1, sched=None):
    """The documented eager equivalent of one graphed step, step after step."""
    params = [p for g in opt.param_groups for p in g["params"]]
    losses, norms = [], []
    for b in batches:
        for p in params:
            p.grad = None
        mbs = b if accumulation > 1 else [b]
        ls = [step(mb).detach() for mb in mbs]
        if max_grad_norm is not None:
            with_grad = [p for p in params if p.grad is not None]
            norms.append(torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm, foreach=True))
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(ls[0] if accumulation == 1 else torch.stack(ls))
    return losses, norms


def graphed_loop(step, batches, sched=None):
    losses, norms = [], []
    for b in batches:
        losses.append(step(b).clone())
        if step.grad_norm is not None:
            norms.append(step.grad_norm.clone())
        if sched is not None:
            sched.step()
    return losses, norms


def assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses):
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_bitwise_equal(a, b, f"loss of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), f"parameter {name}")
    for p, q in zip(
        [p for g in opt.param_groups for p in g["params"]],
        [p for g in ref_opt.param_groups for p in g["params"]],
    ):
        for key, value in ref_opt.state[q].items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(opt.state[p][key], value, f"optimizer state {key}")


def build(opt_name, dropout=0.0):
    make_opt, impl = OPTIMIZERS[opt_name]
    model = Stack(dropout)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref_model.parameters())
    prepare_optimizer(ref_opt, impl)
    return model, opt, ref_model, ref_opt, impl


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_twenty_steps_equal_the_eager_loop(opt_name):
    model, opt, ref_model, ref_opt, impl = build(opt_name)
    batches = stack_batches()
    step = cudagraphs.graph_train_step(
        stack_step(model), batches[0], optimizer=opt, optimizer_impl=impl
    )
    assert step.graphed and step.stats.graphs == 1
    # The warmup left no trace: the model is as it was before graph_train_step.
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), "parameter after capture")
    losses, _ = graphed_loop(step, batches)
    ref_losses, _ = eager_loop(stack_step(ref_model), ref_opt, batches)
    assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    # .grad holds the last step's gradients, at the graph's addresses.
    assert all(p.grad is not None for p in model.parameters())


def test_clipping_in_the_graph_equals_eager_clipping():
    model, opt, ref_model, ref_opt, impl = build("adamw_auto")
    batches = stack_batches()
    step = cudagraphs.graph_train_step(
        stack_step(model), batches[0], optimizer=opt, max_grad_norm=0.05
    )
    losses, norms = graphed_loop(step, batches)
    ref_losses, ref_norms = eager_loop(stack_step(ref_model), ref_opt, batches, max_grad_norm=0.05)
    assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    for i, (a, b) in enumerate(zip(norms, ref_norms)):
        assert_bitwise_equal(a, b, f"grad norm of step {i}")
    assert max(n.item() for n in norms) > 0.05  # the clipping did clip


def test_accumulation_of_two_micro_batches_equals_eager():
    model, opt, ref_model, ref_opt, impl = build("adamw_auto")
    flat = stack_batches(2 * STEPS)
    batches = [flat[i : i + 2] for i in range(0, len(flat), 2)]
    step = cudagraphs.graph_train_step(
        stack_step(model), flat[0], optimizer=opt, accumulation_steps=2
    )
    assert step.stats.graphs == 3
    losses, _ = graphed_loop(step, batches)
    ref_losses, _ = eager_loop(stack_step(ref_model), ref_opt, batches, accumulation=2)
    assert losses[0].shape == (2,)
    assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)


def test_a_scheduler_changes_the_graph_learning_rate():
    model, opt, ref_model, ref_opt, impl = build("adamw_auto")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    batches = stack_batches()
    step = cudagraphs.graph_train_step(stack_step(model), batches[0], optimizer=opt)
    losses, _ = graphed_loop(step, batches, sched)
    ref_losses, _ = eager_loop(stack_step(ref_model), ref_opt, batches, sched=ref_sched)
    assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-3 * 0.5 ** (STEPS // 3))


def test_a_learning_rate_set_as_a_number_reaches_the_graph():
    model, opt, ref_model, ref_opt, impl = build("adamw_auto")
    batches = stack_batches(4)
    step = cudagraphs.graph_train_step(stack_step(model), batches[0], optimizer=opt)
    step(batches[0])
    opt.param_groups[0]["lr"] = 0.0  # no update from here on
    before = [p.detach().clone() for p in model.parameters()]
    step(batches[1])
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "parameter under lr 0")
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


def test_a_changed_baked_hyperparameter_is_refused():
    model, opt, *_ = build("adamw_auto")
    batches = stack_batches(2)
    step = cudagraphs.graph_train_step(stack_step(model), batches[0], optimizer=opt)
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(CudaGraphsStateError, match=r"param_groups\[0\]\['weight_decay'\]"):
        step(batches[1])


def test_dropout_draws_fresh_masks_at_every_replay():
    model, opt, *_ = build("adamw_auto", dropout=0.5)
    opt.param_groups[0]["lr"] = 0.0
    batch = stack_batches(1)[0]
    step = cudagraphs.graph_train_step(stack_step(model), batch, optimizer=opt)
    a, b = step(batch).clone(), step(batch).clone()
    assert not torch.equal(a, b)


def test_zero_grad_between_steps_changes_nothing():
    model, opt, ref_model, ref_opt, impl = build("adamw_auto")
    batches = stack_batches(6)
    step = cudagraphs.graph_train_step(stack_step(model), batches[0], optimizer=opt)
    losses = []
    for b in batches:
        opt.zero_grad()  # sets .grad to None; the graph hands its gradients out again
        losses.append(step(b).clone())
        assert model.blocks[0].fc1.weight.grad is not None
    ref_losses, _ = eager_loop(stack_step(ref_model), ref_opt, batches)
    assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)


def test_load_state_dict_after_capture_copies_into_the_graph_state():
    model, opt, *_ = build("adamw_auto")
    batches = stack_batches(10)
    step = cudagraphs.graph_train_step(stack_step(model), batches[0], optimizer=opt)
    for b in batches[:5]:
        step(b)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    first = [step(b).clone() for b in batches[5:]]
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    second = [step(b).clone() for b in batches[5:]]
    for i, (a, b) in enumerate(zip(first, second)):
        assert_bitwise_equal(a, b, f"loss {i} after the reload")


def test_a_batch_of_another_shape_is_refused_by_path():
    model, opt, *_ = build("adamw_auto")
    batch = stack_batches(1)[0]
    step = cudagraphs.graph_train_step(stack_step(model), batch, optimizer=opt)
    with pytest.raises(CudaGraphInputError, match="batch"):
        step(batch[:1])


def test_a_failed_capture_leaves_model_optimizer_and_pool_usable():
    model, opt, ref_model, ref_opt, impl = build("adamw_auto")
    batches = stack_batches(3)

    def syncing(batch):
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        if loss.item() < 0:  # a host sync: fine eagerly, illegal in capture
            raise AssertionError
        return loss

    pool = cudagraphs.new_pool()
    try:
        with pytest.raises(CudaGraphCaptureError, match="host sync"):
            cudagraphs.graph_train_step(syncing, batches[0], optimizer=opt, pool=pool)
        assert all(p.grad is None for p in model.parameters())
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_bitwise_equal(p.detach(), q.detach(), "parameter after the failed capture")
        assert all(float(s["step"]) == 0 for s in opt.state.values())
        # Eager training goes on, and a fixed step captures into the same pool.
        eager_loop(stack_step(model), opt, batches[:1])
        step = cudagraphs.graph_train_step(stack_step(model), batches[0], optimizer=opt, pool=pool)
        step(batches[1])
    finally:
        contain_failed_capture(pool)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_hf_models_train_as_the_eager_loop(family):
    model = tiny(family).to("cuda", torch.bfloat16)
    if family == "qwen3_moe":
        model.set_experts_implementation("grouped_mm")
    model.train()
    ref_model = copy.deepcopy(model)

    def step_for(m):
        def step(batch):
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            return loss

        return step

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    prepare_optimizer(ref_opt)
    g = torch.Generator(device="cpu").manual_seed(3)
    batches = [torch.randint(0, 128, (2, 32), generator=g).cuda() for _ in range(STEPS)]
    step = cudagraphs.graph_train_step(
        step_for(model), batches[0], optimizer=opt, max_grad_norm=1.0
    )
    losses, norms = graphed_loop(step, batches)
    ref_losses, ref_norms = eager_loop(step_for(ref_model), ref_opt, batches, max_grad_norm=1.0)
    assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)


def test_gradients_are_handed_out_again_when_the_first_parameter_has_none():
    model, opt, *_ = build("adamw_auto")
    unused = torch.nn.Parameter(torch.zeros(3, device="cuda", dtype=torch.bfloat16))
    opt.param_groups[0]["params"].insert(0, unused)  # never gets a gradient
    batches = stack_batches(3)
    step = cudagraphs.graph_train_step(stack_step(model), batches[0], optimizer=opt)
    step(batches[0])
    opt.zero_grad()
    step(batches[1])
    assert unused.grad is None
    assert all(p.grad is not None for p in model.parameters())


class PlantedError(RuntimeError):
    pass


@pytest.mark.parametrize(
    "where, accumulation",
    [("warmup step 2", 1), ("accumulating capture", 2), ("first capture", 2)],
)
def test_a_step_failing_part_way_leaves_everything_as_before_and_graphs_after(where, accumulation):
    """A failure in the warmup's second step, or in the capture of the first or the
    accumulating graph: parameters, learning rate and optimizer state as before (the
    state the warmup created removed), ``.grad`` None; then the same step graphs and
    trains as the eager loop, replaying (step_fn's Python no longer runs)."""
    model, opt, ref_model, ref_opt, _ = build("adamw_auto")
    plain = stack_step(model)
    calls = {"eager": 0, "captured": 0}

    def step(batch):
        kind = "captured" if torch.cuda.is_current_stream_capturing() else "eager"
        calls[kind] += 1
        failing = {
            "warmup step 2": kind == "eager" and calls["eager"] == 2,
            "first capture": kind == "captured" and calls["captured"] == 1,
            "accumulating capture": kind == "captured" and calls["captured"] == 2,
        }
        if arm[0] and failing[where]:
            raise PlantedError(f"planted failure in the {where}")
        return plain(batch)

    arm = [True]
    batches = stack_batches(4)
    pool = cudagraphs.new_pool()
    try:
        with pytest.raises((PlantedError, CudaGraphCaptureError)) as info:
            cudagraphs.graph_train_step(
                step,
                batches[0],
                optimizer=opt,
                accumulation_steps=accumulation,
                pool=pool,
            )
        cause = info.value if isinstance(info.value, PlantedError) else info.value.__cause__
        assert isinstance(cause, PlantedError), info.value
        assert not torch.cuda.is_current_stream_capturing()
        assert all(p.grad is None for p in model.parameters())
        # prepare_optimizer made the learning rate a device tensor; its value is back.
        assert float(opt.param_groups[0]["lr"]) == float(ref_opt.param_groups[0]["lr"])
        assert len(opt.state) == 0, "the state the warmup created is removed"
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert_bitwise_equal(p.detach(), q.detach(), "parameter after the failure")

        arm[0] = False
        graphed = cudagraphs.graph_train_step(
            step, batches[0], optimizer=opt, accumulation_steps=accumulation, pool=pool
        )
        before = dict(calls)
        runs = [[b] * accumulation if accumulation > 1 else b for b in batches]
        losses, _ = graphed_loop(graphed, runs)
        assert calls == before, "a graphed step ran step_fn's Python: it did not replay"
        ref_losses, _ = eager_loop(stack_step(ref_model), ref_opt, runs, accumulation=accumulation)
        assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    finally:
        contain_failed_capture(pool)


def test_refused_step_calls_change_nothing_and_the_next_step_equals_eager():
    """Each bad call of a graphed step (a batch of another shape, dtype or structure,
    a non-tensor, a changed baked hyperparameter) is refused before any work; the good
    step after it replays (step_fn's Python does not run) and the whole run equals the
    eager loop over the good batches."""
    model, opt, ref_model, ref_opt, _ = build("adamw_auto")
    plain = stack_step(model)
    calls = [0]

    def step_fn(batch):
        calls[0] += 1
        return plain(batch)

    batches = stack_batches(7)
    step = cudagraphs.graph_train_step(step_fn, batches[0], optimizer=opt)
    good = batches[0]
    bad = [
        (lambda: step(good[:1]), CudaGraphInputError, r"batch: shape expected \(2, 16, 64\)"),
        (lambda: step(good.float()), CudaGraphInputError, r"batch: dtype expected torch.bfloat16"),
        (lambda: step((good,)), CudaGraphInputError, r"batch: type expected"),
        (lambda: step(good.tolist()), CudaGraphInputError, r"batch: type expected"),
    ]
    calls_before = calls[0]
    losses = []
    for i, (call, error, match) in enumerate(bad):
        with pytest.raises(error, match=match):
            call()
        losses.append(step(batches[i]).clone())
    betas = opt.param_groups[0]["betas"]
    opt.param_groups[0]["betas"] = (0.5, 0.9)
    with pytest.raises(CudaGraphsStateError, match="betas"):
        step(batches[4])
    opt.param_groups[0]["betas"] = betas
    losses += [step(b).clone() for b in batches[4:]]
    assert calls[0] == calls_before, "a graphed step ran step_fn's Python: it did not replay"
    ref_losses, _ = eager_loop(stack_step(ref_model), ref_opt, batches)
    assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
