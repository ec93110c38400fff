"""Taking a call apart: its pytree leaves and spec (:func:`flatten_call`), and a fast
path for the plain calls a decoder layer gets (:func:`quick_flatten`, :class:`SpecCache`).

Separate from :mod:`.contract` because it is the per-call hot path that every contract
check starts from, and it knows nothing of what a contract compares.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["SpecCache", "StructureKey", "flatten_call", "quick_flatten"]


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
    """Leaves and spec of a call; keyword order at the call site does not matter."""
    return pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))


# Values pytree keeps as leaves, whatever their content: a call made of these, and of
# plain tuples of these, has a structure fixed by its shape alone (see SpecCache).
_PLAIN_LEAVES = (bool, int, float, str, type(None))
StructureKey = tuple


def _plain_leaf(value: Any) -> bool:
    # A tensor subclass registered with pytree (a node with children) is not one.
    if type(value) in _PLAIN_LEAVES:
        return True
    return isinstance(value, torch.Tensor) and type(value) not in pytree.SUPPORTED_NODES


def quick_flatten(args: tuple, kwargs: dict) -> tuple[list, StructureKey] | None:
    """:func:`flatten_call`'s leaves without pytree, with a key that determines the
    spec, for a call whose arguments are tensors, plain values and plain tuples of
    them (a decoder layer's: hidden states, ``(cos, sin)``, masks, flags). ``None``
    for any other call (a list, a dict, a namedtuple, a cache object, nesting):
    :func:`flatten_call` handles those.

    Why: pytree walks a call node by node and builds a spec object each time; a layer
    replays tens of times per step, and the spec of such a call only depends on its
    argument count, tuple lengths and keyword names, which this key holds.
    """
    leaves: list = []
    shape: list = []
    names = sorted(kwargs)
    for value in (*args, *(kwargs[name] for name in names)):
        if not _take(value, leaves, shape):
            return None
    return leaves, (len(args), tuple(names), tuple(shape))


def _take(value: Any, leaves: list, shape: list) -> bool:
    # One argument: a leaf (marked -1, never a tuple length) or a plain tuple of
    # leaves (marked by its length); False for anything pytree must walk.
    if _plain_leaf(value):
        leaves.append(value)
        shape.append(-1)
    elif type(value) is tuple and all(map(_plain_leaf, value)):
        leaves.extend(value)
        shape.append(len(value))
    else:
        return False
    return True


class SpecCache:
    """The pytree spec of each call structure seen, keyed by :func:`quick_flatten`'s
    key: a call of a known structure is flattened without pytree. Holds at most
    ``limit`` structures (a target sees a handful: its variants and some misses)."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._specs: dict[StructureKey, pytree.TreeSpec] = {}

    def flatten(self, args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
        """What :func:`flatten_call` returns, the same leaves and an equal spec."""
        quick = quick_flatten(args, kwargs)
        if quick is None:
            return flatten_call(args, kwargs)
        leaves, key = quick
        spec = self._specs.get(key)
        if spec is None:
            full, spec = flatten_call(args, kwargs)
            if len(self._specs) < self.limit:
                self._specs[key] = spec
            return full, spec
        return leaves, spec
