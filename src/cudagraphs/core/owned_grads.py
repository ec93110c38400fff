"""Owned copies of a backward graph's parameter gradients, made at each replay.

The default contract (Transformer Engine 2.20's, ``clone_param_grads_on_return=True``):
every parameter gradient a backward replay hands to autograd is a tensor of its own,
which no later replay writes. On a launch-bound step the copy costs host time, not
device time: ``torch._foreach_mul(buffers, 1.0)`` allocates each output separately
(one ``empty_like`` through the dispatcher and the caching allocator per parameter).
:class:`GradCopier` instead concatenates the buffers of one dtype into one new tensor
(one allocation, one ``torch.cat`` launch) and hands out views of it, one per
parameter, shaped as its buffer.

What that means for the gradients: those of one replay and one dtype share a storage,
as the views of a data-parallel gradient bucket do; each is still owned (no replay
writes it), and autograd adopts each as ``.grad`` without a copy (a fresh view with
the parameter's layout). A gradient kept past ``zero_grad(set_to_none=True)`` (a
hook's) keeps the whole block of that replay alive. Buffers that are not contiguous
(a transposed parameter's) are cloned one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GradCopier"]


@dataclass(frozen=True)
class _Block:
    """Buffers of one dtype and device, copied as one tensor."""

    positions: tuple[int, ...]  # their indices in the copier's order
    sources: tuple[torch.Tensor, ...]  # 1-D views of the buffers
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]


@dataclass(frozen=True)
class GradCopier:
    """Made once per backward graph from its static gradient buffers (borrowed);
    calling it returns an owned copy of each, in order."""

    count: int
    blocks: tuple[_Block, ...] = ()
    singles: tuple[tuple[int, torch.Tensor], ...] = field(default=())  # cloned alone

    @classmethod
    def of(cls, buffers: list[torch.Tensor]) -> GradCopier:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        singles = []
        for i, b in enumerate(buffers):
            if b.is_contiguous():
                groups.setdefault((b.dtype, b.device), []).append(i)
            else:
                singles.append((i, b.detach()))
        blocks = tuple(
            _Block(
                positions=tuple(idx),
                sources=tuple(buffers[i].detach().view(-1) for i in idx),
                numels=tuple(buffers[i].numel() for i in idx),
                shapes=tuple(buffers[i].shape for i in idx),
            )
            for idx in groups.values()
        )
        return cls(count=len(buffers), blocks=blocks, singles=tuple(singles))

    def __call__(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [None] * self.count  # type: ignore[list-item]
        for block in self.blocks:
            if len(block.sources) == 1:
                out[block.positions[0]] = block.sources[0].clone().view(block.shapes[0])
                continue
            flat = torch.cat(block.sources)
            for pos, part, shape in zip(block.positions, flat.split(block.numels), block.shapes):
                out[pos] = part.view(shape)
        for pos, b in self.singles:
            out[pos] = b.clone()
        return out
