"""Containers beyond list, tuple and dict that a program's trees may hold.

Users pass what their code already builds: namedtuples, ``OrderedDict`` s,
dataclasses registered with torch's pytree (``torch.utils._pytree.register_dataclass``
or ``register_pytree_node``), a Hugging Face ``ModelOutput`` (transformers registers
every subclass). torch's pytree registry says how each splits into children and a
*context* (the keys, field names or class needed to rebuild it), so we describe such a
container by its exact type and context, and take it apart and rebuild it with the
registered functions. The plain list, tuple and dict keep their own, faster handling
in :mod:`.signature` and :mod:`.matcher`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["ContainerSignature", "describe_container"]

Flatten = Callable[[Any], "tuple[list[Any], Any]"]
Unflatten = Callable[[list[Any], Any], Any]


@dataclass(frozen=True)
class ContainerSignature:
    """One registered container: its exact type and flatten context, and the path
    suffix of each child (``.x`` for a field, ``['k']`` for a key)."""

    cls: type
    context: Any = field(hash=False)  # compared with ==; may be a list of keys
    child_paths: tuple[str, ...]
    flatten: Flatten = field(compare=False, repr=False)
    unflatten: Unflatten = field(compare=False, repr=False)
    is_namedtuple: bool = False

    def split(self, value: Any) -> tuple[list[Any], Any]:
        """``(children, context)`` of a value of this exact type."""
        return self.flatten(value)

    def build(self, children: list[Any]) -> Any:
        return self.unflatten(children, self.context)

    @property
    def context_field(self) -> str:
        """What the context is called in a mismatch report."""
        if self.is_namedtuple:
            return "type"
        ctx = self.context
        if isinstance(ctx, (list, tuple)) and all(isinstance(k, str) for k in ctx):
            return "keys"
        return "context"


def _namedtuple_flatten(value: Any) -> tuple[list[Any], Any]:
    return list(value), type(value)


def _namedtuple_unflatten(children: list[Any], cls: Any) -> Any:
    return cls(*children)


def _child_paths(node: Any, value: Any, count: int) -> tuple[str, ...]:
    with_keys = node.flatten_with_keys_fn  # None for a registration without keys
    if with_keys is not None:
        try:
            keyed, _ = with_keys(value)
            return tuple(pytree.keystr((key,)) for key, _ in keyed)
        except Exception:  # a registration without usable keys: positions will do
            pass
    return tuple(f"[{i}]" for i in range(count))


def describe_container(value: Any) -> tuple[ContainerSignature, list[Any]] | None:
    """The signature and children of ``value`` when it is a pytree-registered
    container other than exactly list, tuple or dict; ``None`` otherwise."""
    cls = type(value)
    if cls in (list, tuple, dict):
        return None
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        # torch registers namedtuples as one node kind; the class is the context.
        sig = ContainerSignature(
            cls=cls,
            context=cls,
            child_paths=tuple(f".{name}" for name in cls._fields),
            flatten=_namedtuple_flatten,
            unflatten=_namedtuple_unflatten,
            is_namedtuple=True,
        )
        return sig, list(value)
    node = pytree.SUPPORTED_NODES.get(cls)
    if node is None:
        return None
    children, context = node.flatten_fn(value)
    children = list(children)
    sig = ContainerSignature(
        cls=cls,
        context=context,
        child_paths=_child_paths(node, value, len(children)),
        flatten=node.flatten_fn,
        unflatten=node.unflatten_fn,
    )
    return sig, children
