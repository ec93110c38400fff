"""The input specs of a runner, checked: what each named input looks like at the largest
bucket, how its row dimension is found, and how a report shows the shape a call must
pass. Pure checks, run once at construction, holding no tensors; the buffers built from
the specs are :class:`~cudagraphs.serving.static_inputs.StaticInputs`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import check_int, check_number
from ..dtypes import holds_plain_values
from ..errors import CudaGraphsTypeError, CudaGraphsValueError

__all__ = ["InputSpec", "Said", "check_specs", "infer_row_dim", "shape_pattern"]


class Said(str):
    """Text shown as written in a mismatch report (``Mismatch`` shows values by repr),
    for expectations that are a rule rather than a value: "at most 8 rows"."""

    def __repr__(self) -> str:
        return str.__str__(self)


@dataclass(frozen=True)
class InputSpec:
    """One named input at the largest bucket. Every field is checked here.

    Args:
        name: the keyword the forward function receives it under.
        shape: its shape at the largest bucket (a tuple or list of ints >= 1).
        dtype: its dtype (a ``torch.dtype`` such as ``torch.float32``).
        row_dim: the dimension that grows with the bucket (batch or tokens); negative
            values count from the end.
        pad_value: what padding rows hold (0, or a neutral value such as an
            out-of-range position that the model ignores); a number the dtype holds.

    Raises:
        CudaGraphsTypeError: a name that is not a str, a shape that is not a sequence
            of ints, a dtype that is not a ``torch.dtype`` (a string such as
            ``"float32"``), a ``row_dim`` that is not an int, a ``pad_value`` that is
            not a number.
        CudaGraphsValueError: an empty shape, a size below 1, a ``row_dim`` out of
            range, a ``pad_value`` the dtype cannot hold.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    row_dim: int = 0
    pad_value: float | int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise CudaGraphsTypeError(
                f"InputSpec name must be a str (the keyword forward receives), got "
                f"{type(self.name).__name__} {self.name!r}"
            )
        where = f"InputSpec {self.name!r}"
        object.__setattr__(self, "shape", _checked_shape(where, self.shape))
        if not isinstance(self.dtype, torch.dtype):
            hint = "float32"
            if isinstance(self.dtype, str):
                hint = self.dtype.removeprefix("torch.")
            raise CudaGraphsTypeError(
                f"{where}: dtype must be a torch.dtype (pass torch.{hint}), got "
                f"{type(self.dtype).__name__} {self.dtype!r}"
            )
        if not holds_plain_values(self.dtype):
            raise CudaGraphsTypeError(
                f"{where}: dtype {self.dtype} cannot be a static input: quantized, sub-byte "
                "and bits dtypes cannot be filled with a pad value or copied into slices. "
                "Pass the unpacked dtype (for example torch.uint8) and convert inside forward."
            )
        check_int(f"{where}: row_dim", self.row_dim)
        if not -len(self.shape) <= self.row_dim < len(self.shape):
            raise CudaGraphsValueError(
                f"{where}: row_dim {self.row_dim} is out of range for shape {self.shape}"
            )
        object.__setattr__(self, "row_dim", self.row_dim % len(self.shape))
        if not isinstance(self.pad_value, bool):  # False/True: the pad of a bool mask
            check_number(f"{where}: pad_value", self.pad_value)
        if not _holds(self.dtype, self.pad_value):
            raise CudaGraphsValueError(
                f"{where}: pad_value {self.pad_value!r} is not a value of {self.dtype}; "
                "pass one it holds exactly"
            )

    @property
    def trailing(self) -> tuple[int, ...]:
        """The shape without the row dimension (what every call must match)."""
        return tuple(n for i, n in enumerate(self.shape) if i != self.row_dim)


