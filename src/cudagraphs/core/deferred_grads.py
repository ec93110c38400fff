"""Owned parameter gradients that cost a copy only when something keeps them:
``make_graphed_callables``'s owned mode (``clone_param_grads_on_return=True``) under
``CUDAGRAPHS_OWNED_GRADS=defer``, in a pool of the call's own.

The owned contract (Transformer Engine 2.20's, TE PR 2937): a gradient a hook,
``.grad`` or any other reference keeps is never overwritten by a later replay. The
plain way to keep it is a copy of every parameter gradient at every backward replay,
outside the graph pool. Those copies cannot take the place of the activations the
pool holds, as eager's gradients take theirs, so graphs that replay inside an eager
step held up to ``min(activations, gradients)`` more than eager: 1.17x to 1.19x of
eager's peak on a 16-layer, hidden-2048 Llama at batch 1 (issue 36).

Here a backward replay hands out the gradient buffers themselves, as lent mode does
(:mod:`.lent_grads`), and copies only what is still referenced when a replay that
could overwrite it comes. Under ``zero_grad(set_to_none=True)`` nothing is, so no
copy is made at all. Whether anything else refers to a buffer is its storage's use
count against the count with nothing handed out (:func:`~cudagraphs.torch_private.
storage_use_count`). A buffer is moved out by copying its bytes into fresh memory,
then one of two ways:

* where torch can exchange two storages' memory (``UntypedStorage._swap_data_ptr_``,
  torch 2.13 has it; :func:`~cudagraphs.torch_private.swap_storage_data`), the
  buffer's storage takes the copy and the graph's own tensors are pointed back at
  the graph memory: every tensor on it reads the copy, ``.grad``, a tensor a hook
  kept and any view of either;
* elsewhere (torch 2.11), each tensor handed out that is still alive, and each
  parameter's ``.grad`` on the buffer, is pointed at the copy (``tensor.data = ...``,
  which every Python name of it follows: a hook's kept gradient, ``kept = p.grad``
  while it still is ``.grad``). Two kinds of tensor are out of reach: a *view* of
  one, and a ``.grad`` kept under another name after ``.grad`` was set to ``None``
  (autograd makes ``.grad`` a tensor of its own, which cudagraphs never sees). One
  still referenced raises :class:`~cudagraphs.errors.KeptGradientViewError` before
  the replay that would overwrite it.

Which replays can overwrite a buffer: only graphs captured *before* it was allocated.
A graph captured later never got its memory, which was in use throughout. So each
held storage carries the capture number of the backward graph that writes it, and a
replay of the graph captured ``n``-th moves out the held storages numbered above
``n`` first (:meth:`DeferredCopies.settle`). In the usual order (forwards, then the
backwards in reverse) no backward of a step moves anything and the next step's first
forward moves what is still kept. A buffer's own backward graph moves it before it
replays again (:meth:`DeferredCopies.settle_own`).

The same hand-out serves *owned outputs* (``EntryGraphs.owned_outputs``: partial
graphs' ``"model"`` scope, whose logits and loss reach the caller's code, which may
keep them past the next step): a forward replay hands out its static outputs, held
under the forward graph's capture number, and the next replay that could overwrite
one (that graph's own next forward, or a graph captured before it) moves out what is
still referenced. Without the exchange, an output kept by a tensor out of reach (a
view, a ``.detach()``, as ``transformers.Trainer`` keeps its loss) raises
:class:`~cudagraphs.errors.KeptOutputViewError` there instead, and that output is
copied at every replay from then on (``HeldStorage.out_of_reach``); small outputs
(under :data:`SMALL_OUTPUT_BYTES`: a loss) are copied from the start there, a copy
that costs nothing.

What this asks of the caller: an address. A ``.grad`` kept past the next step's first
forward moves to memory of its own at that point, once, so code that recorded the
address of such a ``.grad`` (a CUDA graph of its own optimizer step, say) must record
it after that. ``CUDAGRAPHS_OWNED_GRADS=copy`` copies at every replay instead (the
default is ``defer``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import KeptGradientViewError, KeptOutputViewError
from ..settings import owned_grads_deferred
from ..torch_private import (
    can_count_storage_uses,
    can_move_storages,
    storage_object_uses,
    storage_use_count,
    swap_storage_data,
    view_base,
)

__all__ = [
    "SMALL_OUTPUT_BYTES",
    "DeferredCopies",
    "DeferredCopyStats",
    "HeldStorage",
    "defers_owned_copies",
    "held_storages",
    "move_out",
]


#: Without the storage exchange, owned outputs smaller than this are copied at every
#: replay rather than handed out (a loss: a kept ``.detach()`` of it is common, and out
#: of reach there).
SMALL_OUTPUT_BYTES = 1 << 16


def defers_owned_copies() -> bool:
    """Whether owned gradients are handed out as graph memory now:
    ``CUDAGRAPHS_OWNED_GRADS=defer``, on a torch that can count a storage's uses."""
    return can_count_storage_uses() and owned_grads_deferred()


