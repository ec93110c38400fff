"""Device-independent signatures of a program's input tree.

A signature records what a fixed-address buffer needs from every later payload:
the nesting (lists, tuples, dicts), and for each leaf its tensor topology (shape,
stride, dtype, layout, requires_grad) or, for a registered leaf type, its type name,
format version, metadata and named tensors. Devices are not part of it: a payload may
come from the CPU or another GPU, and the copy moves it.

``validate`` walks the whole tree and reports every difference at once, each with
its path, before anything is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..errors import CudaGraphsTypeError, CudaGraphsValueError, Mismatch, SignatureMismatchError
from .containers import ContainerSignature, describe_container
from .leaves import LeafTypes
from .matcher import compile_matcher

__all__ = [
    "Mismatch",
    "SignatureMismatchError",
    "TensorSignature",
    "ValueSignature",
    "ValueTreeSignature",
]

TreeKind = Literal["tensor", "value", "list", "tuple", "dict", "node", "none"]
# Sources a copy into the fixed buffer can read: host memory and CUDA devices.
_COPYABLE_DEVICES = ("cpu", "cuda")
_TENSOR_FIELDS = ("shape", "stride", "dtype", "layout", "requires_grad")


@dataclass(frozen=True)
class TensorSignature:
    """Copy compatibility of one tensor with fixed target storage (device excluded)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    layout: torch.layout
    requires_grad: bool

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, path: str = "value") -> TensorSignature:
        """The signature of a dense tensor.

        Raises:
            CudaGraphsTypeError: a sparse (or other non-strided) tensor, naming ``path``.
        """
        if tensor.layout != torch.strided:
            raise CudaGraphsTypeError(
                f"{path}: a {tensor.layout} tensor; program inputs and outputs are dense "
                "(strided) tensors. Pass .to_dense(), or rebuild the sparse tensor inside "
                "the function from dense parts."
            )
        return cls(
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            dtype=tensor.dtype,
            layout=tensor.layout,
            requires_grad=tensor.requires_grad,
        )

    def mismatches(self, tensor: torch.Tensor, path: str) -> list[Mismatch]:
        """Every difference of ``tensor`` from this signature; also a layout other than
        strided (a sparse tensor: nothing else is compared) and a device a copy cannot
        read from (meta)."""
        if tensor.layout != self.layout:
            return [Mismatch(path, "layout", self.layout, tensor.layout)]
        found = []
        if tensor.device.type not in _COPYABLE_DEVICES:
            found.append(Mismatch(path, "device", "a CPU or CUDA tensor", str(tensor.device)))
        got = TensorSignature.from_tensor(tensor, path)
        if got != self:
            found.extend(
                Mismatch(path, f, getattr(self, f), getattr(got, f))
                for f in _TENSOR_FIELDS
                if getattr(self, f) != getattr(got, f)
            )
        return found

    def empty(self, device: torch.device | str) -> torch.Tensor:
        """A new tensor with this topology on ``device`` (the fixed target)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        return t.requires_grad_(self.requires_grad)

    @property
    def self_overlapping(self) -> bool:
        """Whether elements share memory (an expanded view, stride 0): such a tensor
        cannot be a copy target."""
        return any(st == 0 and n > 1 for n, st in zip(self.shape, self.stride))

    @property
    def nbytes(self) -> int:
        """Bytes of the storage span this topology covers."""
        if any(s == 0 for s in self.shape):
            return 0
        span = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride))
        return span * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ValueSignature:
    """A registered leaf's type, format version, metadata and named tensor topology."""

    type_name: str
    schema_version: int
    metadata: tuple[tuple[str, Any], ...]
    tensors: tuple[tuple[str, TensorSignature], ...]


def _sorted_keys(d: dict) -> list:
    # Key order is not part of a dict's identity: compare and copy in one canonical order.
    return sorted(d, key=lambda k: (type(k).__name__, repr(k)))


