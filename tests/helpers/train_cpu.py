"""Helpers of the train layer's CPU tests (tests/train/test_train_*_cpu.py): parameters
and gradients drawn from seeds, a small model and its step, the documented eager loop,
and optimizers built for a comparison."""

import copy

import torch

from cudagraphs.train import (
    all_reduce_gradients,
    prepare_optimizer,
)
from helpers.asserts import assert_bitwise_equal


def _param(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype))


def _set_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def _steps(opt, params, n, seed=100):
    for i in range(n):
        _set_grads(params, seed + i)
        opt.step()


def _group_values(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _mlp(seed=0):
    """Linear, tanh, linear: two layers, so a gradient flows through a hidden one."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _step_fn(model):
    def step(batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return step


def _batches(n, seed=1, rows=2):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(n)
    ]


def _eager_loop(step_fn, opt, batches, *, max_grad_norm=None, accumulation=1, reduce=False):
    """The eager equivalent documented by graph_train_step, step after step."""
    params = [p for g in opt.param_groups for p in g["params"]]
    losses = []
    for b in batches:
        for p in params:
            p.grad = None
        mbs = b if accumulation > 1 else [b]
        ls = [step_fn(mb).detach() for mb in mbs]
        if reduce:
            all_reduce_gradients(params)
        if max_grad_norm is not None:
            with_grad = [p for p in params if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm, foreach=True)
        opt.step()
        losses.append(ls[0] if accumulation == 1 else torch.stack(ls))
    return losses


def _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses):
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_bitwise_equal(a, b, f"loss of step {i}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), f"parameter {name}")
    params = [p for g in opt.param_groups for p in g["params"]]
    ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
    for p, q in zip(params, ref_params):
        assert set(opt.state[p]) == set(ref_opt.state[q])
        for key, value in ref_opt.state[q].items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(opt.state[p][key], value, f"optimizer state {key}")


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
}


def _build(opt_name):
    model = _make_model()
    ref_model = copy.deepcopy(model)
    make = OPTIMIZERS[opt_name]
    opt, ref_opt = make(model.parameters()), make(ref_model.parameters())
    prepare_optimizer(ref_opt)  # the documented reference; a no-op on the CPU
    return model, opt, ref_model, ref_opt
