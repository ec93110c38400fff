"""Drop-in at Transformer Engine and torch call sites: the arguments their users pass
to ``make_graphed_callables`` that this helper has no use for, checked here.

* Transformer Engine's quantization arguments. Megatron-Core and TE users pass them
  even with quantization off (``fp8_enabled=False`` beside a recipe and an amax
  group), in TE 2.x names (``enabled, calibrating, recipe, amax_reduction_group,
  cache_quantized_params``) or the 1.x names they replaced (``fp8_enabled,
  fp8_calibrating, fp8_recipe, fp8_group, fp8_weight_caching``), positionally in the
  five slots after ``sample_kwargs`` or by keyword. Off, they change nothing; on
  (quantized execution or calibration asked for), graphing needs Transformer
  Engine's own helper, which knows its FP8 metadata, amax reductions and weight
  caches.
* torch's positional order. torch's helper takes ``pool`` fifth, where Transformer
  Engine (and we) take ``sample_kwargs``; a pool handle arriving there is named as
  such instead of failing as a malformed dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import CudaGraphsTypeError, CudaGraphsValueError, QuantizationNotSupportedError

__all__ = ["QUANTIZATION_ARGUMENTS", "check_fifth_argument", "check_quantization_off"]

#: (TE 2.x name, TE 1.x name), in the positional order both versions use.
QUANTIZATION_ARGUMENTS = (
    ("enabled", "fp8_enabled"),
    ("calibrating", "fp8_calibrating"),
    ("recipe", "fp8_recipe"),
    ("amax_reduction_group", "fp8_group"),
    ("cache_quantized_params", "fp8_weight_caching"),
)


def _is_on(value: Any) -> bool:
    # TE takes one flag or one per module (a tuple); any True turns quantization on.
    if isinstance(value, (tuple, list)):
        return any(bool(v) for v in value)
    return bool(value)


def check_quantization_off(current: Mapping[str, Any], legacy: Mapping[str, Any]) -> None:
    """Accept Transformer Engine's quantization arguments while they leave quantization
    off; refuse them when they turn it on.

    Args:
        current: the TE 2.x names and their values (``None``: not given).
        legacy: the TE 1.x names and their values (``None``: not given).

    Raises:
        CudaGraphsValueError: both names of one argument given, with different values.
        QuantizationNotSupportedError: ``enabled`` / ``fp8_enabled`` true (for any
            module) or ``calibrating`` / ``fp8_calibrating`` true.
    """
    merged = {}
    for new, old in QUANTIZATION_ARGUMENTS:
        a, b = current.get(new), legacy.get(old)
        if a is not None and b is not None and a is not b and a != b:
            raise CudaGraphsValueError(
                f"{new}={a!r} and its Transformer Engine 1.x name {old}={b!r} disagree; pass "
                f"one of them"
            )
        merged[new] = (a, new) if a is not None else (b, old)
    for key in ("enabled", "calibrating"):
        value, given_as = merged[key]
        if _is_on(value):
            raise QuantizationNotSupportedError(
                f"make_graphed_callables({given_as}={value!r}): FP8/FP4 graphing is not "
                "supported here. Fixes: 1. graph quantized layers with "
                "transformer_engine.pytorch.make_graphed_callables, which manages their FP8 "
                f"metadata and amax reductions; 2. pass {given_as}=False (the recipe, group "
                "and caching arguments may stay) to graph them unquantized."
            )


def check_fifth_argument(sample_kwargs: Any) -> None:
    """Refuse a graph pool handle where ``sample_kwargs`` belongs, saying why.

    Raises:
        CudaGraphsTypeError: ``sample_kwargs`` is a pool (torch's positional order).
    """
    if _looks_like_pool(sample_kwargs):
        raise CudaGraphsTypeError(
            "the fifth positional argument of make_graphed_callables is sample_kwargs "
            "(Transformer Engine's order, which this helper keeps), and a graph pool handle "
            f"was passed there ({sample_kwargs!r}): torch.cuda.make_graphed_callables takes "
            "pool fifth. Pass it by keyword: make_graphed_callables(..., pool=pool)."
        )


def _looks_like_pool(value: Any) -> bool:
    if value is None or isinstance(value, (Mapping, str, bytes)):
        return False
    if type(value).__name__ in ("MemPool", "GraphPool", "CudaGraphPool"):
        return True
    # torch.cuda.graph_pool_handle() / MemPool.id: a pair of ints.
    return (
        isinstance(value, Sequence)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
