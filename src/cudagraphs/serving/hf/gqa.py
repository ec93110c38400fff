"""Grouped-query attention at decode without copying the cache: each key/value head's
group of query heads read as that head's rows of queries.

At one new token a step, HF's SDPA attention under ``torch.compile`` repeats every
key/value head for its group of query heads (``repeat_kv``) before the kernel: the
whole cache, as many times over as the group is large, copied at every step of every
layer. Its eager path does not (``pack_gqa`` in transformers' ``sdpa_attention``) but
turns itself off while dynamo traces, and SDPA's ``enable_gqa`` is taken only without a
mask, which a static cache with padding always has. With one query position the
group's queries are rows against the same keys, values and mask, so
``query.reshape(batch, kv_heads, group, dim)`` computes the same attention over the
cache as it lies, reading each key/value head once.

:class:`PackedGqa` puts that in front of transformers' ``"sdpa"`` attention function
while a generator's decode step runs, traced by dynamo or eagerly (graph replays run
no Python): every call that is
not a one-token step of grouped heads with SDPA's plain options goes to the function it
replaced, unchanged. transformers' registry is the only way in that leaves a model's
own ``"sdpa"`` (a modeling file's local ``AttentionInterface``) and its checks of
``config._attn_implementation`` as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PackedGqa", "packable", "packed_attention"]

#: Keywords HF decoders pass to their attention function that SDPA's attention ignores
#: or that are checked below; any other keyword sends the call to the function replaced.
_PLAIN_KEYWORDS = frozenset(
    {
        "dropout",
        "scaling",
        "is_causal",
        "position_ids",
        "cache_position",
        "use_cache",
        "sliding_window",
        "output_router_logits",
        "output_attentions",
    }
)


def packable(
    module: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict
) -> bool:
    """Whether ``query`` (batch, heads, 1, dim) can be read as ``key``'s heads' rows:
    one query position, heads a multiple (two or more) of the key/value heads, the mask
    one for every head and position (or none), no dropout, and nothing else asked of
    the kernel. A keyword passed as ``None`` asks nothing (``softcap=None``,
    ``position_bias=None``, ``s_aux=None``: SDPA's attention reads them as absent)."""
    if query.dim() != 4 or key.dim() != 4 or query.shape[2] != 1:
        return False
    heads, kv_heads = query.shape[1], key.shape[1]
    if getattr(module, "num_key_value_groups", 1) <= 1 or kv_heads * 2 > heads:
        return False
    asked = {name for name, value in kwargs.items() if value is not None}
    if heads % kv_heads or not asked <= _PLAIN_KEYWORDS:
        return False
    if kwargs.get("dropout", 0.0) or kwargs.get("output_attentions"):
        return False
    return mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1)


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """SDPA of one query position with each key/value head's group of query heads as
    its rows; returned as HF's attention functions return it (batch, 1, heads, dim)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    rows = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    # The mask (batch, 1, 1, length) broadcasts over the heads and the group's rows.
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    # SDPA broadcasts the batch (a query of one row against a cache of several), so the
    # output's batch is its own, as in transformers' sdpa_attention.
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous()


@dataclass(eq=False)
class PackedGqa:
    """transformers' ``"sdpa"`` attention with one-token steps of grouped heads packed,
    in place while :meth:`installed` is entered.

    It keeps no count of its calls: dynamo would guard on the count and compile again
    at every step.
    """

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _replaced: Callable[..., Any] | None = field(default=None, repr=False)
    _depth: int = field(default=0, repr=False)
    # One function object for every entry: dynamo guards on the one it traced.
    _function: Callable[..., Any] | None = field(default=None, repr=False)

    def _attention(
        self,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        replaced = self._replaced
        assert replaced is not None, "PackedGqa's attention called while not installed"
        if args or not packable(module, query, key, attention_mask, kwargs):
            return replaced(module, query, key, value, attention_mask, *args, **kwargs)
        out = packed_attention(query, key, value, attention_mask, kwargs.get("scaling"))
        return out, None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """transformers' ``"sdpa"`` is this object's attention inside, the function it
        replaced again on leaving (reentrant; nothing happens without transformers).

        Two generators' steps may overlap (threads): each one replaces the function
        beneath any other generator's, and puts it back only while its own is still
        the one registered, so whichever leaves last leaves transformers' own. One that
        leaves while the other is inside takes the packing away from the other's later
        traces: they recompile with the function beneath, correct and unpacked.
        """
        try:
            from transformers.modeling_utils import AttentionInterface
        except ImportError:
            yield
            return
        # Read, compare and write one mapping, the class-wide one that ``register``
        # writes: a fresh instance has no local overrides, so it reads that mapping
        # alone. A local override on transformers' own instance
        # (``ALL_ATTENTION_FUNCTIONS["sdpa"] = fn``) then stays the user's, unpacked,
        # and never becomes what is restored class-wide.
        registry = AttentionInterface()
        entered = False
        try:
            with self._lock:
                if self._depth == 0:
                    if self._function is None:
                        self._function = self._attention
                    current = registry["sdpa"]
                    other = getattr(current, "__self__", None)
                    if isinstance(other, PackedGqa) and other is not self:
                        current = other._replaced  # the function beneath theirs
                    if current is not self._function:
                        self._replaced = current
                # Counted and marked before anything is registered, so an interrupt
                # (KeyboardInterrupt lands between any two bytecodes) after the
                # registration always reaches the restoring ``finally``. One between
                # the count and the mark leaves this object unpacked from then on, and
                # transformers' registry as it was.
                self._depth += 1
                entered = True
                if self._depth == 1:
                    AttentionInterface.register("sdpa", self._function)
            yield
        finally:
            if entered:
                with self._lock:
                    self._depth -= 1
                    ours = registry["sdpa"] is self._function
                    if self._depth == 0 and ours and self._replaced is not None:
                        AttentionInterface.register("sdpa", self._replaced)
