"""Which dtype conversions lose nothing: the rule for accepting an input whose dtype
differs from the captured one.

A graph reads fixed buffers of the captured dtype; a call's tensor is copied into them,
and ``copy_`` converts. torch's ``make_graphed_callables`` converts whatever it gets,
so a float32 value copied into a bfloat16 buffer is silently rounded. We convert only
when every value of the source dtype is exactly representable in the buffer's (a
bfloat16 or float16 activation into a float32 input, as under autocast; int32 ids into
int64), and refuse the rest with the dtypes named.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["converts_losslessly", "holds_plain_values"]


@functools.cache
def converts_losslessly(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is exactly representable in ``dst``.

    * same dtype: yes;
    * ``bool`` into any integer or floating dtype: yes (0 and 1);
    * integer into integer: when ``dst``'s range holds ``src``'s;
    * integer into floating: when ``dst``'s significand holds every integer of
      ``src``'s range (int16 into float32: yes; int32 into float32: no);
    * floating into floating: when ``dst`` has at least ``src``'s precision and
      exponent range (float16 or bfloat16 into float32: yes; float16 into bfloat16
      and back: no);
    * complex, quantized and float8 types, and every other pair: no.
    """
    if src == dst:
        return True
    if dst.is_complex or src.is_complex or _is_exotic(src) or _is_exotic(dst):
        return False
    if src == torch.bool:
        return dst != torch.bool
    if dst == torch.bool:
        return False
    if not src.is_floating_point:
        lo, hi = torch.iinfo(src).min, torch.iinfo(src).max
        if not dst.is_floating_point:
            d = torch.iinfo(dst)
            return d.min <= lo and hi <= d.max
        # Every integer up to 2**(mantissa bits + 1) is exact in a float.
        digits = _significand_bits(dst)
        return max(abs(lo), hi) <= 2**digits
    if not dst.is_floating_point:
        return False
    s, d = torch.finfo(src), torch.finfo(dst)
    return d.eps <= s.eps and d.max >= s.max and d.smallest_normal <= s.smallest_normal


def _significand_bits(dtype: torch.dtype) -> int:
    # eps = 2**-(significand bits - 1), counting the implicit leading bit; a power of
    # two, so its log2 is exact.
    return 1 - int(math.log2(torch.finfo(dtype).eps))


def _is_exotic(dtype: torch.dtype) -> bool:
    if dtype.is_floating_point:
        return torch.finfo(dtype).bits < 16  # float8 formats: saturating casts
    return dtype in _QUANTIZED


# Quantized dtypes carry a scale outside the tensor's values: never a plain cast.
_QUANTIZED = frozenset(
    getattr(torch, name)
    for name in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


@functools.cache
def holds_plain_values(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` hold plain values that torch can fill and copy:
    floating (float8 included), complex, bool and the integer types. Quantized types
    (their values carry a scale) and sub-byte and ``bits`` types (packed, no fill or
    arithmetic) do not."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return True
    if dtype in _QUANTIZED:
        return False
    try:
        torch.iinfo(dtype)
    except TypeError:  # sub-byte and bits types have no integer range
        return False
    return True
