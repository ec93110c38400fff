"""Warmup: run the schedule eagerly before capture.

Warmup makes every lazy initialization happen outside capture: cuBLAS/cuDNN handles,
autotuning, Triton compilation, optimizer-free parameter materialization. It runs in
``GraphMemoryPool.warmup_scope``: inside a fresh pool on its capture stream, so that the
captures reuse the warmup's memory, else on the pool's warmup stream; either way the
capture stream's cuBLAS workspace is made inside the pool (``GraphMemoryPool.capture_stream``
says why). It follows the same schedule as capture so that capture-time hooks see the
same order in both phases.

Backward passes use ``torch.autograd.grad`` so that no ``.grad`` attribute is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..compile_watch import CompileReport, CompileWatch
from ..errors import CudaGraphsValueError
from .canonicalize import GraphPlan

__all__ = ["differentiable_inputs", "run_warmup"]


def differentiable_inputs(
    tensors: list[torch.Tensor], params: tuple[torch.Tensor, ...]
) -> tuple[list[int], list[torch.Tensor]]:
    """Positions of the user tensors that require grad, and those tensors + params."""
    positions = [i for i, t in enumerate(tensors) if t.requires_grad]
    return positions, [tensors[i] for i in positions] + list(params)


def differentiable_outputs(output: Any) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(output)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def _warmup_backward(plan: GraphPlan, entry_index: int, output: Any, allow_unused: bool) -> None:
    spec = plan.entries[entry_index]
    outs = differentiable_outputs(output)
    _, inputs = differentiable_inputs(spec.tensors, plan.callable_of(entry_index).params)
    if not outs or not inputs:
        return
    try:
        torch.autograd.grad(
            outs,
            inputs,
            grad_outputs=[torch.ones_like(o) for o in outs],
            allow_unused=allow_unused,
        )
    except RuntimeError as exc:
        if "appears to not have been used" in str(exc):
            raise CudaGraphsValueError(
                f"{plan.callable_of(entry_index).name}: an input or parameter that requires "
                "grad is not used by the forward, so it can get no gradient. Pass "
                "allow_unused_input=True (its gradient is then None), or set "
                "requires_grad=False on it."
            ) from exc
        raise


def run_warmup(
    plan: GraphPlan,
    num_iters: int,
    *,
    allow_unused_input: bool,
    pre_warmup_hook: Callable[[], Any] | None = None,
    post_warmup_hook: Callable[[], Any] | None = None,
    device_index: int | None = None,
) -> tuple[CompileReport, CompileReport]:
    """Run ``num_iters`` eager iterations of ``plan.schedule`` on the current stream.

    ``pre_warmup_hook`` / ``post_warmup_hook`` run once around the whole phase, also
    when ``num_iters`` is 0. Capture-time hooks run around every forward and backward.

    Returns:
        What ``torch.compile`` compiled over the whole warmup and in its last
        iteration (:mod:`cudagraphs.compile_watch`; empty for eager code).
    """
    if pre_warmup_hook is not None:
        pre_warmup_hook()
    grad_mode = torch.enable_grad if plan.training else torch.no_grad
    total = last = CompileReport()
    for _ in range(num_iters):
        outputs: dict[int, Any] = {}
        watch = CompileWatch.start(device_index)
        try:
            _warmup_iteration(plan, outputs, grad_mode, allow_unused_input)
        finally:
            # On failure too: live outputs would keep autograd graphs (and the
            # parameters' AccumulateGrad nodes, bound to the warmup stream) alive.
            outputs.clear()
        last = watch.finish()
        total += last
    if post_warmup_hook is not None:
        post_warmup_hook()
    return total, last


def _warmup_iteration(
    plan: GraphPlan, outputs: dict[int, Any], grad_mode: Callable, allow_unused_input: bool
) -> None:
    for step in plan.schedule:
        spec = plan.entries[step.entry]
        target = plan.callables[step.callable_index]
        hooks = plan.hooks[step.callable_index]
        if step.kind == "fwd":
            hooks.run("forward_pre_hooks", target.fn)
            with grad_mode():
                outputs[step.entry] = target.fn(*spec.args, **spec.kwargs)
            hooks.run("forward_hooks", target.fn)
        else:
            hooks.run("backward_pre_hooks", target.fn)
            _warmup_backward(plan, step.entry, outputs.pop(step.entry), allow_unused_input)
            hooks.run("backward_hooks", target.fn)
