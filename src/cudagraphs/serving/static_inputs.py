"""Static input buffers shared by every bucket of a runner.

Each named input is allocated once, at the largest bucket, with its row dimension
(batch or packed tokens) moved to the front of the storage. A bucket's graph is
captured on the leading ``rows`` of that storage, viewed back in the caller's layout,
so all buckets share one set of buffers and every bucket's slice is one contiguous
block: staging a batch is one fused copy, and padding is one fill per input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import CudaGraphInputError
from .buckets import Bucket

__all__ = ["InputSpec", "StaticInputs", "infer_row_dim"]


@dataclass(frozen=True)
class InputSpec:
    """One named input at the largest bucket.

    Args:
        name: the keyword the forward function receives it under.
        shape: its shape at the largest bucket.
        dtype: its dtype.
        row_dim: the dimension that grows with the bucket (batch or tokens).
        pad_value: what padding rows hold (0, or a neutral value such as an
            out-of-range position that the model ignores).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    row_dim: int = 0
    pad_value: float | int = 0

    def __post_init__(self) -> None:
        if not -len(self.shape) <= self.row_dim < len(self.shape):
            raise ValueError(
                f"input {self.name!r}: row_dim {self.row_dim} is out of range for shape {self.shape}"
            )
        object.__setattr__(self, "row_dim", self.row_dim % len(self.shape))

    @property
    def trailing(self) -> tuple[int, ...]:
        """The shape without the row dimension (what every call must match)."""
        return tuple(n for i, n in enumerate(self.shape) if i != self.row_dim)


def infer_row_dim(
    name: str, large: Sequence[int], small: Sequence[int], rows_large: int, rows_small: int
) -> int:
    """The dimension of an input that scales with the bucket, from its shapes at two
    buckets (``rows_large`` and ``rows_small`` rows).

    Raises:
        ValueError: the shapes differ in rank, in no dimension or in several, or the
            differing dimension does not hold the row counts.
    """
    if len(large) != len(small):
        raise ValueError(
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
    raise ValueError(
        f"input {name!r}: cannot tell which dimension grows with the bucket from shapes "
        f"{list(large)} ({rows_large} rows) and {list(small)} ({rows_small} rows); "
        "give its row_dim explicitly"
    )


class StaticInputs:
    """The runner's input buffers: one storage per input, sliced per bucket.

    Args:
        specs: the inputs at the largest bucket.
        max_rows: rows of the largest bucket.
        device: where the buffers live.
    """

    def __init__(
        self, specs: Sequence[InputSpec], max_rows: int, device: torch.device | str
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"input names repeat: {names}")
        bad = [s.name for s in specs if s.shape[s.row_dim] != max_rows]
        if bad:
            raise ValueError(
                f"inputs {bad} do not have {max_rows} rows (the largest bucket) in their row_dim"
            )
        self.specs = {s.name: s for s in specs}
        self.max_rows = max_rows
        # Row dimension first: a bucket's rows are one contiguous leading block.
        self._storage = {
            s.name: torch.full((max_rows, *s.trailing), s.pad_value, dtype=s.dtype, device=device)
            for s in specs
        }
        # The device as tensors report it ("cuda" becomes "cuda:0"), for comparisons.
        probe = next(iter(self._storage.values()), None)
        self.device = probe.device if probe is not None else torch.device(device)

    def view(self, name: str, rows: int) -> torch.Tensor:
        """Input ``name`` for ``rows`` rows, in the caller's layout (a view of the
        shared storage: graphs captured on it read the same addresses for all buckets)."""
        spec = self.specs[name]
        return self._storage[name][:rows].movedim(0, spec.row_dim)

    def views(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        return {name: self.view(name, bucket.rows) for name in self.specs}

    def validate(self, inputs: Mapping[str, torch.Tensor], bucket: Bucket, rows: int) -> None:
        """Check a batch of ``rows`` real rows against the specs, naming the input and
        the bucket of every problem. Nothing is written.

        Raises:
            CudaGraphInputError: missing or unknown names, dtype, device, trailing
                dimensions or row count that differ.
        """
        problems = []
        missing = sorted(set(self.specs) - set(inputs))
        unknown = sorted(set(inputs) - set(self.specs))
        if missing:
            problems.append(f"missing inputs {missing}")
        if unknown:
            problems.append(f"unknown inputs {unknown}")
        for name, t in inputs.items():
            spec = self.specs.get(name)
            if spec is None:
                continue
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name}: expected a tensor, got {type(t).__name__}")
                continue
            if t.dtype != spec.dtype:
                problems.append(f"{name}: dtype {t.dtype} != {spec.dtype}")
            if t.device != self.device:
                problems.append(f"{name}: on {t.device}, the runner's buffers are on {self.device}")
            if t.dim() != len(spec.shape):
                problems.append(f"{name}: {t.dim()} dims != {len(spec.shape)}")
                continue
            trailing = tuple(n for i, n in enumerate(t.shape) if i != spec.row_dim)
            if trailing != spec.trailing:
                problems.append(
                    f"{name}: dims besides row dim {spec.row_dim} are {trailing} != {spec.trailing}"
                )
            if t.shape[spec.row_dim] != rows:
                problems.append(
                    f"{name}: {t.shape[spec.row_dim]} rows in dim {spec.row_dim}, the batch has {rows}"
                )
        if rows > bucket.rows:
            problems.append(f"{rows} rows do not fit {bucket} ({bucket.rows} rows)")
        if bucket.rows > self.max_rows:
            problems.append(f"{bucket} needs {bucket.rows} rows, the buffers hold {self.max_rows}")
        if problems:
            raise CudaGraphInputError(
                f"inputs for {bucket} rejected; nothing was staged:\n  " + "\n  ".join(problems)
            )

    def stage(self, inputs: Mapping[str, torch.Tensor], bucket: Bucket, rows: int) -> None:
        """Validate, then copy the real rows (one fused copy) and reset the padding rows
        of ``bucket`` to each input's ``pad_value``."""
        self.validate(inputs, bucket, rows)
        dsts, srcs = [], []
        for name, spec in self.specs.items():
            dsts.append(self._storage[name][:rows])
            srcs.append(inputs[name].movedim(spec.row_dim, 0))
        torch._foreach_copy_(dsts, srcs)
        if rows < bucket.rows:
            zeros = []
            for name, spec in self.specs.items():
                pad = self._storage[name][rows : bucket.rows]
                if spec.pad_value == 0:
                    zeros.append(pad)
                else:
                    pad.fill_(spec.pad_value)
            if zeros:
                torch._foreach_zero_(zeros)  # one launch for every zero-padded input

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._storage.values())
