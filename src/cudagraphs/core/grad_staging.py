"""One staging buffer for the parameter gradients that the backward graphs of one
``make_graphed_callables`` call hand out as owned copies (the default,
``clone_param_grads_on_return=True``).

Why: each backward replay's parameter gradients are copied out for autograd right
after the replay. Left as the graph's outputs, the gradients the backward computed
would be static buffers, one per parameter, living as long as the graphs: a second
copy of every graphed parameter's gradient beside the owned one in ``.grad``. On a
1B-parameter Llama at batch 1 that is a fifth of the eager step's memory (issue 36).
Staged, each backward graph ends with one multi-tensor copy of its gradients into
views of a buffer shared by every entry of the call and sized for the largest one;
the gradients it computed become temporaries of the pool, which the captures after
it reuse. Safe because the owned copies are made from the buffer right after the
replay that wrote it (``runtime._hand_out_param_grads``), before any other graph of
the call replays; lent mode keeps one buffer per parameter, since ``.grad`` then is
that buffer.

Only contiguous gradients are staged (views of a flat buffer are contiguous, and a
parameter's gradient keeps its layout); others stay graph outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["GradStaging"]


@dataclass
class GradStaging:
    """Flat buffers per (dtype, device), each as large as the largest entry needs."""

    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor]

    @classmethod
    def for_params(cls, groups: Iterable[Sequence[torch.Tensor]]) -> GradStaging | None:
        """A staging buffer for entries whose parameters are ``groups`` (one sequence
        per callable), for each dtype whose contiguous parameters that require grad
        add up to more than twice the largest group's; ``None`` when there is none.
        Allocated now, outside any graph pool."""
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        totals: dict[tuple[torch.dtype, torch.device], int] = {}
        for params in groups:
            need: dict[tuple[torch.dtype, torch.device], int] = {}
            for p in params:
                if p.requires_grad and p.is_contiguous():
                    key = (p.dtype, p.device)
                    need[key] = need.get(key, 0) + p.numel()
            for key, n in need.items():
                sizes[key] = max(sizes.get(key, 0), n)
                totals[key] = totals.get(key, 0) + n
        # Staged, a dtype costs the buffer plus the largest entry's gradients as pool
        # temporaries: a saving only where the entries' gradients add up to more than
        # twice the largest (never for one callable: graph_stack).
        sizes = {k: n for k, n in sizes.items() if totals[k] > 2 * n}
        if not sizes:
            return None
        return cls(
            {
                (dtype, device): torch.empty(n, dtype=dtype, device=device)
                for (dtype, device), n in sizes.items()
            }
        )

    def stage(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Inside a backward capture: copy the contiguous ``grads`` into views of the
        buffers (one multi-tensor copy) and return the views in their places."""
        out: list[torch.Tensor | None] = list(grads)
        offsets: dict[tuple[torch.dtype, torch.device], int] = {}
        views, sources = [], []
        for i, g in enumerate(grads):
            if g is None or not g.is_contiguous():
                continue
            key = (g.dtype, g.device)
            buffer = self.buffers.get(key)
            start = offsets.get(key, 0)
            if buffer is None or start + g.numel() > buffer.numel():
                continue
            offsets[key] = start + g.numel()
            view = buffer[start : start + g.numel()].view(g.shape)
            views.append(view)
            sources.append(g)
            out[i] = view
        if views:
            with torch.no_grad():
                torch._foreach_copy_(views, sources)
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
