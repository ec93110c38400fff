"""Warmup: run the schedule eagerly before capture.

Warmup makes every lazy initialization happen outside capture: cuBLAS/cuDNN handles,
autotuning, Triton compilation, optimizer-free parameter materialization. It runs in
``GraphMemoryPool.warmup_scope``: inside a fresh pool on its capture stream, so that the
captures reuse the warmup's memory, else on the pool's warmup stream; either way the
capture stream's cuBLAS workspace is made inside the pool (``GraphMemoryPool.capture_stream``
says why). It follows the same schedule as capture so that capture-time hooks see the
same order in both phases.

Backward passes use ``torch.autograd.grad`` so that no ``.grad`` attribute is touched.

Parameters passed as inputs (explicit-parameter adapters such as partial graphs) are
passed as the same kind of alias the capture passes (:func:`parameter_alias`): warmup
and capture then call the function with inputs that relate to each other, and to the
module's own parameters, in the same way, which a compiled function's guards check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parameter import is_lazy
from torch.utils import _pytree as pytree

from ..compile_watch import CompileReport, CompileWatch
from ..errors import CudaGraphsValueError
from ..torch_private import tensor_version
from .canonicalize import EntrySpec, GraphPlan

__all__ = ["differentiable_inputs", "parameter_alias", "run_warmup"]


def parameter_alias(t: torch.nn.Parameter) -> torch.Tensor:
    """A new leaf over ``t``'s storage, which a graph (and the warmup before it) is
    passed in place of a parameter input.

    Why not the parameter itself: an eager autograd graph the caller keeps alive (a
    live ``loss``) holds the parameter's AccumulateGrad node bound to the default
    stream, and a backward capture through that node would make the legacy stream wait
    on the capture. Why a :class:`~torch.nn.Parameter` for a plain one: dynamo guards
    on an input's type. Why the warmup passes one too: a function that also reaches
    the parameter through its module (``functional_call`` over the module, as partial
    graphs do) is guarded by dynamo on whether its input *is* the module's parameter,
    so a compiled target warmed up on the parameter itself would recompile at capture
    (and ``fail_on_recompile`` refuses that).
    """
    if type(t) is torch.nn.Parameter:
        return torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad)
    return t.detach().requires_grad_(t.requires_grad)


@dataclass
class WarmupCall:
    """One entry's call as the warmup makes it: its sample arguments with each
    parameter input replaced by its alias, and its tensors in the entry's order."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tensors: list[torch.Tensor]

    @classmethod
    def of(cls, spec: EntrySpec, aliases: dict[int, torch.Tensor]) -> WarmupCall:
        """``spec``'s call; ``aliases`` (by parameter ``id``) is shared by every entry
        and iteration, so one parameter has one alias throughout the warmup."""
        if not any(_aliased(t) for t in spec.tensors):
            return cls(spec.args, spec.kwargs, spec.tensors)
        leaves = list(spec.leaves)
        for pos in spec.tensor_positions:
            t = leaves[pos]
            if _aliased(t):
                leaves[pos] = aliases.setdefault(id(t), parameter_alias(t))
        args, kwargs = pytree.tree_unflatten(leaves, spec.in_spec)
        return cls(tuple(args), kwargs, [leaves[i] for i in spec.tensor_positions])


def _aliased(t: torch.Tensor) -> bool:
    # A lazy module's parameter is materialized by its first forward: it stays itself.
    return isinstance(t, torch.nn.Parameter) and not is_lazy(t)


def differentiable_inputs(
    tensors: list[torch.Tensor], params: tuple[torch.Tensor, ...]
) -> tuple[list[int], list[torch.Tensor]]:
    """Positions of the user tensors that require grad, and those tensors + params."""
    positions = [i for i, t in enumerate(tensors) if t.requires_grad]
    return positions, [tensors[i] for i in positions] + list(params)


def differentiable_outputs(
    output: Any, unreached: frozenset[int] = frozenset()
) -> list[torch.Tensor]:
    """The tensor outputs that require grad, less those at ``unreached`` positions
    (among the tensor outputs, as ``make_graphed_callables``'s ``_unreached_outputs``
    counts them)."""
    tensors = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
    return [t for i, t in enumerate(tensors) if t.requires_grad and i not in unreached]


