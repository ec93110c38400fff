"""A generated matcher of a payload against a signature (the program's fast check;
not the training fast path of ``graph_stack``).

Replays check every input leaf before copying. Walking the signature tree in Python
costs a few microseconds per leaf, which dominates the replay of a graph with many
small inputs. For a given signature we therefore generate, once, a flat Python
function that pulls out every leaf with direct subscripts and compares each tensor's
metadata with constants: the same checks, without recursion or per-node dispatch.
It answers only "matches exactly" (the list of tensors) or "no" (``None``, or an
exception such as ``stride()`` of a sparse tensor, or a missing dict key); on "no"
the caller runs the full walk, which checks the layout too and reports every
difference with its path. The layout needs no check here: a tensor whose strides
match is strided.

Signatures holding registered leaf types get no fast path (their ``flatten`` hooks
must run anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..torch_private import tensor_guards_class

__all__ = ["InputValidator", "SignatureTree", "compile_matcher"]

Matcher = Callable[[Any], "list[torch.Tensor] | None"]


class SignatureTree(Protocol):
    """What a matcher reads of a signature node: the fields of
    :class:`~cudagraphs.program.signature.SignatureTree`, which satisfies it."""

    kind: str
    leaf: Any
    keys: tuple
    children: tuple
    container: Any

    def flatten(self, value: Any, *, path: str = ...) -> list: ...


class _Emitter:
    def __init__(self, checks: bool = True, tensor_checks: bool = True) -> None:
        self.checks = checks  # False: extract leaves only, trusting the structure
        self.tensor_checks = checks and tensor_checks  # False: structure only
        self.lines: list[str] = []
        self.consts: list[Any] = []
        self.leaves: list[str] = []
        self.counter = 0

    def const(self, value: Any) -> str:
        # A global of the generated function (a cached load), not an item of a list.
        self.consts.append(value)
        return f"c{len(self.consts) - 1}"

    def var(self) -> str:
        self.counter += 1
        return f"v{self.counter}"

    def check(self, condition: str) -> None:
        if self.checks:
            self.lines.append(f"if {condition}: return None")

    def emit(self, sig: SignatureTree, expr: str) -> bool:
        """Emit checks for ``expr`` against ``sig``; False if no fast path exists."""
        kind = sig.kind
        if kind == "value":
            return False
        if kind == "none":
            self.check(f"{expr} is not None")
            return True
        name = self.var()
        self.lines.append(f"{name} = {expr}")
        if kind == "tensor":
            leaf = sig.leaf
            if not self.tensor_checks:
                self.leaves.append(name)
                return True
            # is_cuda/is_cpu: a meta tensor matches every other field but holds nothing
            # to copy. stride() of a sparse tensor raises: callers treat that as "no".
            self.check(
                f"not isinstance({name}, Tensor) or {name}.shape != {self.const(leaf.shape)} "
                f"or {name}.dtype is not {self.const(leaf.dtype)} "
                f"or {name}.requires_grad is not {leaf.requires_grad} "
                f"or {name}.stride() != {self.const(leaf.stride)} "
                f"or not ({name}.is_cuda or {name}.is_cpu)"
            )
            self.leaves.append(name)
            return True
        if kind == "node":
            return self._emit_node(sig, name)
        container = {"list": "list", "tuple": "tuple", "dict": "dict"}[kind]
        self.check(f"type({name}) is not {container} or len({name}) != {len(sig.children)}")
        if (
            kind != "dict"
            and not self.tensor_checks
            and all(child.kind == "tensor" for child in sig.children)
        ):
            # Leaves checked elsewhere (or not at all): unpack the whole sequence in C.
            self.leaves.append(f"*{name}")
            return True
        if kind == "dict":
            # No membership test: with the length checked, a missing key raises
            # KeyError, which callers treat as "no" (see module docs).
            for key, child in zip(sig.keys, sig.children):
                if not self.emit(child, f"{name}[{self.const(key)}]"):
                    return False
            return True
        return all(self.emit(child, f"{name}[{i}]") for i, child in enumerate(sig.children))

    def _emit_node(self, sig: SignatureTree, name: str) -> bool:
        # A registered container (namedtuple, OrderedDict, dataclass, ModelOutput):
        # exact type, then its own flatten function and context, as the full walk does.
        c = sig.container
        n = len(sig.children)
        self.check(f"type({name}) is not {self.const(c.cls)}")
        if c.is_namedtuple:
            items = name
            self.check(f"len({name}) != {n}")
        else:
            items, context = self.var(), self.var()
            self.lines.append(f"{items}, {context} = {self.const(c.flatten)}({name})")
            self.check(f"len({items}) != {n} or {context} != {self.const(c.context)}")
        return all(self.emit(child, f"{items}[{i}]") for i, child in enumerate(sig.children))


def compile_matcher(
    signature: SignatureTree, *, checks: bool = True, tensor_checks: bool = True
) -> Matcher | None:
    """A function ``value -> list of tensors | None`` for ``signature`` (see module
    docs), or ``None`` when the signature has no fast path. With ``checks=False`` it
    only extracts the leaves, trusting the structure (``replay(validate=False)``);
    with ``tensor_checks=False`` it checks the structure but not the leaves (they may
    not even be tensors: :class:`InputValidator` checks them)."""
    em = _Emitter(checks, tensor_checks)
    if not em.emit(signature, "value"):
        return None
    body = "\n    ".join([*em.lines, f"return [{', '.join(em.leaves)}]"])
    source = f"def match(value):\n    {body}\n"
    namespace: dict[str, Any] = {f"c{i}": c for i, c in enumerate(em.consts)}
    namespace["Tensor"] = torch.Tensor
    exec(compile(source, "<cudagraphs signature matcher>", "exec"), namespace)  # noqa: S102
    return namespace["match"]


# After this many rebuilds (callers alternating between sources of different metadata,
# say CPU and CUDA tensors) the guard stops learning and the generated checks serve.
_MAX_GUARD_REBUILDS = 8


def _tensor_guard(tensors: list[torch.Tensor]) -> Any:
    """torch's C++ checker of tensor metadata (dispatch keys, dtype, device,
    requires_grad, sizes, strides), as dynamo uses it; ``None`` where unavailable."""
    TensorGuards = tensor_guards_class()  # noqa: N806 - torch's class
    if TensorGuards is None:
        return None
    try:
        return TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
    except Exception:  # a private API: any change in it only costs speed
        return None


class InputValidator:
    """``signature.flatten`` for the replay path, faster for trees of many tensors.

    Checking each leaf's metadata in Python costs several attribute reads per tensor. Instead the
    tree's structure is checked by a generated function and the tensors' metadata by
    torch's C++ tensor guard (about 0.1 us per tensor), built from the last tensors
    that passed the full check: tensors the guard accepts have the same dispatch keys,
    dtype, device, requires_grad, sizes and strides as those, so they pass it too.
    On a guard miss the full check runs (and reports every mismatch with its path);
    if it passes, the guard learns the new tensors.
    """

    def __init__(self, signature: SignatureTree) -> None:
        self._signature = signature
        self._structure = compile_matcher(signature, tensor_checks=False)
        self._guard: Any = None
        self._rebuilds = 0

    def __call__(self, value: Any, path: str) -> list[torch.Tensor]:
        guard = self._guard
        if guard is not None:
            try:
                tensors = self._structure(value)
            except Exception:  # an exotic container: the full check explains
                tensors = None
            if tensors is not None and guard.check(*tensors):
                return tensors
        tensors = self._signature.flatten(value, path=path)
        if self._structure is not None and self._rebuilds < _MAX_GUARD_REBUILDS:
            self._rebuilds += 1
            self._guard = _tensor_guard(tensors)
        return tensors
