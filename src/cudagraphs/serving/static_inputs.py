"""Static input buffers shared by every bucket of a runner.

Each named input is allocated once, at the largest bucket, with its row dimension
(batch or packed tokens) moved to the front of the storage. A bucket's graph is
captured on the leading ``rows`` of that storage, viewed back in the caller's layout,
so all buckets share one set of buffers and every bucket's slice is one contiguous
block: staging a batch is one fused copy, and padding is one fill per input.

A batch that differs from the specs is refused before anything is written, with one
:class:`~cudagraphs.errors.Mismatch` per difference (the report every layer uses). An
input whose dtype converts losslessly into its spec's (int32 ids into int64, bfloat16
into float32) is accepted and converted by the staging copy.

Per step, only what depends on the batch is done: what a (bucket, rows) pair writes
(each input's real rows and padding rows, as views of the storage) is a
:class:`StagePlan` made the first time that pair is staged, and a batch that matches the
specs exactly is recognised by :meth:`StaticInputs.exact_rows` in a few attribute reads
per input. Slicing a tensor costs about a microsecond of host time, more than the rest
of a step's checks together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import converts_losslessly
from ..errors import CudaGraphInputError, Mismatch, describe_mismatches
from .buckets import Bucket
from .input_specs import InputSpec, Said, check_specs, shape_pattern

__all__ = ["StagePlan", "StaticInputs"]

#: Staging plans kept per :class:`StaticInputs` (and output views per captured graph):
#: every (bucket, rows) pair of the default buckets fits many times over. Configs with
#: more distinct row counts (token buckets) make the plans past it per call instead.
PLAN_CACHE_SIZE = 1024


@dataclass(frozen=True)
class StagePlan:
    """What staging ``rows`` real rows into a bucket of more rows writes, worked out once
    per (bucket rows, rows): views of the storage, borrowed from the
    :class:`StaticInputs` that made it.

    It does NOT check the batch: :meth:`StaticInputs.stage` validates first, and the
    runner's fast path calls :meth:`write` only for a batch
    :meth:`StaticInputs.exact_rows` matched.
    """

    names: tuple[str, ...]
    #: Per input (in ``names`` order), its real rows in the caller's layout.
    dsts: tuple[torch.Tensor, ...]
    #: The padding rows of inputs padded with 0 (one fused fill for all).
    zeros: tuple[torch.Tensor, ...]
    #: The padding rows of the other inputs, with their pad value.
    fills: tuple[tuple[torch.Tensor, float | int], ...]

    def write(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy the real rows (one fused copy, converting a lossless dtype) and reset
        the padding rows to each input's pad value."""
        torch._foreach_copy_(self.dsts, [inputs[name] for name in self.names])
        if self.zeros:
            torch._foreach_zero_(self.zeros)  # one launch for every zero-padded input
        for pad, value in self.fills:
            pad.fill_(value)


