"""A compiled decode step that compiles one decoder layer for every layer.

``torch.compile`` of a whole HF model lowers every decoder layer on its own: inductor's
scheduling grows faster than the graph (on the CPU, 16 Llama layers took 47 s against
23 s for 4). Torch's hierarchical compilation
(:func:`torch.compiler.nested_compile_region`) traces a marked function once and stamps
its compiled code out wherever the same trace recurs. Here each decoder layer's
``forward`` is that marked function while a decode step runs, so the step is still one
graph of the whole model (embedding, rotary tables, mask, final norm and head compiled
with it) whose layers share one compiled body: their weights and cache tensors are the
body's inputs, and HF's ``cache.layers[layer_idx]`` is resolved while tracing, so the
index leaves no trace that differs between layers. Layers whose traces differ (a dense
layer beside MoE ones, a sliding window beside full attention) compile once per kind.

For that the generator's compiled step views the cache storage's leading rows itself
(:meth:`~.cache.SharedStaticCache.bind_rows`), so every layer's cache tensors carry the
batch's own size symbol, and the storage keeps a spare row, so that no view is all of
it (a whole-storage view lets the compiled write-back specialize the batch).

The price is fusion across a layer's edge: the residual add that ends one layer no
longer fuses with the norm that starts the next.

The decoder layers are the model's own declaration: the modules whose class
``_no_split_modules`` names (the units ``accelerate`` never splits), outermost only.
Their ``forward`` is replaced on the instance during a decode step through the
generator's runner and put back after it, so the prefill, a request above every bucket
and any use of the model outside the generator run its layers as they were; outside
``torch.compile`` the mark does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ...errors import CudaGraphsTypeError, CudaGraphsValueError
from ...stacking.weights import forwards_set

__all__ = [
    "LayerRegions",
    "biased_projections",
    "check_compile_regions",
    "decoder_layers",
    "forwards_set",
]

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The model's decoder layers in module order: the modules whose class name the
    model's ``_no_split_modules`` lists, the outermost only (a listed class inside a
    listed layer is part of that layer). Empty when the model declares none."""
    names = getattr(model, "_no_split_modules", None)
    if not isinstance(names, (list, tuple, set, frozenset)):
        return ()
    names = {n for n in names if isinstance(n, str)}
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return tuple(found)


def _layer_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's forward (HF's checkpointing wrapper included): the instance attribute
    # that routes here is not read again.
    return type(layer).forward(layer, *args, **kwargs)


@dataclass
class LayerRegions:
    """Decoder layers whose ``forward`` is one nested compile region during
    :meth:`marked`.

    Attributes:
        layers: the layers, in module order.
        forwards: per layer, the callable set as its ``forward`` (made once: a compiled
            step's guards see the same objects at every call).
    """

    layers: tuple[nn.Module, ...]
    forwards: tuple[Callable[..., Any], ...]

    @classmethod
    def of(cls, layers: tuple[nn.Module, ...]) -> LayerRegions:
        region = torch.compiler.nested_compile_region(_layer_forward)
        return cls(layers, tuple(partial(region, layer) for layer in layers))

    def marked(self) -> AbstractContextManager[None]:
        """Every layer's ``forward`` the shared region inside the block
        (:func:`forwards_set`)."""
        return forwards_set(self.layers, self.forwards)


def biased_projections(layer: nn.Module) -> list[str]:
    """The modules of ``layer`` (names within it) that hold a 2-D weight and a bias: the
    projections whose ``linear`` torch specializes the batch of inside a nested compile
    region."""
    found = []
    for name, module in layer.named_modules():
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and isinstance(bias, torch.Tensor)
        ):
            found.append(name)
    return found


def check_compile_regions(value: Any, model: nn.Module, compiled: bool) -> LayerRegions | None:
    """The regions a generator's compiled decode steps use: for ``None`` (the default)
    the model's decoder layers when ``compiled``, it declares two or more, and none of
    them holds a biased projection, else none; ``True`` requires them; ``False``
    compiles the whole model as one.

    A biased projection is refused because inside a nested compile region its
    ``linear`` (the 3-D input's bias fold) asks the batch size as a plain int while the
    region is functionalized, which specializes the batch to the first bucket's and
    fails the capture (torch 2.11 and 2.13; HF Llama with ``attention_bias`` or
    ``mlp_bias``, Qwen2's biased q/k/v projections).

    Raises:
        CudaGraphsTypeError: ``value`` not a bool or ``None``.
        CudaGraphsValueError: ``True`` without ``compile_options``, for a model that
            declares no decoder layers, or for one whose layers hold biased projections.
    """
    if value is not None and not isinstance(value, bool):
        raise CudaGraphsTypeError(
            f"compile_regions must be True, False or None, got {type(value).__name__}: "
            "pass None (the default: one compiled body for every decoder layer when "
            "compiling) or False (the whole model compiled as one)"
        )
    if value is False or (value is None and not compiled):
        return None
    if not compiled:
        raise CudaGraphsValueError(
            "compile_regions=True without compile_options: there is nothing to compile. "
            "Fix: pass compile_options (e.g. {'fullgraph': True}) or leave compile_regions "
            "at None"
        )
    layers = decoder_layers(model)
    if len(layers) < 2 and value is None:
        return None
    if not layers:
        raise CudaGraphsValueError(
            f"compile_regions=True, but {type(model).__name__} declares no decoder layers "
            "(its _no_split_modules names no class among its modules). Fix: leave "
            "compile_regions at None or pass False to compile the whole model as one"
        )
    biased = biased_projections(layers[0])
    if biased and value is None:
        logger.info(
            "GraphedGenerator: %s's decoder layers hold biased projections (%s); their "
            "batch would be specialized inside a nested compile region, so the whole "
            "model compiles as one",
            type(model).__name__,
            ", ".join(biased),
        )
        return None
    if biased:
        raise CudaGraphsValueError(
            f"compile_regions=True, but {type(model).__name__}'s decoder layers hold "
            f"biased projections ({', '.join(biased)}): inside a nested compile region "
            "torch specializes their batch to the first bucket's and the capture fails. "
            "Fix: leave compile_regions at None or pass False to compile the whole model "
            "as one"
        )
    return LayerRegions.of(layers)
