"""What a model says about its own layers, read duck-typed from the class attributes
Hugging Face ``PreTrainedModel`` subclasses declare (transformers is never imported).

``_no_split_modules`` lists the class names of the decoder layers (the units that
``accelerate`` never splits across devices). ``_can_record_outputs`` maps an output
to the modules whose forward produces it: ``"attentions"`` to the self-attention
modules, ``"cross_attentions"`` to the cross-attention ones, ``"router_logits"`` to
the MoE routers. A value is a class, a class name, a list of them, or a recorder
object with a ``target_class`` or a ``class_name`` (and optionally a ``layer_name``
that the module's qualified name must hold). The model's authors write these for the
model's own classes, so every class name used here comes from the model, never from
a list kept in this package.

What this module does NOT do: it does not pick targets (:mod:`.discovery` does), and
it does not check that a declared class is graph-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .tree import children, join_name

__all__ = ["ClassSpec", "ModelMetadata", "first_declared", "read_metadata"]

logger = logging.getLogger(__name__)

_ATTENTION_KEY = "attentions"
_CROSS_ATTENTION_KEY = "cross_attentions"
_ROUTER_KEY = "router_logits"


@dataclass(frozen=True)
class ClassSpec:
    """One declared kind of module: instances of ``target_class``, or modules named by
    ``name_hint`` (a class name, or a suffix of the qualified module name: models
    write both, ``"LlamaAttention"`` and ``"self_attn"``), kept only where the
    qualified name holds ``.layer_name.`` when a layer name is given. GPT-2 needs the
    layer name: its self- and cross-attention are both ``GPT2Attention``, told apart
    as ``.attn`` and ``.crossattention``."""

    target_class: type | None
    layer_name: str | None = None
    name_hint: str | None = None

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether ``module``, at qualified name ``name``, is of this kind."""
        by_class = self.target_class is not None and isinstance(module, self.target_class)
        hint = self.name_hint
        by_name = hint is not None and (
            f".{name}".endswith(f".{hint}") or any(c.__name__ == hint for c in type(module).__mro__)
        )
        if not (by_class or by_name):
            return False
        if self.layer_name is None:
            return True
        # Dots on both sides: ".attn" must not match ".attn_norm" or ".c_attn".
        return f".{self.layer_name}." in f".{name}."

    def label(self) -> str:
        """The spec as a reader would name it (``GPT2Attention at .attn``)."""
        what = self.target_class.__name__ if self.target_class else repr(self.name_hint)
        return f"{what} at .{self.layer_name}" if self.layer_name else what


@dataclass(frozen=True)
class ModelMetadata:
    """The layer, attention and router classes one model declares about itself."""

    owner: str  # class name of the module that declared it (for messages)
    layer_classes: tuple[str, ...]
    attention: tuple[ClassSpec, ...]
    cross_attention: tuple[ClassSpec, ...]
    router: tuple[ClassSpec, ...]

    def is_layer(self, module: nn.Module) -> bool:
        """Whether ``module`` is a declared decoder layer. The whole MRO is compared:
        FSDP2's ``fully_shard`` swaps a module's class for a subclass named
        ``FSDP<name>``, and a user subclass of a layer is still that layer."""
        return any(cls.__name__ in self.layer_classes for cls in type(module).__mro__)

    def is_attention(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` is declared self-attention (cross-attention never is)."""
        if any(spec.matches(name, module) for spec in self.cross_attention):
            return False
        return any(spec.matches(name, module) for spec in self.attention)

    def is_router(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` is a declared MoE router."""
        return any(spec.matches(name, module) for spec in self.router)


def read_metadata(module: nn.Module) -> ModelMetadata | None:
    """``module``'s own declarations, or ``None`` when it declares no decoder layer
    classes (it is not a ``PreTrainedModel``-like module; a pipeline stage that is a
    plain ``ModuleList`` of layers is one). Malformed entries are ignored, not
    raised: the metadata is a hint, and the structural rules remain."""
    names = getattr(module, "_no_split_modules", None)
    if not isinstance(names, (list, tuple, set, frozenset)):
        return None
    if isinstance(names, (set, frozenset)):
        # PreTrainedModel.post_init turns the class's list into a set on the instance;
        # sorted, messages read the same on every run.
        names = sorted(n for n in names if isinstance(n, str))
    layer_classes = tuple(dict.fromkeys(n for n in names if isinstance(n, str) and n))
    if not layer_classes:
        return None
    record = getattr(module, "_can_record_outputs", None)
    if not isinstance(record, Mapping):
        record = {}
    return ModelMetadata(
        owner=type(module).__name__,
        layer_classes=layer_classes,
        attention=_specs(record.get(_ATTENTION_KEY)),
        cross_attention=_specs(record.get(_CROSS_ATTENTION_KEY)),
        router=_specs(record.get(_ROUTER_KEY)),
    )


def _specs(value: Any) -> tuple[ClassSpec, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(spec for spec in map(_spec, items) if spec is not None)


def _spec(item: Any) -> ClassSpec | None:
    if isinstance(item, type):
        return ClassSpec(item)
    if isinstance(item, str):
        return ClassSpec(None, name_hint=item) if item else None
    target = getattr(item, "target_class", None)
    hint = getattr(item, "class_name", None)
    layer = getattr(item, "layer_name", None)
    target = target if isinstance(target, type) else None
    hint = hint if isinstance(hint, str) and hint else None
    if target is None and hint is None:
        return None
    layer = layer.strip(".") if isinstance(layer, str) else ""
    return ClassSpec(target, layer or None, hint)


def first_declared(
    block: nn.Module, prefix: str, is_kind: Callable[[str, nn.Module], bool], what: str
) -> tuple[str, nn.Module, str, nn.Module] | None:
    """The shallowest module beneath ``block`` that ``is_kind(name, module)`` accepts,
    and its parent: ``(name, module, parent name, parent)``, or ``None``. A direct
    child comes first; a match is not searched inside; several matches at the
    shallowest depth are logged (DEBUG) and the first in module order is taken."""
    found: list[tuple[str, nn.Module, str, nn.Module]] = []
    level = [(prefix, block)]
    while level and not found:
        deeper = []
        for parent_name, parent in level:
            for child_name, child in children(parent):
                name = join_name(parent_name, child_name)
                if is_kind(name, child):
                    found.append((name, child, parent_name, parent))
                else:
                    deeper.append((name, child))
        level = deeper
    if len(found) > 1:
        logger.debug(
            "block %s has several %s modules %s; taking the first",
            prefix,
            what,
            [hit[0] for hit in found],
        )
    return found[0] if found else None
