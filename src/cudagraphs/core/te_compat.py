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
* Transformer Engine's replay call. Its graphed callables read the captured keywords
  and ignore the rest, and callers rely on it: Megatron-Core calls a graphed layer with
  every keyword of ``TransformerLayer.forward`` (``context=None``,
  ``packed_seq_params=None``, ...) and ``is_first_microbatch``. :class:`ReplayKeywords`
  drops only what provably changes nothing and refuses the rest.
* torch's positional order. torch's helper takes ``pool`` fifth, where Transformer
  Engine (and we) take ``sample_kwargs``; a pool handle arriving there is named as
  such instead of failing as a malformed dict.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import (
    CudaGraphsTypeError,
    CudaGraphsValueError,
    Mismatch,
    QuantizationNotSupportedError,
)

__all__ = [
    "QUANTIZATION_ARGUMENTS",
    "ReplayKeywords",
    "check_fifth_argument",
    "check_quantization_off",
]

#: Transformer Engine's per-call flag for FP8 weight caching; quantization is refused
#: here, so the flag changes nothing.
FIRST_MICROBATCH = "is_first_microbatch"

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
    if type(value).__name__ in ("MemPool", "GraphMemoryPool", "CudaGraphPool"):
        return True
    # torch.cuda.graph_pool_handle() / MemPool.id: a pair of ints.
    return (
        isinstance(value, Sequence)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


@dataclass(frozen=True)
class ReplayKeywords:
    """Which keywords a replay call may add to the captured ones (Transformer Engine's
    replay reads the captured keys only): a keyword the callable declares with default
    ``None``, passed as ``None``, and ``is_first_microbatch`` as a bool where the
    callable does not take it; both leave the call what it was at capture. Computed
    once per entry, at capture."""

    captured: frozenset[str]
    none_defaults: frozenset[str]  # parameters of the callable whose default is None
    first_microbatch_declared: bool  # the callable itself takes is_first_microbatch

    @classmethod
    def of(cls, fn: Callable[..., Any], captured: Sequence[str]) -> ReplayKeywords:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # no signature (a builtin): nothing may be added
            params = ()
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return cls(
            captured=frozenset(captured),
            none_defaults=frozenset(
                p.name for p in params if p.kind in keyword and p.default is None
            ),
            first_microbatch_declared=any(p.name == FIRST_MICROBATCH for p in params),
        )

    def split(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], list[Mismatch]]:
        """The call's captured keywords, and a :class:`Mismatch` for every added one
        that might change the call (dropped: those that cannot)."""
        kept, problems = {}, []
        for name, value in kwargs.items():
            if name in self.captured:
                kept[name] = value
            elif not self._changes_nothing(name, value):
                got = type(value).__name__
                problems.append(
                    Mismatch(f"kwargs[{name!r}]", "keyword", "not in sample_kwargs", got)
                )
        return kept, problems

    def _changes_nothing(self, name: str, value: Any) -> bool:
        if name == FIRST_MICROBATCH and not self.first_microbatch_declared:
            # Transformer Engine's flag, for a callable that does not take it (eagerly
            # it would be a TypeError; TE's replay ignores it).
            return isinstance(value, bool)
        return value is None and name in self.none_defaults

    def eager(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` for the callable run eagerly: without ``is_first_microbatch``
        where the callable does not take it (it is Transformer Engine's flag)."""
        if FIRST_MICROBATCH in kwargs and not self.first_microbatch_declared:
            return {k: v for k, v in kwargs.items() if k != FIRST_MICROBATCH}
        return kwargs
