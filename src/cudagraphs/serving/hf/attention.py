"""Which attention kernels a generator's decode graphs record: the SDPA backends its
capture runs under.

A compiled capture (``compile_options``) runs without cuDNN attention by default. On
the H200 (torch 2.11, the serving benchmark's 16-layer Llama, six buckets, each run in
a fresh process with an empty inductor cache) torch's own choice, cuDNN attention,
costs two compiles: the largest bucket's and a second one for the bucket of one row,
about 30 s each of a 63 to 65 s capture. Without cuDNN one compile serves every
bucket, the one-row bucket's warmup included (0.01 to 0.02 s): 33 to 34 s in all. The
price is per token: 1% to 4% at batch 1, and 3% (probe) to 11% (kernel-busy time in
the serving benchmark) at batch 8, where flash attention is slower than cuDNN's
(``benchmarks/results/probe-serving_compiles_decode-nvidia-h200-1b5fb7f.json``,
``serving_hf-nvidia-h200-08fca16-nocudnn1.json``; docs/serving-hf.md, "With
inductor's kernels", has the table and the probes that found it).

A capture with the model's own kernels keeps torch's choice: it compiles nothing, and
cuDNN attention is the fastest kernel there.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch.nn.attention import SDPBackend, sdpa_kernel

from ...errors import CudaGraphsTypeError, CudaGraphsValueError

__all__ = ["COMPILED_SDPA_BACKENDS", "check_sdpa_backends", "sdpa_scope"]

#: The backends a compiled capture runs under unless told otherwise: every one but
#: cuDNN's, in torch's order of preference.
COMPILED_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def check_sdpa_backends(value: Any, compiled: bool) -> tuple[SDPBackend, ...] | None:
    """The backends a generator's capture runs under: ``value`` checked (a sequence of
    members, or one member; repeats dropped, order kept), or for ``None`` the default
    (:data:`COMPILED_SDPA_BACKENDS` when ``compiled``, else ``None``: torch's own
    choice).

    Raises:
        CudaGraphsTypeError: ``value`` not a sequence of ``torch.nn.attention.SDPBackend``.
        CudaGraphsValueError: an empty sequence, or ``SDPBackend.ERROR``.
    """
    if value is None:
        return COMPILED_SDPA_BACKENDS if compiled else None
    fix = (
        "pass a sequence of torch.nn.attention.SDPBackend members, e.g. "
        "(SDPBackend.FLASH_ATTENTION, SDPBackend.MATH), or None for the default"
    )
    if isinstance(value, SDPBackend):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise CudaGraphsTypeError(
            f"sdpa_backends must be a sequence of SDPBackend, got {type(value).__name__}: {fix}"
        )
    wrong = [
        f"[{i}] {type(b).__name__}" for i, b in enumerate(value) if not isinstance(b, SDPBackend)
    ]
    if wrong:
        raise CudaGraphsTypeError(
            f"sdpa_backends must hold only SDPBackend members; not: {', '.join(wrong)}: {fix}"
        )
    if not value:
        raise CudaGraphsValueError(
            f"sdpa_backends is empty: no attention kernel could run. Fix: {fix}"
        )
    if SDPBackend.ERROR in value:
        raise CudaGraphsValueError(
            f"sdpa_backends holds SDPBackend.ERROR, which is no kernel. Fix: {fix}"
        )
    return tuple(dict.fromkeys(value))


def sdpa_scope(backends: tuple[SDPBackend, ...] | None) -> AbstractContextManager[Any]:
    """``sdpa_kernel(backends)``, or for ``None`` (torch's own choice) no context."""
    return nullcontext() if backends is None else sdpa_kernel(list(backends))
