"""Parameter gradients lent to autograd as views of graph memory, and when to take
them back: the opt-in lent mode of ``make_graphed_callables``
(``clone_param_grads_on_return=False``; the default hands out owned copies, and
:mod:`.deferred_grads` owned gradients at lent memory).

A backward graph writes each parameter gradient into a static buffer in the graph
pool. Handing that buffer to autograd as it is costs nothing, and under
``zero_grad(set_to_none=True)`` (torch's default) it is all a step needs: the
optimizer reads ``.grad``, ``.grad`` is dropped, and the next backward lends the
buffer again. But the buffer is not the gradient's alone. Two kinds of replay write
it:

* the backward graph that produced it, at its next replay;
* any graph captured *earlier* into the same pool: a buffer allocated during a later
  capture may sit in memory an earlier graph uses for temporaries (that is how
  graphs in one pool share memory), so the next forward of the first layer, say,
  overwrites it.

So a ``.grad`` that still is the buffer when either comes (gradients accumulating
over micro-batches or steps) must be moved to an owned copy first. The registry
records what was lent; :meth:`LentGrads.settle` runs before every forward replay of
a graph in the pool (by then the backward pass that lent the buffers is over, so
autograd has adopted or added each gradient) and moves what still aliases, in one
fused copy; the backward replay checks its own buffers itself. One registry per
:class:`~cudagraphs.GraphMemoryPool` object, so calls that share a pool object share it.
"""

from __future__ import annotations

import torch

from ..graph_pool import GraphMemoryPool
from .deferred_grads import DeferredCopies

__all__ = ["LentGrads", "lent_grads_of", "move_aliased_grads"]


class LentGrads:
    """Parameters whose ``.grad`` may still be a static buffer of the pool, and the
    pool's owned gradients handed out as its memory (``deferred``)."""

    __slots__ = ("params", "ptrs", "deferred")

    def __init__(self) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.ptrs: list[int] = []
        self.deferred = DeferredCopies()

    def lend(self, params: list[torch.nn.Parameter], ptrs: list[int]) -> None:
        self.params.extend(params)
        self.ptrs.extend(ptrs)

    def settle(self) -> None:
        """Move every lent ``.grad`` that still is its buffer to an owned copy and
        forget them all: a ``.grad`` that is ``None`` or another tensor now no longer
        refers to pool memory."""
        params, ptrs = self.params, self.ptrs
        self.params, self.ptrs = [], []
        move_aliased_grads(params, ptrs)


def move_aliased_grads(params: list[torch.nn.Parameter], ptrs: list[int]) -> None:
    """Give each ``param.grad`` whose data is at the matching address an owned
    copy (one fused launch for all)."""
    moved = [
        (p, g) for p, ptr in zip(params, ptrs) if (g := p.grad) is not None and g.data_ptr() == ptr
    ]
    if moved:
        copies = torch._foreach_mul([g for _, g in moved], 1.0)  # x * 1.0 is exact
        for (p, _), c in zip(moved, copies):
            p.grad = c


def lent_grads_of(pool: GraphMemoryPool) -> LentGrads:
    """The registry of ``pool`` (made on first use)."""
    registry = pool.lent_grads
    if registry is None:
        registry = pool.lent_grads = LentGrads()
    return registry
