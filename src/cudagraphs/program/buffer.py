"""Fixed-address storage that a captured graph reads, refilled by copies per call."""

from __future__ import annotations

from typing import Any

import torch

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
            raise ValueError(
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

    @property
    def nbytes(self) -> int:
        """Logical bytes of the fixed storage."""
        return self.signature.nbytes

    def copy_from(self, value: Any, *, non_blocking: bool = False, path: str = "inputs") -> None:
        """Validate ``value`` against the signature, then copy it in.

        The whole tree is validated first, so a mismatch leaves the buffer untouched.
        Sources may sit on the CPU (pinned memory for a truly asynchronous copy) or on
        any CUDA device. Copies are grouped by source device and dtype, one fused
        launch per group (``torch._foreach_copy_``), on the current stream.

        Raises:
            SignatureMismatchError: naming every path that differs.
        """
        self.copy_tensors(self.signature.flatten(value, path=path), non_blocking=non_blocking)

    def copy_tensors(self, sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
        """Copy already-validated sources (in signature order) into the buffer,
        skipping any source that is the buffer tensor itself."""
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for dst, src in zip(self.tensors, sources):
            if src.device == dst.device and src.data_ptr() == dst.data_ptr():
                continue
            dsts, srcs = groups.setdefault((src.device, src.dtype), ([], []))
            dsts.append(dst)
            srcs.append(src)
        # Buffers may require grad (their signature records it); copying into them is
        # data movement, not a differentiable op.
        with torch.no_grad():
            for dsts, srcs in groups.values():
                if len(dsts) == 1:
                    dsts[0].copy_(srcs[0], non_blocking=non_blocking)
                else:
                    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)

    def __repr__(self) -> str:
        return (
            f"ReusableValueBuffer({len(self.tensors)} tensors, {self.nbytes} bytes on "
            f"{self.device})"
        )