@dataclass(frozen=True)
class DeferredCopyStats:
    """What deferral did for one graphed entry: whether its owned gradients are handed
    out as graph memory, and the copies moves made so far in its pool (storages and
    bytes, counted for the pool: every entry of one call shares them). Many moves
    per step mean something keeps the gradients each step (``.grad`` accumulated
    without ``zero_grad(set_to_none=True)``, a hook's list): correct, at the copies'
    cost."""

    deferred: bool
    moves: int
    moved_bytes: int


@dataclass(eq=False)
class HeldStorage:
    """One storage of graph memory that owned gradients are handed out from.

    ``storage`` and ``tensors`` are the graph's own (a move by exchange replaces the
    first and re-points the second); ``base`` is the storage's use count with nothing
    handed out; ``seq`` the capture number of the backward graph that writes it;
    ``handed`` the tensors on it handed out since it was last checked (weakly);
    ``params`` the parameters whose gradients it holds (autograd makes ``.grad`` a
    tensor of its own on the storage, not the one handed out); ``label`` names it in
    errors; ``kind`` says what it holds, ``"gradient"`` or ``"output"``;
    ``out_of_reach``: an output storage a move could not free of every keeper once,
    copied at every replay from then on."""

    storage: torch.UntypedStorage = field(repr=False)
    tensors: tuple[torch.Tensor, ...] = field(repr=False)
    base: int
    seq: int
    label: str = ""
    kind: str = "gradient"
    out_of_reach: bool = False
    params: tuple[torch.nn.Parameter, ...] = field(default=(), repr=False)
    handed: list[weakref.ref] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes()

    def hand(self, t: torch.Tensor) -> None:
        """Note ``t`` (on this storage) as handed out."""
        self.handed.append(weakref.ref(t))

    def referenced_elsewhere(self) -> bool:
        return storage_use_count(self.storage) > self.base


