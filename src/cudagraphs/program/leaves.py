"""Leaf types beyond tensors that a program's input tree may hold.

A leaf type is a user class whose instances carry tensors plus frozen metadata: a
quantized tensor (data + scale, with a block size), a dataclass of tensors with a
format tag, an encrypted value with its scheme parameters. Registering one says how
to take an instance apart into named tensors and metadata, and how to put it back
together around other tensors (the fixed-address buffers).

Registrations live in a :class:`LeafTypes` object that the caller owns and passes to
the signatures and programs that need it; there is no process-wide registry.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CudaGraphsKeyError, CudaGraphsTypeError, CudaGraphsValueError

__all__ = ["LeafType", "LeafTypes"]

Flatten = Callable[[Any], tuple[Mapping[str, torch.Tensor], Mapping[str, Hashable]]]
Unflatten = Callable[[Mapping[str, torch.Tensor], Mapping[str, Hashable]], Any]


@dataclass(frozen=True)
class LeafType:
    """How one registered class is split into tensors and metadata, and rebuilt."""

    cls: type
    name: str  # stable name recorded in signatures
    version: int  # bump when the flatten/unflatten format changes
    flatten: Flatten  # value -> ({tensor name: tensor}, {metadata name: hashable})
    unflatten: Unflatten  # ({tensor name: tensor}, metadata) -> value

    def split(self, value: Any, path: str) -> tuple[dict[str, torch.Tensor], tuple]:
        """Run ``flatten`` and check what it returned; metadata comes back sorted."""
        tensors, metadata = self.flatten(value)
        tensors, metadata = dict(tensors), dict(metadata)
        bad = [k for k, t in tensors.items() if not isinstance(t, torch.Tensor)]
        if bad:
            raise CudaGraphsTypeError(
                f"{path}: flatten of leaf type {self.name!r} returned non-tensors for {bad}"
            )
        frozen = _frozen(metadata)
        if frozen is None:
            raise CudaGraphsTypeError(
                f"{path}: metadata of leaf type {self.name!r} must be hashable values under "
                f"string keys, got {metadata!r}"
            )
        return tensors, frozen


def _frozen(metadata: dict) -> tuple | None:
    """``metadata``'s items sorted by key, or ``None`` unless its keys are str and its
    values hashable."""
    if not all(isinstance(k, str) for k in metadata):
        return None
    frozen = tuple(sorted(metadata.items()))  # keys are distinct: values never compared
    try:
        hash(frozen)
    except TypeError:
        return None
    return frozen


class LeafTypes:
    """The leaf types one program (or signature) accepts besides tensors.

    Example::

        leaf_types = LeafTypes()
        leaf_types.register(
            QuantizedTensor,
            flatten=lambda q: ({"data": q.data, "scale": q.scale}, {"block": q.block}),
            unflatten=lambda t, m: QuantizedTensor(t["data"], t["scale"], m["block"]),
        )
    """

    def __init__(self) -> None:
        self._by_type: dict[type, LeafType] = {}

    def register(
        self,
        cls: type,
        *,
        flatten: Flatten,
        unflatten: Unflatten,
        name: str | None = None,
        version: int = 1,
    ) -> LeafType:
        """Register ``cls``; instances of exactly this class become leaves.

        Raises:
            TypeError: ``cls`` is not a class, is a tensor type, or the functions are
                not callable.
            ValueError: ``cls`` is registered already.
        """
        if not isinstance(cls, type):
            raise CudaGraphsTypeError(f"leaf type must be a class, got {cls!r}")
        if issubclass(cls, torch.Tensor):
            raise CudaGraphsTypeError(
                f"{cls.__name__} is a tensor type; tensors are leaves already"
            )
        if not callable(flatten) or not callable(unflatten):
            raise CudaGraphsTypeError(f"flatten and unflatten of {cls.__name__} must be callable")
        if cls in self._by_type:
            raise CudaGraphsValueError(f"leaf type {cls.__qualname__} is registered already")
        leaf = LeafType(
            cls=cls,
            name=name or f"{cls.__module__}.{cls.__qualname__}",
            version=version,
            flatten=flatten,
            unflatten=unflatten,
        )
        self._by_type[cls] = leaf
        return leaf

    def get(self, value: Any) -> LeafType | None:
        """The registration of ``type(value)``, or ``None``."""
        return self._by_type.get(type(value))

    def by_name(self, name: str) -> LeafType:
        """The registration recorded in a signature under ``name``.

        Raises:
            KeyError: no leaf type of that name is registered here.
        """
        for leaf in self._by_type.values():
            if leaf.name == name:
                return leaf
        raise CudaGraphsKeyError(f"no leaf type named {name!r} is registered (have {self.names()})")

    def names(self) -> list[str]:
        return sorted(leaf.name for leaf in self._by_type.values())

    def __contains__(self, cls: object) -> bool:
        return cls in self._by_type

    def __repr__(self) -> str:
        return f"LeafTypes({self.names()})"
