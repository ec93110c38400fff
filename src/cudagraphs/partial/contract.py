"""The replay contract of one graphed call, and the fallback counters.

A partial graph stands for one recorded call of its target. A later call may replay
it only if nothing the graph baked in differs: the argument structure, each tensor's
type, shape, stride, dtype, device and requires_grad, which arguments are the same
tensor object (the alias pattern), every non-tensor control value, the grad mode and
the module's training flag. Anything else runs eagerly, and the reason is counted.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "REASONS",
    "CallContract",
    "ContractSet",
    "FallbackCounter",
    "flatten_call",
    "same_control",
]

#: Why a call did not replay, most structural first (the first difference is reported).
REASONS = (
    "structure",
    "tensor_type",
    "device",
    "dtype",
    "shape",
    "stride",
    "requires_grad",
    "alias",
    "control",
    "grad_mode",
    "training",
)

TensorMeta = tuple[type, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, bool]


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
    """Leaves and spec of a call; keyword order at the call site does not matter."""
    return pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))


def _meta(t: torch.Tensor) -> TensorMeta:
    return (type(t), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)


def same_control(a: Any, b: Any) -> bool:
    """Whether two non-tensor leaves are the same control value.

    Types must match exactly (``1``, ``1.0`` and ``True`` differ: they can select
    different kernels). Equality is asked only of plain values; an object whose ``==``
    does not return a bool (arrays, tensor-likes) is compared by identity. NaN equals
    NaN.
    """
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        result = a == b
    except Exception:
        return False
    return result if isinstance(result, bool) else False


def _alias_pattern(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Each tensor's index of first appearance: (0, 1, 0) means args 0 and 2 are the
    same object. Independent of the objects' identities, so calls compare."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


@dataclass(frozen=True)
class CallContract:
    """Everything a recorded call fixes (see module docs)."""

    in_spec: pytree.TreeSpec
    controls: tuple[tuple[int, Any], ...]  # (leaf position, value) of non-tensor leaves
    tensor_positions: tuple[int, ...]
    tensor_meta: tuple[TensorMeta, ...]
    alias: tuple[int, ...]
    grad_enabled: bool
    training: bool

    @classmethod
    def from_call(cls, args: tuple, kwargs: dict, *, training: bool) -> CallContract:
        leaves, spec = flatten_call(args, kwargs)
        positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
        tensors = [leaves[i] for i in positions]
        return cls(
            in_spec=spec,
            controls=tuple((i, x) for i, x in enumerate(leaves) if i not in set(positions)),
            tensor_positions=positions,
            tensor_meta=tuple(_meta(t) for t in tensors),
            alias=_alias_pattern(tensors),
            grad_enabled=torch.is_grad_enabled(),
            training=training,
        )

    def unique_tensor_indices(self) -> tuple[int, ...]:
        """Indices (into the call's tensors) of the first appearance of each object:
        the graph's inputs; repeated objects are passed once."""
        return tuple(i for i, first in enumerate(self.alias) if first == i)

    def match(
        self, args: tuple, kwargs: dict, *, training: bool
    ) -> tuple[str | None, list[torch.Tensor]]:
        """``(None, tensors)`` when the call may replay this contract, else
        ``(reason, [])`` with the first reason in :data:`REASONS` order that applies."""
        return self.match_flat(*flatten_call(args, kwargs), training=training)

    def match_flat(
        self, leaves: list, spec: pytree.TreeSpec, *, training: bool
    ) -> tuple[str | None, list[torch.Tensor]]:
        """:meth:`match` on a call already flattened by :func:`flatten_call`."""
        reasons = self._differences(leaves, spec, training)
        if reasons:
            return min(reasons, key=REASONS.index), []
        return None, [leaves[pos] for pos in self.tensor_positions]

    def differences(self, args: tuple, kwargs: dict, *, training: bool) -> set[str]:
        """Every reason (from :data:`REASONS`) why the call differs; empty if none."""
        return self._differences(*flatten_call(args, kwargs), training)

    def _differences(self, leaves: list, spec: pytree.TreeSpec, training: bool) -> set[str]:
        found: set[str] = set()
        if torch.is_grad_enabled() != self.grad_enabled:
            found.add("grad_mode")
        if training != self.training:
            found.add("training")
        if spec != self.in_spec:
            found.add("structure")
            return found
        tensors = [leaves[pos] for pos in self.tensor_positions]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            found.add("structure")
            return found
        for pos, value in self.controls:
            if isinstance(leaves[pos], torch.Tensor):
                found.add("structure")
            elif not same_control(leaves[pos], value):
                found.add("control")
        for t, want in zip(tensors, self.tensor_meta):
            found.update(f for f, a, b in zip(_META_FIELDS, _meta(t), want) if a != b)
        if _alias_pattern(tensors) != self.alias:
            found.add("alias")
        return found

    def same_as(self, other: CallContract) -> bool:
        """Whether two contracts accept the same calls (controls compared with
        :func:`same_control`, as :meth:`match` does)."""
        return (
            self.in_spec == other.in_spec
            and self.tensor_positions == other.tensor_positions
            and self.tensor_meta == other.tensor_meta
            and self.alias == other.alias
            and self.grad_enabled == other.grad_enabled
            and self.training == other.training
            and len(self.controls) == len(other.controls)
            and all(
                p == q and same_control(a, b)
                for (p, a), (q, b) in zip(self.controls, other.controls)
            )
        )


_META_FIELDS = ("tensor_type", "shape", "stride", "dtype", "device", "requires_grad")


class ContractSet:
    """The recorded variants of one target (for example two sequence lengths), at most
    ``max_variants``; a call replays the first variant it matches."""

    def __init__(self, max_variants: int = 4) -> None:
        if not isinstance(max_variants, int) or max_variants < 1:
            raise ValueError(f"max_variants must be an int >= 1, got {max_variants!r}")
        self.max_variants = max_variants
        self.variants: list[CallContract] = []

    def add(self, contract: CallContract) -> int | None:
        """Record a variant; its index, the index of an identical one, or ``None``
        when the set is full."""
        for i, v in enumerate(self.variants):
            if v.same_as(contract):
                return i
        if len(self.variants) >= self.max_variants:
            return None
        self.variants.append(contract)
        return len(self.variants) - 1

    def match(self, args: tuple, kwargs: dict, *, training: bool) -> tuple[int | None, str, list]:
        """``(variant index, "", tensors)`` or ``(None, reason, [])`` where the reason
        is the one of the first variant (the most common case: one variant)."""
        first_reason = "structure" if not self.variants else ""
        leaves, spec = flatten_call(args, kwargs)  # once for all variants
        for i, v in enumerate(self.variants):
            reason, tensors = v.match_flat(leaves, spec, training=training)
            if reason is None:
                return i, "", tensors
            first_reason = first_reason or reason
        return None, first_reason, []


class FallbackCounter:
    """Replays and eager fallbacks, in total and per reason."""

    def __init__(self) -> None:
        self.replayed = 0
        self.fallbacks: Counter[str] = Counter()

    def replay(self) -> None:
        self.replayed += 1

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1

    def as_dict(self) -> dict[str, int]:
        out = {"replayed": self.replayed, "fallbacks": sum(self.fallbacks.values())}
        out.update({f"fallback_{r}": n for r, n in sorted(self.fallbacks.items())})
        return out