@dataclass(frozen=True)
class ValueTreeSignature:
    """Structure of tensors and registered values in a payload (see module docs)."""

    kind: TreeKind
    leaf: TensorSignature | ValueSignature | None = None
    children: tuple[ValueTreeSignature, ...] = ()
    keys: tuple[Any, ...] = ()
    container: ContainerSignature | None = None  # kind "node": a registered container
    _leaf_types: LeafTypes | None = field(default=None, compare=False, repr=False)
    # A dict's keys in the order the described value held them. Not part of the
    # signature (``keys`` is canonical, sorted); rebuilt dicts take it, so a function
    # sees its input dicts, and a caller its output dicts, in their own order
    # (``a, b = d.values()`` must not swap).
    key_order: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_value(
        cls,
        value: Any,
        *,
        leaf_types: LeafTypes | None = None,
        path: str = "value",
        allow_none: bool = True,
    ) -> ValueTreeSignature:
        """Describe ``value``: dense tensors, registered leaves (``leaf_types``) and
        ``None`` nested in lists, tuples, dicts and the containers torch's pytree knows
        (namedtuples, ``OrderedDict``, registered dataclasses, Hugging Face
        ``ModelOutput``; see :mod:`.containers`).

        Args:
            allow_none: accept ``None`` leaves (a later value must hold ``None`` there
                too); ``False`` refuses them.

        Raises:
            CudaGraphsTypeError: a leaf is neither a tensor nor a registered type, a
                tensor is not dense, or a container is of another kind (the message
                names its path).
        """
        if isinstance(value, torch.Tensor):
            return cls("tensor", TensorSignature.from_tensor(value, path), _leaf_types=leaf_types)
        if value is None and allow_none:
            return cls("none", _leaf_types=leaf_types)
        leaf_type = leaf_types.get(value) if leaf_types is not None else None
        if leaf_type is not None:
            tensors, metadata = leaf_type.split(value, path)
            sig = ValueSignature(
                type_name=leaf_type.name,
                schema_version=leaf_type.version,
                metadata=metadata,
                tensors=tuple(
                    (name, TensorSignature.from_tensor(tensors[name], f"{path}.{name}"))
                    for name in sorted(tensors)
                ),
            )
            return cls("value", sig, _leaf_types=leaf_types)
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            kind: TreeKind = "list" if isinstance(value, list) else "tuple"
            children = tuple(
                cls.from_value(v, leaf_types=leaf_types, path=f"{path}[{i}]", allow_none=allow_none)
                for i, v in enumerate(value)
            )
            return cls(kind, children=children, _leaf_types=leaf_types)
        if type(value) is dict:
            keys = _sorted_keys(value)
            children = tuple(
                cls.from_value(
                    value[k], leaf_types=leaf_types, path=f"{path}[{k!r}]", allow_none=allow_none
                )
                for k in keys
            )
            return cls(
                "dict",
                children=children,
                keys=tuple(keys),
                _leaf_types=leaf_types,
                key_order=tuple(value),
            )
        described = describe_container(value)
        if described is not None:
            container, items = described
            children = tuple(
                cls.from_value(v, leaf_types=leaf_types, path=path + suffix, allow_none=allow_none)
                for v, suffix in zip(items, container.child_paths)
            )
            return cls("node", children=children, container=container, _leaf_types=leaf_types)
        registered = leaf_types.names() if leaf_types is not None else []
        raise CudaGraphsTypeError(
            f"{path}: unsupported leaf of type {type(value).__qualname__}. Leaves are tensors, "
            f"None and registered leaf types (registered here: {registered or 'none'}) nested "
            "in lists, tuples, dicts and containers registered with torch's pytree "
            "(namedtuples, OrderedDict, register_dataclass); bind Python scalars and other "
            "objects in the function (closure or functools.partial)."
        )

    # ---- checking ---------------------------------------------------------------------
    def validate(self, value: Any, *, path: str = "value") -> None:
        """Raise :class:`SignatureMismatchError` listing every difference of ``value``."""
        problems: list[Mismatch] = []
        self._collect(value, path, problems, None)
        if problems:
            raise SignatureMismatchError(path, problems)

    def flatten(self, value: Any, *, path: str = "value") -> list[torch.Tensor]:
        """Validate ``value`` and return its tensors in signature order (registered
        leaves contribute their named tensors, sorted by name)."""
        matcher = self._matcher()
        if matcher is not None:
            try:
                tensors = matcher(value)
            except Exception:  # e.g. stride() of a sparse tensor: the full walk explains
                tensors = None
            if tensors is not None:
                return tensors
        problems: list[Mismatch] = []
        out: list[torch.Tensor] = []
        self._collect(value, path, problems, out)
        if problems:
            raise SignatureMismatchError(path, problems)
        return out

    def _matcher(self, checks: bool = True) -> Any:
        # Generated on first use and cached on this (frozen) signature object.
        key = "_fast" if checks else "_extract"
        try:
            return self.__dict__[key]
        except KeyError:
            matcher = compile_matcher(self, checks=checks)
            object.__setattr__(self, key, matcher)
            return matcher

    def extract(self, value: Any, *, path: str = "value") -> list[torch.Tensor]:
        """The tensors of ``value`` in :meth:`flatten` order, trusting that ``value``
        matches this signature (no metadata checks; a wrong structure may raise a
        plain ``KeyError``/``IndexError`` or pick wrong leaves). Falls back to
        :meth:`flatten` for signatures holding registered leaf types."""
        extractor = self._matcher(checks=False)
        if extractor is None:
            return self.flatten(value, path=path)
        return extractor(value)

    def _collect(self, value: Any, path: str, problems: list, out: list | None) -> None:
        kind = self.kind
        if kind == "none":
            if value is not None:
                problems.append(Mismatch(path, "type", "None", type(value).__qualname__))
        elif kind == "tensor":
            if not isinstance(value, torch.Tensor):
                problems.append(Mismatch(path, "type", "Tensor", type(value).__qualname__))
                return
            leaf = self.leaf
            # The common case (a match) compares fields directly: building a signature
            # per tensor would dominate the replay path. The layout goes first: a sparse
            # tensor has no strides to compare. A meta tensor matches every field but
            # holds nothing a copy could read.
            if (
                value.layout != leaf.layout
                or value.device.type not in _COPYABLE_DEVICES
                or value.shape != leaf.shape
                or value.dtype != leaf.dtype
                or value.stride() != leaf.stride
                or value.requires_grad != leaf.requires_grad
            ):
                problems.extend(leaf.mismatches(value, path))
            if out is not None:
                out.append(value)
        elif kind == "value":
            self._collect_value(value, path, problems, out)
        elif kind == "node":
            self._collect_node(value, path, problems, out)
        elif kind in ("list", "tuple"):
            expected_type = list if kind == "list" else tuple
            if type(value) is not expected_type:
                problems.append(Mismatch(path, "type", kind, type(value).__qualname__))
                return
            if len(value) != len(self.children):
                problems.append(Mismatch(path, "length", len(self.children), len(value)))
                return
            for i, (child, v) in enumerate(zip(self.children, value)):
                child._collect(v, f"{path}[{i}]", problems, out)
        else:
            if type(value) is not dict:
                problems.append(Mismatch(path, "type", "dict", type(value).__qualname__))
                return
            if set(value) != set(self.keys):
                problems.append(
                    Mismatch(path, "keys", sorted(map(repr, self.keys)), sorted(map(repr, value)))
                )
                return
            for k, child in zip(self.keys, self.children):
                child._collect(value[k], f"{path}[{k!r}]", problems, out)

    def _collect_node(self, value: Any, path: str, problems: list, out: list | None) -> None:
        c = self.container
        if type(value) is not c.cls:
            problems.append(Mismatch(path, "type", c.cls.__qualname__, type(value).__qualname__))
            return
        items, context = c.split(value)
        if context != c.context:
            problems.append(Mismatch(path, c.context_field, c.context, context))
            return
        if len(items) != len(self.children):
            problems.append(Mismatch(path, "length", len(self.children), len(items)))
            return
        for child, v, suffix in zip(self.children, items, c.child_paths):
            child._collect(v, path + suffix, problems, out)

    def _collect_value(self, value: Any, path: str, problems: list, out: list | None) -> None:
        sig = self.leaf
        leaf_type = self._leaf_types.get(value) if self._leaf_types is not None else None
        if leaf_type is None or leaf_type.name != sig.type_name:
            got = leaf_type.name if leaf_type is not None else type(value).__qualname__
            problems.append(Mismatch(path, "type", sig.type_name, got))
            return
        if leaf_type.version != sig.schema_version:
            problems.append(Mismatch(path, "schema_version", sig.schema_version, leaf_type.version))
        tensors, metadata = leaf_type.split(value, path)
        if metadata != sig.metadata:
            problems.append(Mismatch(path, "metadata", dict(sig.metadata), dict(metadata)))
        names = tuple(n for n, _ in sig.tensors)
        if tuple(sorted(tensors)) != names:
            problems.append(Mismatch(path, "tensor names", list(names), sorted(tensors)))
            return
        for name, tsig in sig.tensors:
            problems.extend(tsig.mismatches(tensors[name], f"{path}.{name}"))
            if out is not None:
                out.append(tensors[name])

    # ---- buffers --------------------------------------------------------------------
    def tensor_signatures(self) -> list[TensorSignature]:
        """Every tensor's signature, in :meth:`flatten` order."""
        if self.kind == "tensor":
            return [self.leaf]
        if self.kind == "value":
            return [t for _, t in self.leaf.tensors]
        if self.kind == "none":
            return []
        return [t for child in self.children for t in child.tensor_signatures()]

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        """A tree of this structure around ``tensors`` (in :meth:`flatten` order)."""
        tensors = list(tensors)
        expected = len(self.tensor_signatures())
        if len(tensors) != expected:
            raise CudaGraphsValueError(f"rebuild needs {expected} tensors, got {len(tensors)}")
        return self._rebuild(iter(tensors))

    def _rebuild(self, it: Any) -> Any:
        if self.kind == "none":
            return None
        if self.kind == "tensor":
            return next(it)
        if self.kind == "value":
            named = {name: next(it) for name, _ in self.leaf.tensors}
            leaf_type = self._leaf_types.by_name(self.leaf.type_name)
            return leaf_type.unflatten(named, dict(self.leaf.metadata))
        if self.kind == "dict":
            built = {k: child._rebuild(it) for k, child in zip(self.keys, self.children)}
            if self.key_order and list(self.key_order) != list(self.keys):
                return {k: built[k] for k in self.key_order}
            return built
        if self.kind == "node":
            return self.container.build([child._rebuild(it) for child in self.children])
        items = [child._rebuild(it) for child in self.children]
        return items if self.kind == "list" else tuple(items)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensor_signatures())