def held_storages(
    tensors: Sequence[torch.Tensor | None], seq: int, label: str = "", kind: str = "gradient"
) -> tuple[HeldStorage, ...] | None:
    """The storages of ``tensors`` (a backward graph's gradient outputs, or a forward
    graph's static outputs: ``kind``), each with every one of ``tensors`` on it;
    ``None`` when one of them is referenced by anything else now (its use count would
    then not tell a keeper from the graph), and the caller copies as before.

    Storages of no bytes are left out: a replay writes nothing there."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes() > 0:
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    # A storage object counts itself once (its Python object holds the C++ storage).
    own = storage_object_uses()
    held = []
    for group in groups.values():
        # A view holds its base tensor (autograd's view record): one more tensor of
        # the graph's on the storage, moved along with the views.
        bases: dict[int, torch.Tensor] = {}
        for t in group:
            b = view_base(t)
            if b is not None and all(b is not u for u in group):
                bases[id(b)] = b
        storage = group[0].untyped_storage()
        base = storage_use_count(storage)
        if base != len(group) + len(bases) + own:
            return None
        held.append(HeldStorage(storage, (*group, *bases.values()), base, seq, label, kind))
    return tuple(held)


def move_out(held: Sequence[HeldStorage], exchange: bool) -> tuple[int, int]:
    """Give everything that still refers to one of ``held`` a copy of its bytes, in
    memory of its own, and leave the graph's tensors on the graph memory; one fused
    copy for all. ``exchange``: move by exchanging storage memory (where torch can:
    :func:`~cudagraphs.torch_private.can_move_storages`), else by re-pointing what
    was handed out. Returns how many storages moved and their bytes.

    Raises:
        KeptGradientViewError: without the exchange, something other than a tensor
            handed out (a view of one) still refers to a gradient storage; everything
            else was moved, and the caller's replay must not run.
        KeptOutputViewError: the same for an output storage (and none of gradients).
    """
    busy = []
    for h in held:
        if h.referenced_elsewhere():
            busy.append(h)
        else:
            h.handed.clear()  # none of them is alive: nothing refers to the storage
    if not busy:
        return 0, 0
    with torch.no_grad():
        srcs = [
            torch.empty(0, dtype=torch.uint8, device=h.storage.device).set_(h.storage) for h in busy
        ]
        dsts = [torch.empty_like(s) for s in srcs]
        torch._foreach_copy_(dsts, srcs)
        del srcs
        left = []
        for h, d in zip(busy, dsts):
            fresh = d.untyped_storage()
            if exchange:
                # The keepers' storage now holds the copy, ``fresh`` the graph memory.
                swap_storage_data(h.storage, fresh)
                for t in h.tensors:
                    t.set_(fresh, t.storage_offset(), t.size(), t.stride())
                h.storage = fresh
            else:
                _repoint_handed(h, fresh)
                if h.referenced_elsewhere():
                    left.append(h)
            h.handed.clear()
    if left:
        names = ", ".join(h.label or f"storage at {h.storage.data_ptr():#x}" for h in left)
        for h in left:
            h.out_of_reach = h.kind == "output"
        if all(h.kind == "output" for h in left):
            raise KeptOutputViewError(
                f"an output that a forward replay handed out as graph memory is still "
                f"referenced by a tensor torch {torch.__version__} gives no way to move "
                f"({names}): a view of it or a .detach() of it. The next replay would "
                "overwrite it, so it did not run, and the output is copied at every "
                "replay from now on. Fix: keep a .clone() of the output instead, or use "
                "a torch with UntypedStorage._swap_data_ptr_ (2.13 has it). What could "
                "be moved was; call again once that tensor is dropped."
            )
        raise KeptGradientViewError(
            f"a parameter gradient that a backward replay handed out as graph memory is "
            f"still referenced by a tensor torch {torch.__version__} gives no way to move "
            f"({names}): a view of it, or a .grad kept under another name after .grad was "
            "set to None. The next replay would overwrite it, so it did not run. Fix: "
            "keep a .clone() instead, or set CUDAGRAPHS_OWNED_GRADS=copy (a copy of "
            "every gradient at every replay), or use a torch with "
            "UntypedStorage._swap_data_ptr_ (2.13 has it). What could be moved was; "
            "call again once that tensor is dropped."
        )
    return len(busy), sum(h.nbytes for h in busy)


def _repoint_handed(h: HeldStorage, fresh: torch.UntypedStorage) -> None:
    """Point each live tensor handed out from ``h``, and each of its parameters'
    ``.grad`` on it, at the same place in ``fresh``."""
    ptr = h.storage.data_ptr()
    tensors = [ref() for ref in h.handed] + [p.grad for p in h.params]
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() == ptr:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                fresh, t.storage_offset(), t.size(), t.stride()
            )


class DeferredCopies:
    """The held storages of one graph pool whose gradients are handed out now, and a
    count of what moving them out cost.

    Every replay asks it first (:meth:`settle`), so the common answer is O(1): in the
    usual order each backward of a step was captured after every storage handed out
    before it, so ``top`` (the highest capture number held) is below its own."""

    __slots__ = ("held", "top", "exchange", "captures", "moves", "moved_bytes")

    def __init__(self) -> None:
        self.held: dict[int, HeldStorage] = {}
        self.top = 0  # the highest ``seq`` in ``held`` (0: none)
        # How moves go in this pool (move_out); decided once, at the pool's first use.
        self.exchange = can_move_storages()
        self.captures = 0  # graphs captured into the pool so far
        self.moves = 0  # storages moved out
        self.moved_bytes = 0

    def next_capture(self) -> int:
        """The number of the graph being captured into the pool now (1, 2, ...)."""
        self.captures += 1
        return self.captures

    def hold(self, held: Sequence[HeldStorage]) -> None:
        """Register ``held`` as handed out (their ``handed`` lists say what)."""
        for h in held:
            self.held[id(h)] = h
            self.top = max(self.top, h.seq)

    def forget(self, held: Sequence[HeldStorage]) -> None:
        """Drop ``held`` (each of them held now)."""
        for h in held:
            del self.held[id(h)]
        self.top = max((h.seq for h in self.held.values()), default=0)

    def settle(self, seq: int) -> None:
        """Before a replay of the graph captured ``seq``-th: move out every held
        storage a graph captured later writes (numbered above ``seq``)."""
        if self.top <= seq:
            return
        later = [h for h in self.held.values() if h.seq > seq]
        self.count(later)
        self.forget(later)

    def settle_own(self, held: Sequence[HeldStorage]) -> None:
        """Before a backward graph replays again: move out what its last replay
        handed out (``held``, its own storages) if that is still held."""
        own = [h for h in held if id(h) in self.held]
        if own:
            self.count(own)
            self.forget(own)

    def stats(self, deferred: bool) -> DeferredCopyStats:
        return DeferredCopyStats(deferred, self.moves, self.moved_bytes)

    def count(self, held: Sequence[HeldStorage]) -> None:
        """:func:`move_out` of ``held`` in this pool's way, counted."""
        moves, nbytes = move_out(held, self.exchange)
        self.moves += moves
        self.moved_bytes += nbytes