def _warmup_backward(
    plan: GraphPlan,
    entry_index: int,
    call: WarmupCall,
    output: Any,
    allow_unused: bool,
    unreached: frozenset[int],
) -> None:
    # The outputs the captured backward gets no gradient for get none here either: the
    # warmup then does the captured backward's work and no more. A ones-like gradient
    # for a model's logits would be one more logits-sized tensor, plus their sum with
    # the loss's gradient, at the backward's peak; in a fresh pool the warmup's peak
    # sets the pool's size (measured on the memory benchmark's partial "model" scope).
    outs = differentiable_outputs(output, unreached)
    _, inputs = differentiable_inputs(call.tensors, plan.callable_of(entry_index).params)
    _refuse_outside_leaves(plan, entry_index, outs, call.tensors)
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
    unreached: Mapping[int, frozenset[int]] | None = None,
) -> tuple[CompileReport, CompileReport]:
    """Run ``num_iters`` eager iterations of ``plan.schedule`` on the current stream.

    ``pre_warmup_hook`` / ``post_warmup_hook`` run once around the whole phase, also
    when ``num_iters`` is 0. Capture-time hooks run around every forward and backward.
    ``unreached``: per entry index, the positions among its tensor outputs that no
    backward reaches (:func:`~cudagraphs.core.capture_phase.check_unreached_outputs`);
    each backward passes a gradient for every other differentiable output.

    Returns:
        What ``torch.compile`` compiled over the whole warmup and in its last
        iteration (:mod:`cudagraphs.compile_watch`; empty for eager code).
    """
    if pre_warmup_hook is not None:
        pre_warmup_hook()
    grad_mode = torch.enable_grad if plan.training else torch.no_grad
    total = last = CompileReport()
    aliases: dict[int, torch.Tensor] = {}
    calls = [WarmupCall.of(spec, aliases) for spec in plan.entries]
    for _ in range(num_iters):
        outputs: dict[int, Any] = {}
        watch = CompileWatch.start(device_index)
        try:
            _warmup_iteration(plan, calls, outputs, grad_mode, allow_unused_input, unreached or {})
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
    plan: GraphPlan,
    calls: list[WarmupCall],
    outputs: dict[int, Any],
    grad_mode: Callable,
    allow_unused_input: bool,
    unreached: Mapping[int, frozenset[int]],
) -> None:
    for step in plan.schedule:
        call = calls[step.entry]
        target = plan.callables[step.callable_index]
        hooks = plan.hooks[step.callable_index]
        if step.kind == "fwd":
            hooks.run("forward_pre_hooks", target.fn)
            versions = [tensor_version(t) for t in call.tensors]
            with grad_mode():
                outputs[step.entry] = target.fn(*call.args, **call.kwargs)
            _refuse_written_inputs(plan, step.entry, call, versions)
            hooks.run("forward_hooks", target.fn)
        else:
            hooks.run("backward_pre_hooks", target.fn)
            _warmup_backward(
                plan,
                step.entry,
                call,
                outputs.pop(step.entry),
                allow_unused_input,
                unreached.get(step.entry, frozenset()),
            )
            hooks.run("backward_hooks", target.fn)


def _refuse_written_inputs(
    plan: GraphPlan, entry_index: int, call: WarmupCall, versions: list[int]
) -> None:
    """Refuse a forward that wrote into a tensor argument in place: a replay copies
    each argument into a buffer of the graph's own, so the write would reach that
    buffer and never the caller's tensor. Parameters passed as inputs are read (and
    written) in place, so theirs would land: they are left alone."""
    spec = plan.entries[entry_index]
    written = [
        spec.paths[spec.tensor_positions[i]]
        for i, (t, before) in enumerate(zip(call.tensors, versions))
        if tensor_version(t) != before and not isinstance(spec.tensors[i], torch.nn.Parameter)
    ]
    if written:
        raise CudaGraphsValueError(
            f"{plan.callable_of(entry_index).name}: its forward writes into "
            f"{', '.join(written)} in place. A replay copies each argument into the "
            "graph's own buffer, so the write would change that buffer and never the "
            "tensor passed. Fixes: 1. return the new value instead of writing into the "
            "argument; 2. keep the tensor on the module (a buffer), which the graph "
            "reads and writes in place"
        )


def _refuse_outside_leaves(
    plan: GraphPlan, entry_index: int, outs: list[torch.Tensor], tensors: list[torch.Tensor]
) -> None:
    """Refuse outputs that depend on tensors requiring grad that are neither the
    call's arguments nor the callable's parameters (a function's closure, a module
    reading another module's weight): the backward graph computes gradients for its
    inputs and parameters only, so theirs would silently be missing (eager gives
    them one)."""
    target = plan.callable_of(entry_index)
    known = {id(t) for t in tensors} | {id(p) for p in target.params}
    outside: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
        if isinstance(leaf, torch.Tensor) and id(leaf) not in known:
            outside[id(leaf)] = leaf
        stack.extend(next_node for next_node, _ in node.next_functions)
    if outside:
        found = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in outside.values())
        raise CudaGraphsValueError(
            f"{target.name}: its outputs depend on {len(outside)} tensor(s) that require "
            f"grad but are neither its arguments nor its parameters ({found}); the "
            "backward graph computes gradients for those two only, so theirs would be "
            "missing. Fixes: 1. pass them as arguments; 2. hold them in a module that "
            "is the callable (as its parameters); 3. detach them, or set "
            "requires_grad=False, if they take no gradient"
        )