def _checked_shape(where: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or any(
        isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in shape
    ):
        raise CudaGraphsTypeError(
            f"{where}: shape must be a tuple or list of ints, got {type(shape).__name__} {shape!r}"
        )
    if not shape:
        raise CudaGraphsValueError(f"{where}: shape is empty; an input needs a row dimension")
    small = [i for i, n in enumerate(shape) if n < 1]
    if small:
        raise CudaGraphsValueError(
            f"{where}: shape {tuple(shape)} has sizes below 1 in dims {small}; give its "
            "shape at the largest bucket, every size >= 1"
        )
    return tuple(int(n) for n in shape)


def _holds(dtype: torch.dtype, value: float | int) -> bool:
    """Whether ``dtype`` holds ``value`` exactly (floating types: any number)."""
    if dtype.is_floating_point or dtype.is_complex:
        return True
    if dtype == torch.bool:
        return value in (0, 1)
    if isinstance(value, float) and not value.is_integer():
        return False
    # Every other dtype a spec accepts is an integer type (holds_plain_values).
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


def check_specs(specs: Any, max_rows: int) -> list[InputSpec]:
    """``specs`` as a list, checked: a non-empty sequence of :class:`InputSpec` with
    distinct names, each holding ``max_rows`` rows (the largest bucket) in its row_dim.

    Raises:
        CudaGraphsTypeError: not a sequence (a dict, a single spec), or an entry that is
            not an ``InputSpec`` (naming its index).
        CudaGraphsValueError: no specs, repeated names, or specs without ``max_rows``
            rows.
    """
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise CudaGraphsTypeError(
            "inputs must be a sequence (list or tuple) of InputSpec, got "
            f"{type(specs).__name__}; pass [InputSpec('tokens', (64,), torch.long), ...]"
        )
    for i, spec in enumerate(specs):
        if not isinstance(spec, InputSpec):
            raise CudaGraphsTypeError(
                f"inputs[{i}] must be an InputSpec, got {type(spec).__name__} {spec!r}"
            )
    if not specs:
        raise CudaGraphsValueError("inputs is empty; a runner needs at least one InputSpec")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise CudaGraphsValueError(f"input names repeat: {names}")
    bad = [s.name for s in specs if s.shape[s.row_dim] != max_rows]
    if bad:
        raise CudaGraphsValueError(
            f"inputs {bad} do not have {max_rows} rows (the largest bucket) in their "
            "row_dim; give each InputSpec its shape at the largest bucket"
        )
    return list(specs)


def infer_row_dim(
    name: str, large: Sequence[int], small: Sequence[int], rows_large: int, rows_small: int
) -> int:
    """The dimension of an input that scales with the bucket, from its shapes at two
    buckets (``rows_large`` and ``rows_small`` rows).

    Raises:
        CudaGraphsValueError: the shapes differ in rank, in no dimension or in several,
            or the differing dimension does not hold the row counts.
    """
    if len(large) != len(small):
        raise CudaGraphsValueError(
            f"input {name!r}: rank differs between buckets ({list(large)} vs {list(small)})"
        )
    dims = [i for i, (a, b) in enumerate(zip(large, small)) if a != b]
    if len(dims) == 1 and large[dims[0]] == rows_large and small[dims[0]] == rows_small:
        return dims[0]
    candidates = [
        i for i, (a, b) in enumerate(zip(large, small)) if a == rows_large and b == rows_small
    ]
    if not dims and len(candidates) == 1:
        return candidates[0]
    raise CudaGraphsValueError(
        f"input {name!r}: cannot tell which dimension grows with the bucket from shapes "
        f"{list(large)} ({rows_large} rows) and {list(small)} ({rows_small} rows); "
        "give its row_dim explicitly"
    )


def shape_pattern(spec: InputSpec, rows: int | None) -> Said:
    """The shape a call must pass, with its rows (or "rows") in the row dimension."""
    dims = [str(n) for n in spec.shape]
    dims[spec.row_dim] = "rows" if rows is None else str(rows)
    return Said("(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")")
