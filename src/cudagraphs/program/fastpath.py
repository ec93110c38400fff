"""A generated fast path for matching a payload against a signature.

Replays check every input leaf before copying. Walking the signature tree in Python
costs a few microseconds per leaf, which dominates the replay of a graph with many
small inputs. For a given signature we therefore generate, once, a flat Python
function that pulls out every leaf with direct subscripts and compares each tensor's
metadata with constants: the same checks, without recursion or per-node dispatch.
It answers only "matches exactly" (the list of tensors) or "no" (``None``, or an
exception such as ``stride()`` of a sparse tensor); on "no" the caller runs the full
walk, which checks the layout too and reports every difference with its path. The
layout needs no check here: a tensor whose strides match is strided.

Signatures holding registered leaf types get no fast path (their ``flatten`` hooks
must run anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .signature import ValueTreeSignature

__all__ = ["compile_matcher"]

Matcher = Callable[[Any], "list[torch.Tensor] | None"]


class _Emitter:
    def __init__(self, checks: bool = True) -> None:
        self.checks = checks  # False: extract leaves only, trusting the structure
        self.lines: list[str] = []
        self.consts: list[Any] = []
        self.leaves: list[str] = []
        self.counter = 0

    def const(self, value: Any) -> str:
        self.consts.append(value)
        return f"C[{len(self.consts) - 1}]"

    def var(self) -> str:
        self.counter += 1
        return f"v{self.counter}"

    def check(self, condition: str) -> None:
        if self.checks:
            self.lines.append(f"if {condition}: return None")

    def emit(self, sig: ValueTreeSignature, expr: str) -> bool:
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
            self.check(
                f"not isinstance({name}, Tensor) or {name}.shape != {self.const(leaf.shape)} "
                f"or {name}.dtype is not {self.const(leaf.dtype)} "
                f"or {name}.requires_grad is not {leaf.requires_grad} "
                f"or {name}.stride() != {self.const(leaf.stride)}"
            )
            self.leaves.append(name)
            return True
        container = {"list": "list", "tuple": "tuple", "dict": "dict"}[kind]
        self.check(f"type({name}) is not {container} or len({name}) != {len(sig.children)}")
        if kind == "dict":
            for key, child in zip(sig.keys, sig.children):
                k = self.const(key)
                self.check(f"{k} not in {name}")
                if not self.emit(child, f"{name}[{k}]"):
                    return False
            return True
        return all(self.emit(child, f"{name}[{i}]") for i, child in enumerate(sig.children))


def compile_matcher(signature: ValueTreeSignature, *, checks: bool = True) -> Matcher | None:
    """A function ``value -> list of tensors | None`` for ``signature`` (see module
    docs), or ``None`` when the signature has no fast path. With ``checks=False`` it
    only extracts the leaves, trusting the structure (``replay(validate=False)``)."""
    em = _Emitter(checks)
    if not em.emit(signature, "value"):
        return None
    body = "\n    ".join([*em.lines, f"return [{', '.join(em.leaves)}]"])
    source = f"def match(value):\n    {body}\n"
    namespace: dict[str, Any] = {"C": em.consts, "Tensor": torch.Tensor}
    exec(compile(source, "<cudagraphs signature matcher>", "exec"), namespace)  # noqa: S102
    return namespace["match"]
