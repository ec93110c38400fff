"""Interleaved pipeline-parallel driver shared by the GPU tests.

Import-safe without a GPU: nothing here touches CUDA until a test calls it.

The layout matches ``make_graphed_callables(..., _order=...)``: ``callables`` are the
layers of every chunk, chunk by chunk, and ``sample_args`` has one entry per (chunk,
microbatch, layer), ordered chunk-major, then microbatch, then layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: Interleaved 1F1B on one pipeline rank with 2 model chunks and 3 microbatches.
INTERLEAVED_ORDER = (1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1)
NUM_CHUNKS = 2
LAYERS_PER_CHUNK = 2
NUM_MICROBATCHES = 3


def check_order(order: Sequence[int], num_chunks: int, num_microbatches: int) -> None:
    """Assert that ``order`` is a valid schedule that a single rank can also execute.

    Every chunk runs ``num_microbatches`` forwards and backwards, no backward comes
    before its forward, chunk ``c + 1`` runs microbatch ``m`` forward only after chunk
    ``c`` did (it consumes that output), and chunk ``c`` runs microbatch ``m`` backward
    only after chunk ``c + 1`` did (it consumes that input gradient).
    """
    fwd = [0] * num_chunks
    bwd = [0] * num_chunks
    for pos, x in enumerate(order):
        assert x != 0 and abs(x) <= num_chunks, f"_order[{pos}] = {x} is not a chunk id"
        c = abs(x) - 1
        if x > 0:
            assert c == 0 or fwd[c - 1] > fwd[c], (
                f"_order[{pos}]: forward of chunk {c + 1} microbatch {fwd[c]} before "
                f"chunk {c} produced it"
            )
            fwd[c] += 1
        else:
            assert bwd[c] < fwd[c], f"_order[{pos}]: backward of chunk {c + 1} before its forward"
            assert c == num_chunks - 1 or bwd[c + 1] > bwd[c], (
                f"_order[{pos}]: backward of chunk {c + 1} microbatch {bwd[c]} before "
                f"chunk {c + 2} produced its gradient"
            )
            bwd[c] += 1
    assert fwd == [num_microbatches] * num_chunks, f"forwards per chunk: {fwd}"
    assert bwd == [num_microbatches] * num_chunks, f"backwards per chunk: {bwd}"


def entry_index(
    chunk: int, microbatch: int, layer: int, layers_per_chunk: int, num_microbatches: int
) -> int:
    """Position in ``sample_args`` (and in the returned tuple) of one (chunk, mb, layer)."""
    return (chunk * num_microbatches + microbatch) * layers_per_chunk + layer


@dataclass
class PipelineRun:
    outputs: list[torch.Tensor]  # per microbatch, a copy of the last chunk's output
    boundary_grads: list[torch.Tensor]  # gradients that crossed chunk boundaries, in order


def run_pipeline(
    layer: Callable[[int, int, int], Callable[[torch.Tensor], torch.Tensor]],
    order: Sequence[int],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    *,
    num_chunks: int,
    layers_per_chunk: int,
) -> PipelineRun:
    """Run one pipeline iteration following ``order``, like a real pipeline rank would.

    ``layer(chunk, microbatch, layer_index)`` returns what to call for that layer (an
    eager module, or the graphed callable of that entry). At chunk boundaries the
    activation is detached and made a leaf that requires grad, as it would be after a
    send/receive; the backward of chunk ``c`` starts from the gradient that arrived at
    chunk ``c + 1``'s input. ``inputs[m]`` is microbatch ``m``'s data (its ``.grad``
    accumulates), ``grad_outputs[m]`` the gradient of the last chunk's output.
    """
    next_fwd = [0] * num_chunks
    next_bwd = [0] * num_chunks
    chunk_inputs: dict[tuple[int, int], torch.Tensor] = {}
    chunk_outputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: list[torch.Tensor | None] = [None] * len(inputs)
    boundary_grads: list[torch.Tensor] = []
    for x in order:
        c = abs(x) - 1
        if x > 0:
            m = next_fwd[c]
            next_fwd[c] += 1
            # A stage boundary: the received activation is a fresh leaf that requires grad.
            h = inputs[m] if c == 0 else chunk_outputs[(c - 1, m)].detach().requires_grad_(True)
            chunk_inputs[(c, m)] = h
            for i in range(layers_per_chunk):
                h = layer(c, m, i)(h)
            chunk_outputs[(c, m)] = h
            if c == num_chunks - 1:
                outputs[m] = h.detach().clone()
        else:
            m = next_bwd[c]
            next_bwd[c] += 1
            if c == num_chunks - 1:
                grad = grad_outputs[m]
            else:
                grad = chunk_inputs[(c + 1, m)].grad
                assert grad is not None, f"no gradient reached chunk {c + 2} microbatch {m}"
                boundary_grads.append(grad.clone())
            torch.autograd.backward(chunk_outputs.pop((c, m)), grad)
    assert all(o is not None for o in outputs), "order left a microbatch without a forward"
    return PipelineRun(outputs=outputs, boundary_grads=boundary_grads)


def reference_log(
    order: Sequence[int], layers_per_chunk: Sequence[int], num_microbatches: int
) -> list[tuple]:
    """The capture-time hooks, forwards and backwards of one warmup iteration (or of
    the capture) as ``_order`` describes it, each ``(what, callable index, entry
    index)`` with ``what`` one of ``"hook"`` (then a group name, not an entry),
    ``"call"`` (a forward), ``"bwd"`` (a backward): a positive
    chunk id runs that chunk's next microbatch forward through its layers in order, a
    negative one the next backward through its layers in reverse. Entries are ordered
    by chunk, then microbatch, then layer; callables by chunk, then layer."""
    first_callable = [sum(layers_per_chunk[:c]) for c in range(len(layers_per_chunk))]
    first_entry = [num_microbatches * f for f in first_callable]
    done = {"fwd": [0] * len(layers_per_chunk), "bwd": [0] * len(layers_per_chunk)}
    log = []
    for x in order:
        c, kind = abs(x) - 1, "fwd" if x > 0 else "bwd"
        mb = done[kind][c]
        done[kind][c] += 1
        layers = range(layers_per_chunk[c])
        for layer in layers if kind == "fwd" else reversed(layers):
            callable_index = first_callable[c] + layer
            entry = first_entry[c] + mb * layers_per_chunk[c] + layer
            if kind == "fwd":
                log += [
                    ("hook", callable_index, "forward_pre_hooks"),
                    ("call", callable_index, entry),
                    ("hook", callable_index, "forward_hooks"),
                ]
            else:
                log += [
                    ("hook", callable_index, "backward_pre_hooks"),
                    ("bwd", callable_index, entry),
                    ("hook", callable_index, "backward_hooks"),
                ]
    return log
