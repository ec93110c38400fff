"""torch.compile inside bucket graphs: which compile options may go in.

Inductor's fused kernels capture like any others, so a compiled forward can be recorded
in a bucket's graph. What cannot go in is inductor's own graph recording: the
``reduce-overhead`` and ``max-autotune`` modes (and ``options={"triton.cudagraphs":
True}``) wrap the compiled code in CUDA-graph trees, which record their own graphs on
their own pool at the first calls: inside our capture that is a capture within a
capture, and beside it a second copy of every graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checks import check_instance
from ..errors import CudaGraphsValueError

__all__ = ["GRAPH_RECORDING_MODES", "check_compile_options"]

#: torch.compile modes that turn on inductor's CUDA-graph trees.
GRAPH_RECORDING_MODES = ("reduce-overhead", "max-autotune")


def check_compile_options(where: str, options: Any) -> dict[str, Any] | None:
    """A copy of ``options`` (``None`` stays ``None``) after checking it can be captured.

    Raises:
        CudaGraphsTypeError: ``options`` not a mapping.
        CudaGraphsValueError: a mode or option that makes inductor record CUDA graphs
            of its own.
    """
    check_instance("compile_options", options, (Mapping, type(None)), "a mapping of keywords")
    if options is None:
        return None
    mode = options.get("mode")
    inner = options.get("options")
    trees = isinstance(inner, Mapping) and bool(inner.get("triton.cudagraphs"))
    if mode in GRAPH_RECORDING_MODES or trees:
        said = f"mode={mode!r}" if mode in GRAPH_RECORDING_MODES else "triton.cudagraphs=True"
        raise CudaGraphsValueError(
            f"{where}: compile_options with {said} make inductor record CUDA graphs of its "
            "own (CUDA-graph trees); the bucket graphs already record the compiled "
            "kernels, and a recording inside their capture fails. Fixes: 1. leave 'mode' "
            "out (inductor's default kernels); 2. mode='max-autotune-no-cudagraphs' for "
            "autotuned kernels without graphs of their own."
        )
    return dict(options)
