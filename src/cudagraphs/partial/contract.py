"""The replay contract of one graphed call: how a call is taken apart, what a recorded
call fixes, how a later call is compared with it, how a difference is written, and the
fallback counters.

A partial graph stands for one recorded call of its target. A later call may replay
it only if nothing the graph baked in differs: the argument structure, each tensor's
type, shape, stride, dtype, device and requires_grad, which arguments are the same
tensor object (the alias pattern), every non-tensor control value, the grad mode, the
autocast state and the module's training flag. Anything else runs eagerly, and the
reason is counted.

Taking a call apart (:func:`flatten_call`) is the per-call hot path every check starts
from; :class:`SpecCache` skips pytree for the plain calls a decoder layer gets
(:func:`quick_flatten`).

Two ways to ask why a call differs, one for each purpose:

* :meth:`CallContract.match` / :meth:`CallContract.differences`: the reasons (names
  from :data:`REASONS`), cheap enough to run on every call;
* :meth:`CallContract.mismatches`: the same differences as
  :class:`~cudagraphs.errors.Mismatch` records (path such as ``args[0]`` or
  ``kwargs['attention_mask']``, field, expected, received), for reports. It builds
  key paths, so it is for the first fallback of a cause and for debugging, not for
  every call.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..checks import check_int
from ..errors import Mismatch
from .vocabulary import CONTRACT_REASONS, FALLBACK

__all__ = [
    "REASONS",
    "AutocastState",
    "CallContract",
    "ContractSet",
    "FallbackCounter",
    "SpecCache",
    "StructureKey",
    "autocast_state",
    "autocast_text",
    "flatten_call",
    "quick_flatten",
    "same_control",
]


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


#: Device types whose autocast state a call is recorded under.
_AUTOCAST_DEVICES = ("cuda", "cpu")
AutocastState = tuple[tuple[str, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """The autocast regions in effect now: ``(device type, dtype)`` for each enabled
    one, empty when none. A graph bakes in the kernels autocast picked at capture (a
    bf16 matmul, say), so a call under another state must not replay it: Trainer and
    accelerate train in mixed precision by wrapping the model's forward in autocast,
    while ``capture()`` runs outside that forward and must enter the same state."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


def autocast_text(state: AutocastState) -> str:
    if not state:
        return "off"
    return ", ".join(f"{device}: {str(dtype).removeprefix('torch.')}" for device, dtype in state)


#: Why a call does not match a contract, most structural first (the first difference
#: is reported); the names and their meaning are :data:`~.vocabulary.FALLBACK`'s.
REASONS = CONTRACT_REASONS

