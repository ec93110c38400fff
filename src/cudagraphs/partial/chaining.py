"""Which recorded calls feed on another target's output, so that their graphs share
buffers (:class:`~cudagraphs.core.sharing.BufferSharing`): the next decoder layer's
static input is then the last layer's static output, with no buffer and no copy of its
own, and the targets of one capture share their incoming-gradient buffers.

A policy in two halves, one per phase: while recording (called by
:class:`~.recording.Recorder`), :class:`OutputLinks` keeps in each recorded variant
(``RecordedVariant.chained``) the inputs that were another target's output in every
recorded call of it (:func:`merge_links`); at capture (called by :mod:`.graphing`),
:func:`group_sharing` turns the links of one captured group into the core's sharing.

Why from recording: only the real step shows which tensor a call received. A decoder
layer's hidden states are the previous layer's output object itself; a norm's output,
a residual sum or a tensor the model changed in place are not, and chaining those
would make the graph read a buffer the model does not pass. At replay the core refuses
a call that passes another tensor there (:class:`~cudagraphs.errors.ChainedInputError`),
and the target runs eagerly for that call, counted as ``fallback_unchained_input``.

Tensor inputs are counted as the graph counts them: parameters first, then the call's
tensors in pytree order, keywords sorted. A target is named by its recording object,
compared by identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core.sharing import BufferSharing
from .contract import flatten_call

__all__ = ["Link", "OutputLinks", "group_sharing", "merge_links"]

#: Where an input came from: the target (its recording), its variant index, the tensor
#: output index.
Link = tuple[Any, int, int]


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


class OutputLinks:
    """While recording: the tensor outputs of the targets' calls in the forward that
    runs now, by tensor identity."""

    def __init__(self) -> None:
        # id(tensor) -> (the tensor, kept so the id stays its own; where it came from)
        self._outputs: dict[int, tuple[torch.Tensor, Link]] = {}
        self._forward: int | None = None

    def clear(self) -> None:
        self._outputs = {}
        self._forward = None

    def enter(self, forward: int | None) -> None:
        """A call in ``forward``: the outputs of an earlier forward (micro-batch) are not
        what this one passes, and are forgotten."""
        if forward != self._forward:
            self._outputs = {}
            self._forward = forward

    def note_call(
        self,
        owner: Any,
        recorded: Any,
        params: Sequence[torch.Tensor],
        args: tuple,
        kwargs: dict,
        forward: int | None,
    ) -> None:
        """A recorded call of ``owner`` in ``forward``, recorded as the variant
        ``recorded`` (a :class:`~.recording.RecordedVariant`): keep in its ``chained``
        the links every recorded call of that variant had. A variant already captured
        keeps the links it was captured with."""
        self.enter(forward)
        if recorded.graph is None:
            found = self.inputs_of(owner, params, args, kwargs)
            recorded.chained = merge_links(recorded.chained, found)

    def inputs_of(
        self, owner: Any, params: Sequence[torch.Tensor], args: tuple, kwargs: dict
    ) -> dict[int, Link]:
        """Tensor input index -> :data:`Link` for each input of ``owner``'s call (its
        ``params`` first, then ``args`` and ``kwargs``) that is another target's output
        in this forward."""
        leaves, _ = flatten_call((tuple(params), *args), kwargs)
        found = {}
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        for i, t in enumerate(tensors):
            hit = self._outputs.get(id(t))
            if hit is not None and hit[0] is t and hit[1][0] is not owner:
                found[i] = hit[1]
        return found

    def note_output(self, owner: Any, variant: int, output: Any, forward: int | None) -> None:
        """The output of a recorded call of ``owner`` (variant ``variant``)."""
        self.enter(forward)
        for q, t in enumerate(_tensor_leaves(output)):
            self._outputs[id(t)] = (t, (owner, variant, q))


def merge_links(before: dict[int, Link] | None, found: dict[int, Link]) -> dict[int, Link]:
    """The links of a variant after one more recorded call found ``found``: those of
    the first call, then only those every call had (``before`` is ``None`` before the
    first)."""
    if before is None:
        return found
    return {i: s for i, s in found.items() if _same(before.get(i), s)}


def _same(a: Link | None, b: Link) -> bool:
    # By identity: the owners are dataclasses whose == would compare their fields.
    return a is not None and a[0] is b[0] and a[1:] == b[1:]


def group_sharing(group: Sequence[tuple[Any, int]]) -> BufferSharing:
    """The sharing of one captured group (``(recording, variant index)`` in capture
    order; each variant's ``chained`` links are read): incoming-gradient buffers by
    shape, and each recorded link whose source is captured earlier in the same group,
    by position in the group."""
    position = {(id(owner), i): n for n, (owner, i) in enumerate(group)}
    links = {}
    for n, (owner, i) in enumerate(group):
        for index, (source, variant, out) in (owner.variants[i].chained or {}).items():
            at = position.get((id(source), variant))
            if at is not None and at < n:
                links[(n, index)] = (at, out)
    return BufferSharing(grad_outputs=True, chained_inputs=links)
