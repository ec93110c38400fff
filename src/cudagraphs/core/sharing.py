"""Static buffers that the entries of one ``make_graphed_callables`` call share, beyond
the one memory pool: what the caller asks for (:class:`BufferSharing`) and its check
against the plan. The partial-graph layer asks for it for the decoder layers of one
capture; the buffers themselves are made in :mod:`.capture_phase`.

Vocabulary:

* incoming-gradient buffer: the static tensor a backward replay reads the gradient of
  an output from; the replay path copies autograd's gradient into it first.
* chained input: a static input that is, rather than a buffer of its own, the static
  output of an entry captured before it (the next decoder layer's hidden states are
  the last one's output), so the call passes the buffer itself and nothing is copied.

Why the lifetimes allow it:

* An incoming-gradient buffer is read only by its own backward replay, right after
  the copy into it, and backward replays run one at a time on the stream of the
  backward pass: entries whose differentiable outputs have equal shapes can use one
  buffer each step. A backward that hands the buffer itself back as a gradient (an
  input added to the output unchanged) is given a copy inside its graph, so nothing
  handed out ever is the shared buffer.
* A chained input holds the values its source entry produced, for as long as that
  output lives, so the same memory serves both. The replay path refuses a call that
  passes anything but the buffer there (copying into it would overwrite the source's
  output, which the caller may still hold); when the source's graphs are released, the
  buffer becomes the chained entry's own and calls are copied in again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import CudaGraphsTypeError, CudaGraphsValueError

__all__ = ["BufferSharing", "chained_inputs", "check_sharing"]

#: ``(entry index, tensor input index)``: a static input of an entry. Tensor inputs are
#: counted in the order pytree flattens the entry's ``(args, kwargs)``, keywords sorted.
InputSlot = tuple[int, int]
#: ``(entry index, tensor output index)``: a static output, counted the same way.
OutputSlot = tuple[int, int]


@dataclass(frozen=True)
class BufferSharing:
    """What the entries of one capture share (see the module docs).

    Attributes:
        grad_outputs: entries whose differentiable outputs have the same shapes,
            dtypes and devices share their incoming-gradient buffers.
        chained_inputs: per static input, the earlier entry's static output it is.
            A link whose shapes, dtypes or strides do not match at capture is left out
            (the input gets a buffer of its own).
    """

    grad_outputs: bool = False
    chained_inputs: Mapping[InputSlot, OutputSlot] = field(default_factory=dict)


def check_sharing(sharing: object, n_entries: int, ordered: bool) -> BufferSharing | None:
    """``sharing`` as ``make_graphed_callables`` takes it (``None``: nothing shared).

    Raises:
        CudaGraphsTypeError: not a :class:`BufferSharing`, or links that are not a
            mapping of pairs of ints to pairs of ints.
        CudaGraphsValueError: a link names an entry out of range, a source that is not
            captured before its input's entry, or comes with ``_order`` (whose schedule
            interleaves the forwards of micro-batches, so a source may be replayed
            again before the chained entry's backward has read its output).
    """
    if sharing is None:
        return None
    if not isinstance(sharing, BufferSharing):
        raise CudaGraphsTypeError(
            f"_buffer_sharing must be a BufferSharing or None, got {type(sharing).__name__}"
        )
    links = sharing.chained_inputs
    if not isinstance(links, Mapping) or not all(
        _is_slot(k) and _is_slot(v) for k, v in links.items()
    ):
        raise CudaGraphsTypeError(
            "_buffer_sharing.chained_inputs must map (entry, tensor input index) to "
            f"(source entry, tensor output index), pairs of ints; got {links!r}"
        )
    if links and ordered:
        raise CudaGraphsValueError(
            "_buffer_sharing.chained_inputs cannot be used with _order (an interleaved "
            "schedule may replay a source again before the chained entry's backward "
            "read its output); drop one of them"
        )
    for (entry, index), (source, out) in sharing.chained_inputs.items():
        where = f"_buffer_sharing.chained_inputs[({entry}, {index})] = ({source}, {out})"
        if min(entry, index, source, out) < 0 or max(entry, source) >= n_entries:
            raise CudaGraphsValueError(
                f"{where}: entries are 0 to {n_entries - 1} and indices are not negative"
            )
        if source >= entry:
            raise CudaGraphsValueError(
                f"{where}: the source entry must come before the entry it feeds (it is "
                "captured, and replayed, first)"
            )
    return sharing


def _is_slot(value: object) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def chained_inputs(
    sharing: BufferSharing | None,
    index: int,
    inputs: Sequence[torch.Tensor],
    outputs_of: Callable[[int], Sequence[torch.Tensor] | None],
) -> dict[int, tuple[torch.Tensor, int]]:
    """The chained static inputs of entry ``index``, whose sample tensor inputs are
    ``inputs``: per tensor input index, the static input to capture with (a new leaf
    over the source's static output, so the chained entry's backward gets its gradient
    and the source's captured autograd graph is not touched) and the source entry.

    ``outputs_of(source)`` gives a source's static tensor outputs once it is captured
    (``None`` before). A link is left out, the input getting a buffer of its own,
    when the source is not captured, an index is out of range, the sample is a
    parameter (read in place anyway), or the output differs from the sample in shape,
    dtype, device or strides (the graph would read another layout than a copy gives).
    """
    found: dict[int, tuple[torch.Tensor, int]] = {}
    if sharing is None:
        return found
    for (entry, i), (source, out_index) in sharing.chained_inputs.items():
        outs = outputs_of(source) if entry == index else None
        if outs is None or i >= len(inputs) or out_index >= len(outs):
            continue
        want, out = inputs[i], outs[out_index]
        if isinstance(want, torch.nn.Parameter):
            continue
        if (out.shape, out.dtype, out.device, out.stride()) == (
            want.shape,
            want.dtype,
            want.device,
            want.stride(),
        ):
            found[i] = (out.detach().requires_grad_(want.requires_grad), source)
    return found
