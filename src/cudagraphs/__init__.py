"""cudagraphs: CUDA Graphs made practical in PyTorch.

* :mod:`cudagraphs.capture`: capture primitives (one way to capture into a pool, one
  way to recover from a failed capture); :mod:`cudagraphs.introspect`: node counts and
  executable memory of graphs.
* :func:`make_graphed_callables`: Transformer Engine-compatible graph helper with
  ``capture_time_hooks``, pipeline (``_order``) schedules and in-graph gradient
  accumulation; :func:`graph_stack` graphs a whole layer stack as one unit.
* :mod:`cudagraphs.program`: :class:`CudaGraphProgram` / :class:`CudaGraphPool`, a
  fixed function replayed on validated, fixed-address inputs.
* :mod:`cudagraphs.partial`: graphs of the static pieces of each decoder layer
  (attention, MoE router, MLP, whole MoE block or whole layer) inside eager training;
  :mod:`cudagraphs.integrations.hf` runs them from a ``transformers.Trainer`` callback.
* :func:`graph_train_step` (:mod:`cudagraphs.train`): forward, backward, gradient
  all-reduce, clipping and the optimizer step of a static-shape training step as one
  graph.
* :func:`compile_stacked` (:mod:`cudagraphs.stacking`): ``torch.compile`` with each
  projection group (q/k/v, gate/up) one GEMM, forward and backward.
* :mod:`cudagraphs.serving`: the bucketed :class:`~cudagraphs.serving.GraphRunner`.
* :mod:`cudagraphs.errors`: every error the package raises (all derive from
  :class:`CudaGraphsError`); :mod:`cudagraphs.settings`: ``CUDAGRAPHS_DISABLE`` and the
  other environment switches.
"""

from .capture import (
    GraphMemoryPool,
    GraphPool,
    capture_into_graph,
    capture_with_static_outputs,
    new_pool,
)
from .capture_state import is_graph_capturing
from .core import GraphedCallable, GraphedStack, graph_stack, make_graphed_callables
from .errors import (
    CaptureTimeHookError,
    ChainedInputError,
    CompiledCaptureError,
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
    KeptGradientViewError,
    KeptOutputViewError,
    Mismatch,
    MissingDependencyError,
    NoCudaDeviceError,
    ProgramClosedError,
    QuantizationNotSupportedError,
    SignatureMismatchError,
    TargetSelectionError,
    UncapturedGradientError,
    UnsupportedModelError,
    UnsupportedTorchError,
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
from .stacking import StackedCompiled, compile_stacked
from .train import GraphedTrainStep, all_reduce_gradients, graph_train_step, prepare_optimizer

__version__ = "0.1.0"

__all__ = [
    "StackedCompiled",
    "compile_stacked",
    "GraphedTrainStep",
    "all_reduce_gradients",
    "graph_train_step",
    "prepare_optimizer",
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
    "ChainedInputError",
    "CudaCallError",
    "CompiledCaptureError",
    "CudaGraphCaptureError",
    "CudaGraphInputError",
    "CudaGraphOutputError",
    "CudaGraphsError",
    "CudaGraphsKeyError",
    "CudaGraphsStateError",
    "CudaGraphsTypeError",
    "CudaGraphsValueError",
    "GraphMemoryPool",
    "GraphPool",  # deprecated alias of GraphMemoryPool
    "GraphReleasedError",
    "KeptGradientViewError",
    "KeptOutputViewError",
    "Mismatch",
    "MissingDependencyError",
    "UnsupportedModelError",
    "UnsupportedTorchError",
    "NoCudaDeviceError",
    "QuantizationNotSupportedError",
    "SignatureMismatchError",
    "TargetSelectionError",
    "UncapturedGradientError",
    "GraphedCallable",
    "GraphedStack",
    "capture_into_graph",
    "capture_with_static_outputs",
    "graph_stack",
    "is_graph_capturing",
    "make_graphed_callables",
    "new_pool",
]
