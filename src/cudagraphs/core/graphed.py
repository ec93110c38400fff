"""What a user of ``make_graphed_callables`` calls: :class:`GraphedCallable`, and
the autograd Functions through which it replays one entry's
:class:`~.runtime.EntryGraphs` (eagerly for a module in the other training mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..errors import CudaGraphsStateError, UncapturedGradientError, describe_mismatches
from .deferred_grads import DeferredCopyStats
from .runtime import EntryGraphs, SetupSeconds

__all__ = ["GraphedCallable"]


class _ReplayFunction(torch.autograd.Function):
    """Autograd node for one graphed entry: forward replays the forward graph,
    backward the backward graph. Inputs: the entry, then user tensors, then the
    parameters autograd tracks (``EntryGraphs.autograd_params``)."""

    @staticmethod
    def forward(ctx: Any, graphs: EntryGraphs, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n_user = len(graphs.static_inputs)
        graphs.replay_forward(inputs[:n_user])
        ctx.graphs, ctx.forward = graphs, graphs.forward_replays
        # An output no gradient reaches arrives as None, not as a zero tensor autograd
        # would allocate for it: replay_backward zeroes its buffer in place instead.
        ctx.set_materialize_grads(False)
        # Leaf inputs (parameters passed as inputs, say) may need an owned gradient:
        # see replay_backward.
        ctx.leaves = tuple(t if t.is_leaf else None for t in inputs[:n_user])
        outs = graphs.output_tensors()
        non_diff = [o for o, d in zip(outs, graphs.out_differentiable) if not d]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.graphs.check_backward_of(ctx.forward)
        return (None, *ctx.graphs.replay_backward(grads, ctx.leaves))


class _UncapturedGradientReplay(torch.autograd.Function):
    """Autograd node for a replay whose graphs compute no gradient for some input that
    requires one (:meth:`EntryGraphs.gradients_not_captured`). Forward replays the
    forward graph; any backward that reaches the node raises
    :class:`~cudagraphs.errors.UncapturedGradientError` naming those inputs. Inputs:
    the entry, the mismatches, the user tensors, then the untracked parameters."""

    @staticmethod
    def forward(
        ctx: Any, graphs: EntryGraphs, missing: list, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        graphs.replay_forward(inputs[: len(graphs.static_inputs)])
        ctx.graphs, ctx.missing = graphs, missing
        outs = graphs.output_tensors()
        # Outputs that could carry a gradient are differentiable, so that a backward
        # through them reaches this node instead of passing it by.
        non_diff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        raise UncapturedGradientError(
            describe_mismatches(
                f"{ctx.graphs.name}: a backward pass reached a replay whose graphs compute "
                "no gradient for these inputs",
                ctx.missing,
                "The forward replayed (a forward-only use is fine), but its gradient cannot "
                "be computed. Fixes: 1. graph it with sample inputs that require grad "
                "where calls pass inputs that do, and in training mode with grad enabled "
                "for parameters; 2. detach those inputs, or call under torch.no_grad(), "
                "if no gradient should flow through this call.",
            ),
            ctx.missing,
        )


class GraphedCallable:
    """What ``make_graphed_callables`` returns for one entry (or installs as a module's
    ``forward``).

    Calling it replays the captured graphs when the call matches the capture, and
    raises :class:`~cudagraphs.errors.CudaGraphInputError` naming every difference
    otherwise. For a module whose ``training`` flag differs from the one it was
    captured with, it runs the original forward eagerly instead.

    Outputs are borrowed: views of static buffers that the next replay of this entry
    overwrites. Clone what must outlive it.
    """

    def __init__(
        self,
        graphs: EntryGraphs,
        eager: Callable[..., Any],
        module: torch.nn.Module | None,
        captured_training: bool | None,
        on_reset: Callable[[], None] | None = None,
    ) -> None:
        self.graphs = graphs
        self._eager = eager
        self._module = module
        self._captured_training = captured_training
        self._on_reset = on_reset

    @property
    def captured_training(self) -> bool | None:
        """The module's ``training`` flag at capture (``None`` for a function)."""
        return self._captured_training

    @property
    def memory(self) -> Any:
        """Where the device memory of the ``make_graphed_callables`` call that made
        this went (:class:`~cudagraphs.memory.MemoryAccount`, shared by all its
        results); ``None`` under ``CUDAGRAPHS_DISABLE``."""
        return self.graphs.memory

    @property
    def setup_seconds(self) -> SetupSeconds | None:
        """Where the set-up time of the ``make_graphed_callables`` call that made this
        went: warmup, of it ``torch.compile``'s compiling, and capture
        (:class:`~cudagraphs.core.runtime.SetupSeconds`, shared by all its results);
        ``None`` under ``CUDAGRAPHS_DISABLE``."""
        return self.graphs.setup

    @property
    def deferred_copies(self) -> DeferredCopyStats:
        """Whether this entry hands out its owned parameter gradients as graph memory
        (``CUDAGRAPHS_OWNED_GRADS=defer``), and the copies that moves made so far
        (:mod:`cudagraphs.core.deferred_grads`)."""
        lent = self.graphs.lent
        if lent is None:
            return DeferredCopyStats(False, 0, 0)
        return lent.deferred.stats(bool(self.graphs.held_storages))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, graphs = self._module, self.graphs
        if module is not None and module.training != self._captured_training:
            return self._eager(*args, **_eager_kwargs(graphs, kwargs))
        tensors = graphs.user_tensors(args, kwargs)
        if graphs.eager_only:
            graphs.check_live()
            return self._eager(*args, **_eager_kwargs(graphs, kwargs))
        return self._replay(tensors)

    def replay_checked(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Replay with a call's tensor leaves, in the order ``pytree`` flattens the
        captured call's ``(args, kwargs)`` (keywords sorted), for a caller that has
        already checked the call against the capture: the same structure and
        non-tensor values, and tensors of the captured shapes, dtypes and
        ``requires_grad``. Only the parameters read in place are checked here.

        For a layer that matches each call against a stricter contract of its own
        (partial graphs match strides, devices and aliasing too): the call is then
        flattened and checked once rather than twice.

        Raises:
            CudaGraphInputError: a parameter read in place was replaced.
            CudaGraphsStateError: the graphs were made under ``CUDAGRAPHS_DISABLE``
                (there is nothing to replay; call the callable with its arguments).
        """
        graphs = self.graphs
        if graphs.eager_only:
            raise CudaGraphsStateError(
                f"{graphs.name}: made under CUDAGRAPHS_DISABLE, so there is no graph to "
                "replay; call it with its arguments, which runs it eagerly"
            )
        graphs.check_pinned(tensors)
        return self._replay(tensors)

    def _replay(self, tensors: Sequence[torch.Tensor]) -> Any:
        graphs = self.graphs
        if torch.is_grad_enabled():
            missing = graphs.gradients_not_captured(tensors)
            if missing:
                params = [p for _, p in graphs.untracked_params]
                params += [p for _, p in graphs.frozen_params if p.requires_grad]
                outs = _UncapturedGradientReplay.apply(graphs, missing, *tensors, *params)
                return graphs.output_tree(outs)
            if graphs.bwd_graph is not None:
                outs = _ReplayFunction.apply(graphs, *tensors, *graphs.autograd_params)
                return graphs.output_tree(outs)
        # Grad disabled, or nothing that requires grad: no autograd node, and outputs
        # that do not require grad, as eager's would not.
        graphs.replay_forward(tensors)
        return graphs.output_tree(graphs.output_tensors())

    def bind_forward_swap(self, eager: Callable[..., Any], restore: Callable[[], None]) -> None:
        """Record that this callable is installed as a module's ``forward``: eager
        calls run ``eager`` (the module's original forward), and :meth:`reset` calls
        ``restore`` once to give the module that forward back."""
        self._eager = eager
        self._on_reset = restore

    def reset(self) -> None:
        """Release this entry's graphs and buffers; a module gets its eager forward back.

        Idempotent. Calling the graphed callable afterwards raises
        :class:`~cudagraphs.errors.GraphReleasedError` (a module runs eagerly).
        """
        self.graphs.release()
        if self._on_reset is not None:
            self._on_reset()
            self._on_reset = None

    def __repr__(self) -> str:
        state = "released" if self.graphs.released else "live"
        return f"GraphedCallable({self.graphs.name}, {state})"


def _eager_kwargs(graphs: EntryGraphs, kwargs: dict) -> dict:
    """A call's keywords for the callable run eagerly (``ReplayKeywords.eager``)."""
    keywords = graphs.replay_keywords
    return kwargs if not kwargs or keywords is None else keywords.eager(kwargs)
