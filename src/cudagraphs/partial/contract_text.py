"""How a call's leaves and structure are written in mismatch reports: key paths such as
``args[0]`` / ``kwargs['mask']``, leaf kinds, a call's skeleton, and shown values.

Separate from :mod:`.contract` because only the reports use it
(:meth:`~.contract.CallContract.mismatches`, and the leaf kinds a contract records for
them), never the per-call matching.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__: list[str] = []


def _path(keys: tuple) -> str:
    """A pytree key path of ``(args, kwargs)`` as ``args[0]`` / ``kwargs['mask']``."""
    return ("args" if keys[0].idx == 0 else "kwargs") + pytree.keystr(keys[1:])


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "Tensor"
    return "None" if value is None else type(value).__qualname__


def _leaf_kinds(call: tuple[tuple, dict]) -> tuple[tuple[str, str], ...]:
    """``(path, kind)`` of every leaf of a flattened call; torch's pytree keeps ``None``
    as a leaf, so a ``None`` that became a tensor has a path to report."""
    flat, _ = pytree.tree_flatten_with_path(call)
    return tuple((_path(keys), _kind(value)) for keys, value in flat)


class _Shown:
    """A placeholder leaf whose repr is a kind, to print a call's skeleton."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _skeleton(kinds: list[str], spec: pytree.TreeSpec) -> str:
    """``(args, kwargs)`` with each leaf replaced by its kind: ``(([Tensor],), {})``."""
    try:
        return repr(pytree.tree_unflatten([_Shown(k) for k in kinds], spec))
    except Exception:  # a custom pytree node that refuses placeholder children
        return str(spec)


def _shown(field_name: str, value: Any) -> Any:
    if field_name == "tensor_type":
        return value.__qualname__
    return str(value) if field_name == "device" else value


def _role(kind: str) -> str:
    """What the structure of a call depends on: tensor, None, or a control value."""
    return kind if kind in ("Tensor", "None") else "value"