class StaticInputs:
    """The runner's input buffers: one storage per input, sliced per bucket (owned).

    Args:
        specs: the inputs at the largest bucket.
        max_rows: rows of the largest bucket.
        device: where the buffers live.

    Raises:
        CudaGraphsTypeError, CudaGraphsValueError: as :func:`check_specs`.
    """

    def __init__(
        self, specs: Sequence[InputSpec], max_rows: int, device: torch.device | str
    ) -> None:
        self.specs = {s.name: s for s in check_specs(specs, max_rows)}
        self.max_rows = max_rows
        # Row dimension first: a bucket's rows are one contiguous leading block.
        self._storage = {
            s.name: torch.full((max_rows, *s.trailing), s.pad_value, dtype=s.dtype, device=device)
            for s in self.specs.values()
        }
        # The device as tensors report it ("cuda" becomes "cuda:0"), for comparisons.
        self.device = next(iter(self._storage.values())).device
        # What the per-call check compares, worked out once: (name, dtype, row_dim,
        # dims before the rows, dims after them).
        self._expected = tuple(
            (s.name, s.dtype, s.row_dim, s.shape[: s.row_dim], s.shape[s.row_dim + 1 :])
            for s in self.specs.values()
        )
        first = self._expected[0]
        self._first = (first[0], first[2])  # where exact_rows reads the row count
        # rows -> ((name, dtype, shape at those rows), ...): exact_rows' expectations.
        self._exact: dict[int, tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]] = {}
        self._plans: dict[tuple[int, int], StagePlan] = {}

    def view(self, name: str, rows: int) -> torch.Tensor:
        """Input ``name`` for ``rows`` rows, in the caller's layout (a view of the
        shared storage: graphs captured on it read the same addresses for all buckets)."""
        spec = self.specs[name]
        return self._storage[name][:rows].movedim(0, spec.row_dim)

    def views(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        return {name: self.view(name, bucket.rows) for name in self.specs}

    def batch_rows(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """The number of rows every input of the batch holds in its row_dim.

        Raises:
            CudaGraphInputError: the inputs are not a mapping, miss names, hold
                something other than tensors, or disagree on their rows (with every
                other difference from the specs).
        """
        try:
            counts = {inputs[name].shape[dim] for name, _, dim, _, _ in self._expected}
        except (KeyError, AttributeError, IndexError, TypeError):
            counts = set()  # the report below says which input and why
        if len(counts) == 1:
            return counts.pop()
        raise self._error(inputs, None, None, self.mismatches(inputs, None, None))

    def exact_rows(self, inputs: Any) -> int | None:
        """The batch's rows when it matches the specs exactly, else ``None``.

        Exactly: a ``dict`` holding the specs' names and nothing else, each a tensor
        of its spec's dtype on the buffers' device with its spec's shape at one row
        count between 1 and ``max_rows``. What passes here passes :meth:`validate` for
        any bucket of at least that many rows. ``None`` says nothing about the batch
        (a lossless dtype, another Mapping, a bad batch): the caller runs the full
        check, which accepts or reports it. Writes nothing, raises nothing.
        """
        if type(inputs) is not dict or len(inputs) != len(self._expected):
            return None
        name, dim = self._first
        try:
            rows = inputs[name].shape[dim]
        except (KeyError, AttributeError, IndexError, TypeError):
            return None
        expected = self._exact.get(rows)
        if expected is None:
            if not isinstance(rows, int) or not 1 <= rows <= self.max_rows:
                return None
            expected = self._exact[rows] = tuple(
                (name, dtype, (*before, rows, *after))
                for name, dtype, _, before, after in self._expected
            )
        device = self.device
        for name, dtype, shape in expected:
            t = inputs.get(name)
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != dtype
                or t.device != device
                or t.shape != shape
                or t.requires_grad
            ):
                return None
        return rows

    def validate(
        self, inputs: Mapping[str, torch.Tensor], bucket: Bucket | None, rows: int
    ) -> None:
        """Check a batch of ``rows`` real rows against the specs (and, with a
        ``bucket``, that it fits that bucket and the buffers). Nothing is written.

        A dtype other than the spec's passes when it converts losslessly into it.

        Raises:
            CudaGraphInputError: one :class:`Mismatch` per difference (names, type,
                dtype, device, shape, rows), naming the input and the bucket.
        """
        if self._matches(inputs, bucket, rows):
            return
        found = self.mismatches(inputs, bucket, rows)
        if found:
            raise self._error(inputs, bucket, rows, found)

    def _matches(self, inputs: Any, bucket: Bucket | None, rows: int) -> bool:
        # The per-call path: True only when everything matches exactly. Anything else
        # (a lossless dtype conversion included) goes to the full check.
        if rows < 1 or (bucket is not None and not rows <= bucket.rows <= self.max_rows):
            return False
        if not isinstance(inputs, Mapping) or len(inputs) != len(self._expected):
            return False
        device = self.device
        for name, dtype, _, before, after in self._expected:
            t = inputs.get(name)
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != dtype
                or t.device != device
                or t.shape != (*before, rows, *after)
                or t.requires_grad
            ):
                return False
        return True

    def _error(
        self, inputs: Any, bucket: Bucket | None, rows: int | None, mismatches: list[Mismatch]
    ) -> CudaGraphInputError:
        what = "inputs" if bucket is None else f"inputs for {bucket}"
        if rows is not None:
            what += f" ({rows} rows)"
        return CudaGraphInputError(
            describe_mismatches(
                f"{what} differ from the runner's input specs", mismatches, self._fix(inputs)
            ),
            mismatches,
        )

    def mismatches(self, inputs: Any, bucket: Bucket | None, rows: int | None) -> list[Mismatch]:
        """Every difference between a batch and the specs (empty: it can be staged).
        ``rows=None``: the batch's rows are unknown, and inputs that disagree on them
        are a difference."""
        if not isinstance(inputs, Mapping):
            return [Mismatch("inputs", "type", "Mapping[str, Tensor]", type(inputs).__name__)]
        found = []
        if set(inputs) != set(self.specs):
            found.append(Mismatch("inputs", "names", sorted(self.specs), sorted(inputs, key=str)))
        counts: dict[str, int] = {}
        for name, spec in self.specs.items():
            if name in inputs:
                found += self._input_mismatches(name, spec, inputs[name], rows, counts)
        if rows is None and len(set(counts.values())) > 1:
            found.append(Mismatch("inputs", "row counts", Said("one count for all"), counts))
        if rows is not None and rows < 1:
            # An empty batch: nothing to stage (a rank with no requests, say). Said
            # here, where every path meets it, not by an assert when staging.
            found.append(Mismatch("inputs", "rows", Said("at least 1"), rows))
        if bucket is not None and rows is not None and rows > bucket.rows:
            found.append(
                Mismatch(
                    "inputs", "rows", Said(f"at most {bucket.rows}, the rows of {bucket}"), rows
                )
            )
        if bucket is not None and bucket.rows > self.max_rows:
            found.append(
                Mismatch(
                    str(bucket),
                    "rows",
                    Said(f"at most {self.max_rows}, the buffers' rows"),
                    bucket.rows,
                )
            )
        return found

    def _input_mismatches(
        self, name: str, spec: InputSpec, t: Any, rows: int | None, counts: dict[str, int]
    ) -> list[Mismatch]:
        path = f"inputs[{name!r}]"
        if not isinstance(t, torch.Tensor):
            return [Mismatch(path, "type", "Tensor", type(t).__name__)]
        found = []
        if t.dtype != spec.dtype and not converts_losslessly(t.dtype, spec.dtype):
            found.append(Mismatch(path, "dtype", spec.dtype, t.dtype))
        if t.device != self.device:
            found.append(Mismatch(path, "device", self.device, t.device))
        if t.requires_grad:
            # Copied into the buffers it would make them part of its autograd graph,
            # for this call and every later one; the graphs compute no gradient anyway.
            found.append(Mismatch(path, "requires_grad", False, True))
        trailing = tuple(n for i, n in enumerate(t.shape) if i != spec.row_dim)
        if t.dim() != len(spec.shape) or trailing != spec.trailing:
            found.append(Mismatch(path, "shape", shape_pattern(spec, rows), tuple(t.shape)))
            return found
        counts[name] = t.shape[spec.row_dim]
        if rows is not None and counts[name] != rows:
            found.append(Mismatch(path, f"rows in dim {spec.row_dim}", rows, counts[name]))
        return found

    def _fix(self, inputs: Any) -> str:
        names = ""
        if isinstance(inputs, Mapping):
            missing = sorted(set(self.specs) - set(inputs))
            unknown = sorted(set(inputs) - set(self.specs), key=str)
            names = "".join(
                f" {label}: {found}."
                for label, found in (("Missing inputs", missing), ("Unknown inputs", unknown))
                if found
            )
        return (
            f"Nothing was staged.{names} Pass every input named in the specs, each a tensor "
            f"on {self.device} with its spec's dtype (or one that converts to it "
            "losslessly, such as int32 into int64) and its spec's shape, with the batch's "
            "rows in its row_dim, not requiring grad (pass x.detach(): the graphs compute "
            "no gradient)."
        )

    def in_spec_dtypes(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """A validated batch with each tensor in its spec's dtype (``inputs`` itself
        when all match): what an eager run passes to forward, as staging would."""
        if all(inputs[name].dtype == spec.dtype for name, spec in self.specs.items()):
            return inputs
        return {name: inputs[name].to(spec.dtype) for name, spec in self.specs.items()}

    def stage(self, inputs: Mapping[str, torch.Tensor], bucket: Bucket, rows: int) -> None:
        """Validate, then copy the real rows (one fused copy, converting a lossless
        dtype) and reset the padding rows of ``bucket`` to each input's ``pad_value``.

        Raises:
            CudaGraphInputError: as :meth:`validate`; nothing is written then.
        """
        self.validate(inputs, bucket, rows)
        self.staging(bucket, rows).write(inputs)

    def staging(self, bucket: Bucket, rows: int) -> StagePlan:
        """The :class:`StagePlan` of ``rows`` real rows in ``bucket`` (made once, kept
        for the first :data:`PLAN_CACHE_SIZE` pairs). ``rows`` must be in
        ``1..bucket.rows`` and the bucket within the buffers (as :meth:`validate`
        checks)."""
        key = (bucket.rows, rows)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        assert 1 <= rows <= bucket.rows <= self.max_rows, (rows, bucket, self.max_rows)
        zeros, fills = [], []
        if rows < bucket.rows:
            for name, spec in self.specs.items():
                # Row dimension first in the storage: the padding rows are one block.
                pad = self._storage[name][rows : bucket.rows]
                if spec.pad_value == 0:
                    zeros.append(pad)
                else:
                    fills.append((pad, spec.pad_value))
        plan = StagePlan(
            names=tuple(self.specs),
            # Copying into the caller's layout (a view of the leading rows) copies the
            # same elements as moving each source's rows to the front.
            dsts=tuple(self.view(name, rows) for name in self.specs),
            zeros=tuple(zeros),
            fills=tuple(fills),
        )
        if len(self._plans) < PLAN_CACHE_SIZE:
            self._plans[key] = plan
        return plan

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._storage.values())
