"""Pure scheduling policy for ``make_graphed_callables``: which graph is warmed up and
captured when, and which entries may share static buffers.

Vocabulary:

* callable: one of the layers passed in, ``callables[c]``.
* entry: one ``sample_args`` element; one graphed callable is returned per entry. In
  unordered mode entries and callables are the same thing. Under ``_order`` (the
  interleaved pipeline-parallel schedule) there is one entry per (chunk, microbatch,
  layer), laid out chunk by chunk, microbatch by microbatch, layer by layer.
* step: the forward or backward of one entry; a schedule is the list of steps in the
  order they are warmed up and captured (and must be replayed).

Nothing here touches a GPU, so all of it is tested on the CPU.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import CudaGraphsValueError

__all__ = [
    "Entry",
    "Layout",
    "Step",
    "assign_buffer_slots",
    "build_layout",
    "build_schedule",
]


@dataclass(frozen=True)
class Entry:
    """Where one ``sample_args`` element sits in the pipeline layout."""

    index: int  # position in sample_args and in the returned tuple
    callable_index: int  # which callable it runs
    chunk: int  # 0-based model chunk (0 in unordered mode)
    microbatch: int  # 0-based microbatch (0 in unordered mode)
    layer: int  # 0-based layer within the chunk


@dataclass(frozen=True)
class Step:
    """The forward (``"fwd"``) or backward (``"bwd"``) of one entry."""

    kind: Literal["fwd", "bwd"]
    entry: int
    callable_index: int


@dataclass(frozen=True)
class Layout:
    """Shape of the pipeline: chunks, microbatches and layers per chunk."""

    layers_per_chunk: tuple[int, ...]
    num_microbatches: int
    order: tuple[int, ...] | None  # the validated _order, None in unordered mode

    @property
    def num_chunks(self) -> int:
        return len(self.layers_per_chunk)

    @property
    def num_callables(self) -> int:
        return sum(self.layers_per_chunk)

    @property
    def num_entries(self) -> int:
        return self.num_callables * self.num_microbatches

    def first_callable(self, chunk: int) -> int:
        return sum(self.layers_per_chunk[:chunk])

    def entry_index(self, chunk: int, microbatch: int, layer: int) -> int:
        """Index into ``sample_args``: chunk-major, then microbatch, then layer."""
        return (
            self.first_callable(chunk) * self.num_microbatches
            + microbatch * self.layers_per_chunk[chunk]
            + layer
        )

    def entries(self) -> list[Entry]:
        out = []
        for chunk, layers in enumerate(self.layers_per_chunk):
            for mb in range(self.num_microbatches):
                for layer in range(layers):
                    out.append(
                        Entry(
                            index=self.entry_index(chunk, mb, layer),
                            callable_index=self.first_callable(chunk) + layer,
                            chunk=chunk,
                            microbatch=mb,
                            layer=layer,
                        )
                    )
        assert [e.index for e in out] == list(range(len(out)))
        return out


def _validate_order(order: Sequence[int]) -> tuple[tuple[int, ...], int, int]:
    """Check an ``_order`` list; return it as a tuple of Python ints with
    (num_chunks, num_microbatches). Any integer type is an int here (numpy's too, as
    ``BucketConfig`` takes them); a numpy array is taken as its list."""
    if hasattr(order, "tolist") and not isinstance(order, (str, bytes)):
        order = order.tolist()
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence) or len(order) == 0:
        raise CudaGraphsValueError(
            f"_order must be a non-empty list of non-zero ints, got {order!r}"
        )
    not_ints = [x for x in order if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
    if not_ints:
        named = ", ".join(f"{x!r} ({type(x).__name__})" for x in not_ints[:3])
        raise CudaGraphsValueError(
            f"_order holds {named}: entries are ints, 1-based chunk ids, positive for a "
            "forward and negative for a backward"
        )
    order = [int(x) for x in order]
    zeros = [pos for pos, x in enumerate(order) if x == 0]
    if zeros:
        raise CudaGraphsValueError(
            f"_order[{zeros[0]}] is 0: entries are 1-based chunk ids, positive for a "
            "forward and negative for a backward, never 0"
        )
    num_chunks = max(abs(x) for x in order)
    fwd = [0] * num_chunks
    bwd = [0] * num_chunks
    for pos, x in enumerate(order):
        c = abs(x) - 1
        if x > 0:
            fwd[c] += 1
        else:
            bwd[c] += 1
            if bwd[c] > fwd[c]:
                raise CudaGraphsValueError(
                    f"_order[{pos}] = {x} runs backward microbatch {bwd[c] - 1} of chunk "
                    f"{c + 1} before its forward"
                )
    num_microbatches = fwd[0]
    uneven = [
        f"chunk {c + 1}: {fwd[c]} forwards, {bwd[c]} backwards"
        for c in range(num_chunks)
        if fwd[c] != num_microbatches or bwd[c] != num_microbatches
    ]
    if uneven or num_microbatches == 0:
        raise CudaGraphsValueError(
            "_order must hold every chunk id 1..max(|_order|) as often forward as backward, "
            f"the same number of times for every chunk (chunk 1: {num_microbatches}); "
            f"found {uneven or 'no forwards'}"
        )
    return tuple(order), num_chunks, num_microbatches


def build_layout(
    num_callables: int,
    num_entries: int,
    order: Sequence[int] | None = None,
    num_layers_per_chunk: Sequence[int] | None = None,
) -> Layout:
    """Validate the pipeline parameters and describe the entry layout.

    Args:
        num_callables: number of callables (layers of all chunks, chunk by chunk).
        num_entries: number of ``sample_args`` elements.
        order: ``_order``; ``None`` for unordered mode.
        num_layers_per_chunk: ``_num_layers_per_chunk``; by default the callables are
            split evenly across chunks.

    Raises:
        ValueError: naming which count disagrees with which, and what it should be.
    """
    if order is None:
        if num_layers_per_chunk is not None:
            raise CudaGraphsValueError(
                "_num_layers_per_chunk is only meaningful together with _order"
            )
        if num_entries != num_callables:
            raise CudaGraphsValueError(
                f"sample_args has {num_entries} entries but there are {num_callables} "
                "callables; without _order pass one tuple of sample args per callable"
            )
        return Layout(layers_per_chunk=(num_callables,), num_microbatches=1, order=None)

    order_t, num_chunks, num_microbatches = _validate_order(order)
    if num_layers_per_chunk is None:
        if num_callables % num_chunks:
            raise CudaGraphsValueError(
                f"{num_callables} callables cannot be split evenly across the {num_chunks} "
                "chunks of _order; pass _num_layers_per_chunk"
            )
        layers = (num_callables // num_chunks,) * num_chunks
    else:
        if hasattr(num_layers_per_chunk, "tolist"):
            num_layers_per_chunk = num_layers_per_chunk.tolist()
        layers = tuple(num_layers_per_chunk)
        integral = all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in layers)
        if integral:
            layers = tuple(int(n) for n in layers)
        if len(layers) != num_chunks or not integral or any(n < 1 for n in layers):
            raise CudaGraphsValueError(
                f"_num_layers_per_chunk must hold {num_chunks} positive ints (one per chunk "
                f"of _order), got {list(layers)}"
            )
        if sum(layers) != num_callables:
            raise CudaGraphsValueError(
                f"_num_layers_per_chunk sums to {sum(layers)} but there are {num_callables} "
                "callables"
            )
    layout = Layout(layers_per_chunk=layers, num_microbatches=num_microbatches, order=order_t)
    if num_entries != layout.num_entries:
        raise CudaGraphsValueError(
            f"sample_args has {num_entries} entries; _order describes {num_chunks} chunk(s) x "
            f"{num_microbatches} microbatch(es) with {list(layers)} layers per chunk, which "
            f"needs {layout.num_entries} (ordered by chunk, then microbatch, then layer)"
        )
    return layout


def build_schedule(layout: Layout, training: bool) -> list[Step]:
    """The order in which entries are warmed up and captured.

    Unordered: every forward in callable order, then (training) every backward in
    reverse order. Ordered: ``_order`` step by step; a positive chunk id runs the
    forward of that chunk's next microbatch through its layers in order, a negative
    one the backward of its next microbatch through its layers in reverse. Without
    training, backward steps are left out.
    """
    entries = {(e.chunk, e.microbatch, e.layer): e for e in layout.entries()}
    steps: list[Step] = []

    def add(kind: Literal["fwd", "bwd"], chunk: int, mb: int, layer: int) -> None:
        e = entries[(chunk, mb, layer)]
        steps.append(Step(kind=kind, entry=e.index, callable_index=e.callable_index))

    if layout.order is None:
        n = layout.num_callables
        for layer in range(n):
            add("fwd", 0, 0, layer)
        if training:
            for layer in reversed(range(n)):
                add("bwd", 0, 0, layer)
        return steps

    next_fwd = [0] * layout.num_chunks
    next_bwd = [0] * layout.num_chunks
    for x in layout.order:
        chunk = abs(x) - 1
        layers = range(layout.layers_per_chunk[chunk])
        if x > 0:
            for layer in layers:
                add("fwd", chunk, next_fwd[chunk], layer)
            next_fwd[chunk] += 1
        else:
            if training:
                for layer in reversed(layers):
                    add("bwd", chunk, next_bwd[chunk], layer)
            next_bwd[chunk] += 1
    return steps


def assign_buffer_slots(schedule: Sequence[Step], entry_keys: Sequence[object]) -> list[int]:
    """Give entries whose lifetimes do not overlap the same static-buffer slot.

    An entry is live from its forward to its backward. Entries can share a slot only
    if they have the same key (same callable and same input/output shapes, so the
    buffers fit). Each forward takes the lowest free slot of its key, or opens a new
    one; each backward frees its entry's slot. Replays must then follow the schedule,
    which is also what graph capture into one shared pool requires.

    Args:
        schedule: from :func:`build_schedule` (training, so every forward has a backward).
        entry_keys: per entry, what must be equal for two entries to share buffers.

    Returns:
        Per entry, a slot id; entries with equal slot ids share buffers. Slot ids are
        numbered globally from 0 in order of first use.

    Raises:
        CudaGraphsValueError: an entry's backward comes before its forward, or an
            entry has no forward.
    """
    free: dict[object, list[int]] = {}
    slot_of: dict[int, int] = {}
    next_slot = 0
    for step in schedule:
        key = entry_keys[step.entry]
        if step.kind == "fwd":
            pool = free.setdefault(key, [])
            if pool:
                pool.sort()
                slot_of[step.entry] = pool.pop(0)
            else:
                slot_of[step.entry] = next_slot
                next_slot += 1
        else:
            if step.entry not in slot_of:
                raise CudaGraphsValueError(
                    f"entry {step.entry}: its backward comes before its forward in the "
                    "schedule; an entry's buffers live from its forward to its backward"
                )
            free[key].append(slot_of[step.entry])
    missing = [i for i in range(len(entry_keys)) if i not in slot_of]
    if missing:
        raise CudaGraphsValueError(f"entries {missing} have no forward step in the schedule")
    return [slot_of[i] for i in range(len(entry_keys))]
