"""The experts implementation the generator's decode steps run with, for MoE models
whose ``grouped_mm`` experts cannot be captured.

transformers' ``generate`` (5.17 and 5.24, ``GenerationMixin._optimize_model_for_decode``)
decodes with ``batched_mm`` experts wherever the model is off the CPU and ``grouped_mm``
is in effect: it switches every ``grouped_mm`` entry of ``get_experts_implementation()``
to ``batched_mm`` after the prefill and back when decoding ends; the prefill keeps
``grouped_mm``. For a float32 model, whose grouped GEMM syncs the host (no float32
kernel in torch 2.11, :mod:`cudagraphs.moe_kernels`), the generator does the same: its
eager prefill runs the model as loaded, its decode graphs (and every eager decode step)
and its prefill graphs (:mod:`.prefill`) run ``batched_mm``, so its kernels are HF's and its greedy tokens HF's. Where the installed
transformers decodes without that switch, ``batched_mm`` would be a kernel HF does not
run (its sums round differently from the per-expert matmuls of torch's fallback), so the
generator refuses, naming the fixes, before it captures anything.

What this module does NOT do: switch anything when the grouped GEMM stays on the device
(bfloat16 on Hopper): the decode graphs then run the model as loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from torch import nn

from ...moe_kernels import (
    BATCHED_MM,
    GROUPED_MM,
    GroupedMMProbe,
    find_host_grouped_mm,
    grouped_mm_refusal,
)

__all__ = [
    "DecodeExperts",
    "ExpertsChoice",
    "choose_decode_experts",
    "decode_experts",
    "decode_implementations",
    "hf_decodes_with_batched_mm",
]

logger = logging.getLogger(__name__)

ExpertsChoice = Literal["as_loaded", "batched_mm", "refuse"]
# The names transformers' decode switch is made of (GenerationMixin, PreTrainedModel).
_HF_SWITCH = (
    "_optimize_model_for_decode",
    "get_experts_implementation",
    "set_experts_implementation",
)


def choose_decode_experts(*, syncs: bool, hf_switches: bool, capturing: bool) -> ExpertsChoice:
    """The rule. ``syncs``: some ``grouped_mm`` experts would sync the host in a
    capture. ``hf_switches``: HF's ``generate`` decodes this model with ``batched_mm``
    (:func:`hf_decodes_with_batched_mm`). ``capturing``: decode steps are captured
    (``CUDAGRAPHS_DISABLE`` unset).

    Returns:
        ``"as_loaded"`` (nothing to do), ``"batched_mm"`` (decode as HF does) or
        ``"refuse"`` (no graph can hold the model's decode step, and no switch keeps
        HF's tokens).
    """
    if not syncs:
        return "as_loaded"
    if hf_switches:
        return "batched_mm"
    return "refuse" if capturing else "as_loaded"


def decode_implementations(current: Mapping[str, str | None]) -> dict[str, str | None]:
    """HF's decode map: every ``grouped_mm`` entry of ``current`` (a
    ``get_experts_implementation()`` dict: ``""`` for the model, one key per sub-config)
    as ``batched_mm``, the others unchanged."""
    return {k: BATCHED_MM if v == GROUPED_MM else v for k, v in current.items()}


def hf_decodes_with_batched_mm(model: nn.Module) -> bool:
    """Whether HF's ``generate`` switches this model's ``grouped_mm`` experts to
    ``batched_mm`` for its decode steps: the installed transformers has the switch and
    the model is off the CPU (HF's rule reads ``model.device``, its first parameter's)."""
    if not all(callable(getattr(model, name, None)) for name in _HF_SWITCH):
        return False
    first = next(model.parameters(), None)
    return first is not None and first.device.type != "cpu"


@dataclass(frozen=True)
class DecodeExperts:
    """The experts implementations decode steps run with: ``decode`` (a
    ``set_experts_implementation`` map) on ``model`` inside :meth:`decoding`, or the
    model as loaded when ``decode`` is ``None``."""

    model: nn.Module | None = None
    decode: Mapping[str, str | None] | None = None

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Run the block with the decode implementations, restoring the model's after
        (also on an exception), as HF's decode switch does."""
        if self.model is None or self.decode is None:
            yield
            return
        before = self.model.get_experts_implementation()
        self.model.set_experts_implementation(dict(self.decode))
        try:
            yield
        finally:
            self.model.set_experts_implementation(before)


def decode_experts(
    model: nn.Module, *, capturing: bool, probe: GroupedMMProbe | None = None
) -> DecodeExperts:
    """Decide, before the first bucket, what the decode steps of ``model`` run
    (:func:`choose_decode_experts`). Probes torch only for ``grouped_mm`` experts with
    CUDA weights; modifies nothing (the switch happens in
    :meth:`DecodeExperts.decoding`).

    Raises:
        UnsupportedModelError: the model's grouped GEMM would sync the host and HF's
            generate does not decode it with ``batched_mm`` (the fixes named); or the
            switch leaves experts that still sync (naming them).
    """
    probe = probe or GroupedMMProbe()
    name = type(model).__name__
    found = find_host_grouped_mm([("", model)], probe)
    choice = choose_decode_experts(
        syncs=bool(found), hf_switches=hf_decodes_with_batched_mm(model), capturing=capturing
    )
    if choice == "as_loaded":
        return DecodeExperts()
    where = f"GraphedGenerator({name})"
    if choice == "refuse":
        raise grouped_mm_refusal(
            found,
            where,
            probe,
            ". The generator switches to batched_mm itself only where HF's generate "
            "decodes with it (transformers 5.17 does, off the CPU): elsewhere its tokens "
            "would not be HF's",
        )
    switched = DecodeExperts(model, decode_implementations(model.get_experts_implementation()))
    with switched.decoding():
        left = find_host_grouped_mm([("", model)], probe)
    if left:
        raise grouped_mm_refusal(
            left,
            where,
            probe,
            ". model.set_experts_implementation() left these experts on grouped_mm",
        )
    logger.info(
        "%s: its grouped_mm experts (%s) would sync the host in a capture: decode steps "
        "run batched_mm, as HF's generate decodes this model; the prefill keeps grouped_mm",
        where,
        ", ".join(f.path for f in found[:4]) + (" ..." if len(found) > 4 else ""),
    )
    return switched
