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
from typing import Any

from torch import nn

from .tree import children, join_name
from .vocabulary import ClassSpec, ModelMetadata

__all__ = ["first_declared", "read_metadata"]

logger = logging.getLogger(__name__)

_ATTENTION_KEY = "attentions"
_CROSS_ATTENTION_KEY = "cross_attentions"
_ROUTER_KEY = "router_logits"


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
