"""What a bug report needs to say about the machine: ``python -m cudagraphs env``.

Everything is looked up without capturing anything, and every lookup that can fail
(no CUDA device, no driver, a package not installed) is reported as such instead of
raising, so the command works on any machine.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any

import torch

from . import __version__
from .errors import CudaCallError, CudaGraphsValueError
from .settings import (
    BINDING_ENV,
    DISABLE_ENV,
    EXPANDABLE_POOLS_ENV,
    STRICT_BUCKETS_ENV,
    env_choice,
    env_flag,
)

__all__ = ["collect", "format_report"]


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _binding() -> Any:
    from .cuda_binding import cuda_binding

    try:
        return cuda_binding()
    except CudaGraphsValueError:  # a malformed CUDAGRAPHS_CUDA_BINDING, reported below
        return cuda_binding("auto")


def _binding_choice() -> str:
    from .cuda_binding import BINDINGS

    try:
        return env_choice(BINDING_ENV, ("auto", *BINDINGS), "auto")
    except CudaGraphsValueError as exc:
        return f"invalid ({exc})"


def _driver_version() -> str:
    backend = _binding()
    if backend is None:
        return "no NVIDIA driver found"
    try:
        version = backend.driver_version()  # e.g. 13000 for CUDA 13.0
    except CudaCallError as exc:
        return f"unknown ({exc})"
    return f"CUDA {version // 1000}.{version % 1000 // 10} (through {backend.name})"


def _flag(name: str, default: bool = False) -> str:
    try:
        return str(env_flag(name, default))
    except CudaGraphsValueError as exc:  # report a malformed value, do not fail on it
        return f"invalid ({exc})"


def _cuda_fields() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda_device": "none (torch.cuda.is_available() is False)"}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    binding = _binding()
    staging_ok = binding is not None and binding.has_runtime
    return {
        "cuda_device": f"{props.name} (cuda:{index} of {torch.cuda.device_count()})",
        "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "cuda_driver": _driver_version(),
        "cuda_binding": binding.describe() if binding is not None else "none found",
        # What staging="auto" resolves to for a program of one input tensor.
        "program_staging_auto": "graph" if staging_ok else "copy",
    }


def collect() -> dict[str, Any]:
    """The report as a dict of strings and numbers."""
    return {
        "cudagraphs": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        **_cuda_fields(),
        "cuda-bindings": _package_version("cuda-bindings"),
        "transformers": _package_version("transformers"),
        "accelerate": _package_version("accelerate"),
        DISABLE_ENV: _flag(DISABLE_ENV),
        STRICT_BUCKETS_ENV: _flag(STRICT_BUCKETS_ENV),
        EXPANDABLE_POOLS_ENV: _flag(EXPANDABLE_POOLS_ENV, default=True),
        BINDING_ENV: _binding_choice(),
    }


def format_report(report: dict[str, Any]) -> str:
    width = max(len(k) for k in report)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in report.items())