TensorMeta = tuple[type, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, bool]
_META_FIELDS = ("tensor_type", "shape", "stride", "dtype", "device", "requires_grad")


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
    """Everything a recorded call fixes (see module docs). Built by :meth:`from_call`.

    ``leaf_kinds`` (``(path, kind)`` per leaf, ``None`` leaves included) serves only
    :meth:`mismatches`' structure report; it takes no part in matching or equality.
    """

    in_spec: pytree.TreeSpec
    controls: tuple[tuple[int, Any], ...]  # (leaf position, value) of non-tensor leaves
    tensor_positions: tuple[int, ...]
    tensor_meta: tuple[TensorMeta, ...]
    alias: tuple[int, ...]
    grad_enabled: bool
    training: bool
    autocast: AutocastState = ()
    leaf_kinds: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

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
            autocast=autocast_state(),
            leaf_kinds=_leaf_kinds((tuple(args), dict(sorted(kwargs.items())))),
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

    def mismatches(self, args: tuple, kwargs: dict, *, training: bool) -> list[Mismatch]:
        """Every difference of a call from this contract, one
        :class:`~cudagraphs.errors.Mismatch` each, for reports
        (:func:`~cudagraphs.errors.describe_mismatches` renders them).

        The records say what :meth:`differences` says, in detail: the set of their
        ``field`` s equals ``differences(...)``, and the list is empty exactly when
        :meth:`match` accepts the call. ``path`` is ``args[i]...`` or
        ``kwargs['name']...`` (a pytree key path of the call), ``(args, kwargs)`` for
        a change of container types, ``torch.is_grad_enabled()`` for ``grad_mode``,
        ``torch.autocast`` for ``autocast`` (states shown as ``"cuda: bfloat16"`` or
        ``"off"``) and ``module.training`` for ``training``. Tensor types are shown by class name and
        devices as strings; other expected / received values are the values.

        As with :meth:`differences`, a structure difference ends the comparison of
        leaves (positions no longer correspond). Slower than :meth:`match` (it builds
        key paths): call it to explain a fallback, not on every call.
        """
        call = (tuple(args), dict(sorted(kwargs.items())))
        flat, spec = pytree.tree_flatten_with_path(call)
        if spec != self.in_spec:
            found = self._structure_mismatches(call, [v for _, v in flat], spec)
        else:
            found = self._leaf_mismatches([_path(k) for k, _ in flat], [v for _, v in flat])
        grad = torch.is_grad_enabled()
        if grad != self.grad_enabled:
            found.append(Mismatch("torch.is_grad_enabled()", "grad_mode", self.grad_enabled, grad))
        autocast = autocast_state()
        if autocast != self.autocast:
            found.append(
                Mismatch(
                    "torch.autocast",
                    "autocast",
                    autocast_text(self.autocast),
                    autocast_text(autocast),
                )
            )
        if training != self.training:
            found.append(Mismatch("module.training", "training", self.training, training))
        return found

    def _structure_mismatches(
        self, call: tuple[tuple, dict], leaves: list, spec: pytree.TreeSpec
    ) -> list[Mismatch]:
        want, got = dict(self.leaf_kinds), dict(_leaf_kinds(call))
        found = []
        for path, kind in want.items():
            if path not in got:
                found.append(Mismatch(path, "structure", kind, "absent"))
            elif _role(kind) != _role(got[path]):
                found.append(Mismatch(path, "structure", kind, got[path]))
        found += [Mismatch(p, "structure", "absent", k) for p, k in got.items() if p not in want]
        if not found:  # same paths, other containers (a list for a tuple, say)
            recorded = ["Tensor"] * self.in_spec.num_leaves
            for pos, value in self.controls:
                recorded[pos] = _kind(value)
            received = [_kind(v) for v in leaves]
            found.append(
                Mismatch(
                    "(args, kwargs)",
                    "structure",
                    _skeleton(recorded, self.in_spec),
                    _skeleton(received, spec),
                )
            )
        return found

    def _leaf_mismatches(self, paths: list[str], leaves: list) -> list[Mismatch]:
        # The same checks, in the same order, as _differences.
        not_tensors = [p for p in self.tensor_positions if not isinstance(leaves[p], torch.Tensor)]
        if not_tensors:
            return [
                Mismatch(paths[p], "structure", "Tensor", _kind(leaves[p])) for p in not_tensors
            ]
        by_leaf: list[tuple[int, Mismatch]] = []  # sorted by position below: call order
        for pos, value in self.controls:
            if isinstance(leaves[pos], torch.Tensor):
                by_leaf.append((pos, Mismatch(paths[pos], "structure", _kind(value), "Tensor")))
            elif not same_control(leaves[pos], value):
                by_leaf.append((pos, Mismatch(paths[pos], "control", value, leaves[pos])))
        tensors = [leaves[pos] for pos in self.tensor_positions]
        for pos, t, want in zip(self.tensor_positions, tensors, self.tensor_meta):
            by_leaf += [
                (pos, Mismatch(paths[pos], name, _shown(name, b), _shown(name, a)))
                for name, a, b in zip(_META_FIELDS, _meta(t), want)
                if a != b
            ]
        found = [m for _, m in sorted(by_leaf, key=lambda item: item[0])]
        tensor_paths = [paths[pos] for pos in self.tensor_positions]

        def alias_text(first: int, i: int) -> str:
            return "its own tensor" if first == i else f"the same tensor as {tensor_paths[first]}"

        for i, (want, got) in enumerate(zip(self.alias, _alias_pattern(tensors))):
            if want != got:
                found.append(
                    Mismatch(tensor_paths[i], "alias", alias_text(want, i), alias_text(got, i))
                )
        return found

    def _differences(self, leaves: list, spec: pytree.TreeSpec, training: bool) -> set[str]:
        found: set[str] = set()
        if torch.is_grad_enabled() != self.grad_enabled:
            found.add("grad_mode")
        if autocast_state() != self.autocast:
            found.add("autocast")
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
        metas = tuple(map(_meta, tensors))
        if metas != self.tensor_meta:  # one comparison on the common path
            for got, want in zip(metas, self.tensor_meta):
                found.update(f for f, a, b in zip(_META_FIELDS, got, want) if a != b)
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
            and self.autocast == other.autocast
            and self.training == other.training
            and len(self.controls) == len(other.controls)
            and all(
                p == q and same_control(a, b)
                for (p, a), (q, b) in zip(self.controls, other.controls)
            )
        )


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


class ContractSet:
    """The recorded variants of one target (for example two sequence lengths), at most
    ``max_variants``; a call replays the first variant it matches."""

    def __init__(self, max_variants: int = 4) -> None:
        """
        Raises:
            CudaGraphsTypeError: ``max_variants`` is not an int (``True`` included).
            CudaGraphsValueError: ``max_variants`` < 1.
        """
        self.max_variants = check_int("max_variants", max_variants, minimum=1)
        self.variants: list[CallContract] = []
        self._specs = SpecCache()

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
        leaves, spec = self._specs.flatten(args, kwargs)  # once for all variants
        for i, v in enumerate(self.variants):
            reason, tensors = v.match_flat(leaves, spec, training=training)
            if reason is None:
                return i, "", tensors
            first_reason = first_reason or reason
        return None, first_reason, []

    def mismatches(self, args: tuple, kwargs: dict, *, training: bool) -> list[Mismatch]:
        """:meth:`CallContract.mismatches` against the first variant, the one whose
        reason :meth:`match` reports; one ``structure`` record when nothing was
        recorded. Empty when the first variant accepts the call."""
        if not self.variants:
            return [Mismatch("(args, kwargs)", "structure", "a recorded call", "none recorded")]
        return self.variants[0].mismatches(args, kwargs, training=training)


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
        out.update({FALLBACK.key(r): n for r, n in sorted(self.fallbacks.items())})
        return out
