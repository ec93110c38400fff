"""Registered leaf types shared by the program tests (import-safe without a GPU or
hypothesis)."""

from dataclasses import dataclass

import torch

from cudagraphs.program import LeafTypes


@dataclass(eq=False)
class QuantizedTensor:
    """int8 data plus a float32 scale, a block size, and an optional zero point: the
    zero point makes the set of tensor names vary between instances."""

    data: torch.Tensor
    scale: torch.Tensor
    block: int
    zero_point: torch.Tensor | None = None


@dataclass(eq=False)
class PackedTensor:
    """Same tensor names and metadata as QuantizedTensor, but another leaf type."""

    data: torch.Tensor
    scale: torch.Tensor
    block: int


def _quantized_flatten(q):
    tensors = {"data": q.data, "scale": q.scale}
    if q.zero_point is not None:
        tensors["zero_point"] = q.zero_point
    return tensors, {"block": q.block}


def _quantized_unflatten(tensors, metadata):
    return QuantizedTensor(
        tensors["data"], tensors["scale"], metadata["block"], tensors.get("zero_point")
    )


def make_leaf_types() -> LeafTypes:
    leaf_types = LeafTypes()
    leaf_types.register(
        QuantizedTensor,
        flatten=_quantized_flatten,
        unflatten=_quantized_unflatten,
        name="QuantizedTensor",
    )
    leaf_types.register(
        PackedTensor,
        flatten=lambda p: ({"data": p.data, "scale": p.scale}, {"block": p.block}),
        unflatten=lambda t, m: PackedTensor(t["data"], t["scale"], m["block"]),
        name="PackedTensor",
    )
    return leaf_types


# Read-only after construction; hypothesis tests cannot take function-scoped fixtures.
LEAF_TYPES = make_leaf_types()
LEAVES = (QuantizedTensor, PackedTensor)
