"""The checks of the graphed generator on the model: which HF models' decode step
cannot be one static graph (the fix for each), read before anything is allocated; and
whether the model's tensors are still those its graphs read.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from torch import nn

from ...errors import CudaGraphsStateError, UnsupportedModelError
from ...moe_kernels import STATIC_EXPERTS

__all__ = ["WeightAddresses", "check_supported"]


def check_supported(model: nn.Module) -> None:
    """Refuse models whose decode step cannot be one static graph (the fix named).

    Raises:
        UnsupportedModelError: encoder-decoder, stateful (recurrent state outside the
            KV cache), not marked graph-safe by HF (``_can_compile_fullgraph``), or MoE
            experts whose implementation has host-side shapes.
    """
    config, name = model.config, type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; the graphed generator serves decoder-only "
            "causal LMs"
        )
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} keeps recurrent state outside a KV cache; it has no static cache to "
            "decode from. Use model.generate"
        )
    if not getattr(model, "_can_compile_fullgraph", False):
        raise UnsupportedModelError(
            f"{name} does not support a static cache (transformers marks it "
            "_can_compile_fullgraph=False: its forward is not graph-safe). Use "
            "model.generate"
        )
    has_experts = any(hasattr(module, "experts") for module in model.modules())
    implementation = getattr(config, "_experts_implementation", None)
    if has_experts and isinstance(implementation, str) and implementation not in STATIC_EXPERTS:
        raise UnsupportedModelError(
            f"{name}'s MoE experts use the {implementation!r} implementation, which loops "
            "over the experts hit with host-side shapes and cannot be captured. Fix: "
            "model.set_experts_implementation('grouped_mm') (or build the model with "
            "experts_implementation='grouped_mm')"
        )


@dataclass(frozen=True)
class WeightAddresses:
    """Where each parameter and buffer of the model lived when the graphs were captured.

    The graphs read the model's tensors at those addresses; a tensor replaced since
    (``model.to()``, ``load_state_dict(assign=True)``, a new tensor assigned to a
    module) leaves them reading the old memory, which is silently wrong, so each
    request compares (a walk over the model's tensors, a pointer each: a fraction of a
    millisecond for a 16-layer model, against a request's tens of milliseconds).
    """

    names: tuple[str, ...]
    pointers: tuple[int, ...]

    @classmethod
    def of(cls, model: nn.Module) -> WeightAddresses:
        named = list(chain(model.named_parameters(), model.named_buffers()))
        return cls(tuple(n for n, _ in named), tuple(t.data_ptr() for _, t in named))

    def check(self, model: nn.Module) -> None:
        """Raises:
        CudaGraphsStateError: a parameter or buffer replaced, added or removed since
            these addresses were taken (naming up to three).
        """
        now = WeightAddresses.of(model)
        if now.pointers == self.pointers and now.names == self.names:
            return
        before = dict(zip(self.names, self.pointers))
        after = dict(zip(now.names, now.pointers))
        changed = [n for n in after if before.get(n) != after[n]]
        changed += [n for n in before if n not in after]
        shown = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise CudaGraphsStateError(
            f"GraphedGenerator.generate(): the model's tensors were replaced since capture() "
            f"({shown}), e.g. by model.to(), load_state_dict(assign=True) or assigning a new "
            "tensor; the graphs would read the old memory. Fix: update weights in place "
            "(load_state_dict() without assign, param.data.copy_()), or close() and "
            "capture() again."
        )
