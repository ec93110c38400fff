"""Stand-ins for the drop-in tests of make_graphed_callables: Transformer Engine's
graph module, and a call run up to the device checks."""

import types

import pytest
import torch

from cudagraphs.capture_state import TE_GRAPH_MODULE
from cudagraphs.errors import CudaGraphsValueError, NoCudaDeviceError


def past_the_argument_checks(call):
    """Run a call whose arguments are all acceptable but whose sample tensors are on the
    CPU: it gets as far as the device checks, the last before any GPU work (the GPU
    file graphs such calls)."""
    if torch.cuda.is_available():
        error, message = CudaGraphsValueError, "graph inputs must be CUDA tensors"
    else:
        error, message = NoCudaDeviceError, "needs a CUDA device"
    with pytest.raises(error, match=message):
        call()


class FakeTE(types.ModuleType):
    """A stand-in for transformer_engine.pytorch.graph that records its calls."""

    def __init__(self, capturing=False):
        super().__init__(TE_GRAPH_MODULE)
        self.calls, self.flag = [], capturing

    def set_capture_start(self):
        self.calls.append("start")
        self.flag = True

    def set_capture_end(self):
        self.calls.append("end")
        self.flag = False

    def is_graph_capturing(self):
        return self.flag
