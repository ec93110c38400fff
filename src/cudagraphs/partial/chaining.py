"""Which recorded calls feed on another target's output, so that their graphs share
buffers (:class:`~cudagraphs.core.sharing.BufferSharing`): the next decoder layer's
static input is then the last layer's static output, with no buffer and no copy of its
own, and the targets of one capture share their incoming-gradient buffers.

Why from recording: only the real step shows which tensor a call received. A decoder
layer's hidden states are the previous layer's output object itself; a norm's output,
a residual sum or a tensor the model changed in place are not, and chaining those
would make the graph read a buffer the model does not pass. A link is kept only when
every recorded call of the variant had it; at replay the core refuses a call that
passes another tensor there (:class:`~cudagraphs.errors.ChainedInputError`), and the
target runs eagerly for that call, counted as ``fallback_unchained_input``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ..core.sharing import BufferSharing
from .contract import flatten_call

if TYPE_CHECKING:
    from .entry import PartialGraphEntry

__all__ = ["OutputLinks", "group_sharing"]

#: A recorded output: the target, its variant index, the tensor output index.
Source = tuple["PartialGraphEntry", int, int]


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


class OutputLinks:
    """While recording: the tensor outputs of the targets' calls in the forward that
    runs now, and per recorded variant the inputs that were one of them
    (``RecordedVariant.chained``: tensor input index -> :data:`Source`). Tensor inputs
    are counted as the graph counts them: parameters first, then the call's tensors in
    pytree order, keywords sorted."""

    def __init__(self) -> None:
        # id(tensor) -> (the tensor, kept so the id stays its own; where it came from)
        self._outputs: dict[int, tuple[torch.Tensor, Source]] = {}
        self._forward: int | None = None

    def clear(self) -> None:
        self._outputs = {}
        self._forward = None

    def _enter(self, forward: int | None) -> None:
        # Outputs of an earlier forward (micro-batch) are not what this one passes.
        if forward != self._forward:
            self._outputs = {}
            self._forward = forward

    def note_call(
        self,
        entry: PartialGraphEntry,
        variant: int,
        params: Sequence[torch.Tensor],
        args: tuple,
        kwargs: dict,
        forward: int | None,
    ) -> None:
        """A recorded call of ``entry`` (its variant ``variant``) in ``forward``: keep
        the links every recorded call of that variant had. A variant already
        captured keeps the links it was captured with."""
        self._enter(forward)
        recorded = entry.variants[variant]
        if recorded.graph is not None:
            return
        leaves, _ = flatten_call((tuple(params), *args), kwargs)
        found = {}
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        for i, t in enumerate(tensors):
            hit = self._outputs.get(id(t))
            if hit is not None and hit[0] is t and hit[1][0] is not entry:
                found[i] = hit[1]
        if recorded.chained is None:
            recorded.chained = found
        else:
            before = recorded.chained
            recorded.chained = {i: s for i, s in found.items() if _same(before.get(i), s)}

    def note_output(
        self, entry: PartialGraphEntry, variant: int, output: Any, forward: int | None
    ) -> None:
        """The output of a recorded call of ``entry`` (variant ``variant``)."""
        self._enter(forward)
        for q, t in enumerate(_tensor_leaves(output)):
            self._outputs[id(t)] = (t, (entry, variant, q))


def _same(a: Source | None, b: Source) -> bool:
    # By identity: targets are dataclasses whose == would compare their fields.
    return a is not None and a[0] is b[0] and a[1:] == b[1:]


def group_sharing(group: Sequence[tuple[PartialGraphEntry, int]]) -> BufferSharing:
    """The sharing of one captured group (``(entry, variant)`` in capture order):
    incoming-gradient buffers by shape, and each recorded link whose source is
    captured earlier in the same group, by position in the group."""
    position = {(id(entry), i): n for n, (entry, i) in enumerate(group)}
    links = {}
    for n, (entry, i) in enumerate(group):
        for index, (source, variant, out) in (entry.variants[i].chained or {}).items():
            at = position.get((id(source), variant))
            if at is not None and at < n:
                links[(n, index)] = (at, out)
    return BufferSharing(grad_outputs=True, chained_inputs=links)
