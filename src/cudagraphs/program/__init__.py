"""Graph programs: a fixed function captured once and replayed on reusable,
fixed-address inputs (:class:`CudaGraphProgram`), and pools of programs that share
scratch memory (:class:`CudaGraphPool`).

Threading contract: one host thread drives a program (and a pool) at a time; give
concurrent workers their own programs.
"""

from .buffer import ReusableValueBuffer
from .leaves import LeafType, LeafTypes
from .program import (
    CopyHandle,
    CudaGraphCaptureStats,
    CudaGraphPool,
    CudaGraphProgram,
    ProgramClosedError,
)
from .signature import (
    Mismatch,
    SignatureMismatchError,
    TensorSignature,
    ValueSignature,
    ValueTreeSignature,
)

__all__ = [
    "CopyHandle",
    "CudaGraphCaptureStats",
    "CudaGraphPool",
    "CudaGraphProgram",
    "ProgramClosedError",
    "LeafType",
    "LeafTypes",
    "Mismatch",
    "ReusableValueBuffer",
    "SignatureMismatchError",
    "TensorSignature",
    "ValueSignature",
    "ValueTreeSignature",
]
