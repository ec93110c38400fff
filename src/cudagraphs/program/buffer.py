"""Fixed-address storage that a captured graph reads, refilled by copies per call."""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..errors import CudaGraphsValueError
from ..torch_private import below_autograd
from .signature import ValueTreeSignature

__all__ = ["ReusableValueBuffer"]


class ReusableValueBuffer:
    """Storage for payloads of one :class:`ValueTreeSignature`, allocated once on one
    device; a graph captured on :attr:`value` keeps reading the same addresses while
    :meth:`copy_from` changes their contents.

    Args:
        signature: the payload structure this buffer holds.
        device: where the storage lives (the graph's device).

    Raises:
        ValueError: the signature holds expanded (stride-0) tensors.

    Not thread safe; one owner (a program) copies into it.
    """

    def __init__(self, signature: ValueTreeSignature, device: torch.device | str) -> None:
        overlapping = [i for i, t in enumerate(signature.tensor_signatures()) if t.self_overlapping]
        if overlapping:
            raise CudaGraphsValueError(
                f"input tensors {overlapping} (in flatten order) are expanded views whose "
                "elements share memory (stride 0); a fixed buffer cannot hold them. Pass "
                "materialized tensors (.contiguous()) or expand inside the function."
            )
        self.signature = signature
        self.device = torch.device(device)
        self.tensors: list[torch.Tensor] = [
            s.empty(self.device) for s in signature.tensor_signatures()
        ]
        #: The buffer as a tree of the signature's structure (borrowed: its tensors are
        #: overwritten by every copy).
        self.value: Any = signature.rebuild(self.tensors)
        # Copy groups by dtype, fixed by the signature.
        self._groups = _dtype_groups(self.tensors)
        self._below_autograd = _below_autograd()

    @property
    def nbytes(self) -> int:
        """Logical bytes of the fixed storage."""
        return self.signature.nbytes

    def copy_from(self, value: Any, *, non_blocking: bool = False, path: str = "inputs") -> None:
        """Validate ``value`` against the signature, then copy it in.

        The whole tree is validated first, so a mismatch leaves the buffer untouched.
        Sources may sit on the CPU (pinned memory for a truly asynchronous copy) or on
        any CUDA device. Copies are grouped by dtype, one fused launch per group
        (``torch._foreach_copy_``), on the current stream.

        Raises:
            SignatureMismatchError: naming every path that differs.
        """
        self.copy_tensors(self.signature.flatten(value, path=path), non_blocking=non_blocking)

    def copy_tensors(
        self,
        sources: list[torch.Tensor],
        *,
        non_blocking: bool = False,
        may_alias: bool = True,
    ) -> None:
        """Copy sources (in signature order) into the buffer; nothing is copied for
        sources that are the buffer's own tensors. ``may_alias=False`` promises there
        are none, which saves work on the replay path.

        Copies record no autograd history and do not bump the tensors' version
        counters (as a graph replay writing into them does not): do not save these
        tensors for a backward pass across copies."""
        groups = self._groups
        if may_alias:
            same = list(map(operator.is_, sources, self.tensors))
            if any(same):
                if all(same):
                    return
                # Some sources are the buffer itself: copy only the others (rare path).
                keep = [i for i, s in enumerate(same) if not s]
                sources = [sources[i] for i in keep]
                groups = _dtype_groups([self.tensors[i] for i in keep])
        # Refilling the buffer is data movement, not a differentiable op: dispatch
        # below autograd, so nothing is recorded (buffers may require grad, as their
        # signature says) and autograd's per-tensor bookkeeping (in-place checks,
        # version counters) is skipped, 0.06 to 0.08 us per tensor on the replay path
        # (``docs/program.md``, 64 inputs).
        with self._below_autograd:
            _copy_groups(groups, sources, non_blocking)

    def copy_on(
        self,
        stream: torch.cuda.Stream,
        sources: list[torch.Tensor],
        *,
        non_blocking: bool,
        wait_for: list[torch.cuda.Event],
    ) -> torch.cuda.Event:
        """Copy ``sources`` in on ``stream`` once ``wait_for`` have happened; the
        returned event marks the copy's end (a prefetch, off the replay path)."""
        for event in wait_for:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            self.copy_tensors(sources, non_blocking=non_blocking)
        for src in sources:
            if src.is_cuda:
                # The caller may drop a CUDA source at once; its memory must not be
                # reused before this stream has read it.
                src.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def __repr__(self) -> str:
        return (
            f"ReusableValueBuffer({len(self.tensors)} tensors, {self.nbytes} bytes on "
            f"{self.device})"
        )


def _below_autograd() -> Any:
    """A reusable context in which ops dispatch below autograd (no history, no version
    counter bumps)."""
    return below_autograd()


def _copy_groups(groups: list, sources: list[torch.Tensor], non_blocking: bool) -> None:
    for dsts, idx in groups:
        if len(dsts) == 1:
            dsts[0].copy_(sources[0 if idx is None else idx[0]], non_blocking=non_blocking)
        elif non_blocking:
            # One fused launch per dtype; sources on another device are handled inside
            # torch (it splits the work as needed).
            srcs = sources if idx is None else [sources[i] for i in idx]
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        else:  # the replay path: no keyword to parse
            torch._foreach_copy_(dsts, sources if idx is None else [sources[i] for i in idx])


def _dtype_groups(targets: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[int] | None]]:
    """Copy groups by dtype: (targets, source indices, or None when the group is every
    tensor in order)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(targets):
        by_dtype.setdefault(t.dtype, []).append(i)
    single = len(by_dtype) == 1
    return [([targets[i] for i in idx], None if single else idx) for idx in by_dtype.values()]
