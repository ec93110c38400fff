"""Whether torch's grouped GEMM keeps MoE routing on the device, for one dtype on one
device: the fact that decides if ``grouped_mm`` experts can be captured.

transformers' ``grouped_mm`` experts call ``torch._grouped_mm`` with the per-expert
offsets on the device. torch has a grouped-GEMM kernel only for some dtypes on some
GPUs (torch 2.11: bfloat16 on compute capability 9.x and 10.x); for anything else it
falls back to a loop of plain matmuls that first copies the offsets to the host
(``offs.cpu()``). That copy is a synchronizing device-to-host transfer: eager runs it
fine, a capture fails on it ("Cannot copy between CPU and CUDA tensors during CUDA
graph capture"). The same model is therefore graph-safe in bfloat16 and not in
float32.

The lists of dtypes and GPUs change between torch releases, so the fact is asked of
torch, not written down here: :class:`GroupedMMProbe` runs one tiny grouped GEMM with
``torch.cuda.set_sync_debug_mode("error")``, under which torch raises at a
synchronizing copy instead of performing it. No graph is captured and no model tensor
is touched. Weights off CUDA raise no capture question and count as on the device.

What this module does NOT do: it reads no config (:mod:`.scopes` decides which
implementation is in effect) and probes nothing but ``torch._grouped_mm``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["GroupedMMProbe", "experts_weight"]

logger = logging.getLogger(__name__)

_EXPERTS_CHILD = "experts"
# The probe's problem: 2 groups of 8 rows, 16 x 16 weights. Dimensions are multiples
# of 16 bytes in every dtype the kernels take (their alignment rule), so a refusal is
# about the dtype or the GPU, never about this shape.
_ROWS, _DIM, _GROUPS = 16, 16, 2


def experts_weight(moe_module: nn.Module) -> torch.Tensor | None:
    """The first floating-point parameter of ``moe_module``'s ``experts`` child (of
    ``moe_module`` itself when it has none): the dtype and device the experts' GEMMs
    run in, since transformers casts the activations to the weights' dtype. ``None``
    when there is no such parameter. Borrows."""
    experts = getattr(moe_module, _EXPERTS_CHILD, None)
    owner = experts if isinstance(experts, nn.Module) else moe_module
    for p in owner.parameters():
        if p.is_floating_point():
            return p
    return None


class GroupedMMProbe:
    """Asks torch, once per (dtype, device), whether ``torch._grouped_mm`` runs without
    a host sync. One probe serves one discovery pass; it holds only its answers."""

    def __init__(self) -> None:
        self._known: dict[tuple[torch.dtype, torch.device], bool] = {}

    def on_device(self, weight: torch.Tensor | None) -> bool:
        """Whether grouped GEMMs with ``weight``'s dtype keep their offsets on
        ``weight``'s device. ``True`` for no weight and for weights off CUDA (no
        capture is asked of them); ``False`` when torch has no ``_grouped_mm`` or the
        op fails for this dtype (it cannot be captured either)."""
        if weight is None or weight.device.type != "cuda":
            return True
        key = (weight.dtype, weight.device)
        if key not in self._known:
            self._known[key] = _runs_on_device(*key)
            logger.debug(
                "grouped GEMM in %s on %s %s its offsets on the device",
                key[0],
                key[1],
                "keeps" if self._known[key] else "does not keep",
            )
        return self._known[key]


def _runs_on_device(dtype: torch.dtype, device: torch.device) -> bool:
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return False
    # Built before the debug mode is on: making offs is itself a host-to-device copy.
    a = torch.zeros(_ROWS, _DIM, dtype=dtype, device=device)
    b = torch.zeros(_GROUPS, _DIM, _DIM, dtype=dtype, device=device)
    offs = torch.arange(1, _GROUPS + 1, dtype=torch.int32, device=device) * (_ROWS // _GROUPS)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        prior = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            grouped_mm(a, b.transpose(-2, -1), offs=offs)
            return True
        except RuntimeError as exc:
            logger.debug("grouped GEMM probe in %s on %s: %s", dtype, device, exc)
            return False
        finally:
            torch.cuda.set_sync_debug_mode(prior)
