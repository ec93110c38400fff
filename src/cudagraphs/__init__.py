"""cudagraphs: CUDA Graphs made practical in PyTorch.

* :mod:`cudagraphs.capture`: capture primitives (one way to capture, one way to
  recover from a failed capture).
* :func:`make_graphed_callables`: Transformer Engine-compatible graph helper with
  ``capture_time_hooks`` and pipeline (``_order``) schedules, and in-graph gradient
  accumulation; :func:`graph_stack` graphs a whole layer stack as one unit.
* :mod:`cudagraphs.introspect`: node counts and executable memory of graphs.
"""

from .capture import GraphPool, capture_into_graph, capture_with_static_outputs, new_pool
from .core import GraphedCallable, GraphedStack, graph_stack, make_graphed_callables
from .errors import (
    CaptureTimeHookError,
    CudaCallError,
    CudaGraphCaptureError,
    CudaGraphInputError,
    CudaGraphOutputError,
    CudaGraphsError,
    CudaGraphsKeyError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    GraphReleasedError,
    Mismatch,
    NoCudaDeviceError,
    ProgramClosedError,
    SignatureMismatchError,
    TargetSelectionError,
)
from .program import (
    CopyHandle,
    CudaGraphCaptureStats,
    CudaGraphPool,
    CudaGraphProgram,
    LeafTypes,
    ReusableValueBuffer,
    TensorSignature,
    ValueTreeSignature,
)

__version__ = "0.1.0"

__all__ = [
    "CopyHandle",
    "CudaGraphCaptureStats",
    "CudaGraphPool",
    "CudaGraphProgram",
    "LeafTypes",
    "ProgramClosedError",
    "ReusableValueBuffer",
    "TensorSignature",
    "ValueTreeSignature",
    "CaptureTimeHookError",
    "CudaCallError",
    "CudaGraphCaptureError",
    "CudaGraphInputError",
    "CudaGraphOutputError",
    "CudaGraphsError",
    "CudaGraphsKeyError",
    "CudaGraphsStateError",
    "CudaGraphsTypeError",
    "CudaGraphsValueError",
    "GraphPool",
    "GraphReleasedError",
    "Mismatch",
    "NoCudaDeviceError",
    "SignatureMismatchError",
    "TargetSelectionError",
    "GraphedCallable",
    "GraphedStack",
    "capture_into_graph",
    "capture_with_static_outputs",
    "graph_stack",
    "make_graphed_callables",
    "new_pool",
]
