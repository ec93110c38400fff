"""The refusal checks of the graphed generator: which HF models' decode step cannot be
one static graph, and the fix for each. Kept apart from the generator itself
because they read only the model and its config, before anything is allocated.
"""

from __future__ import annotations

from torch import nn

from ...errors import UnsupportedModelError

__all__ = ["check_supported"]

# transformers' MoE experts that keep static shapes (the others loop over the experts hit
# with host-side shapes, which a graph cannot hold).
_STATIC_EXPERTS = ("grouped_mm", "batched_mm")


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
    if has_experts and isinstance(implementation, str) and implementation not in _STATIC_EXPERTS:
        raise UnsupportedModelError(
            f"{name}'s MoE experts use the {implementation!r} implementation, which loops "
            "over the experts hit with host-side shapes and cannot be captured. Fix: "
            "model.set_experts_implementation('grouped_mm') (or build the model with "
            "experts_implementation='grouped_mm')"
        )
