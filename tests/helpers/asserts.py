"""Assertions and cleanup shared by the GPU test files (import-safe without a GPU)."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def assert_bitwise_equal(actual, expected, what):
    """Graphed results run the same kernels as eager, so they must match bit for bit."""
    assert actual is not None and expected is not None, (
        f"{what}: graphed {'None' if actual is None else 'set'}, "
        f"eager {'None' if expected is None else 'set'}"
    )
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs()
        raise AssertionError(
            f"{what}: not bitwise equal to eager; max abs difference {diff.max().item():.3e} "
            f"at flat index {diff.argmax().item()} ({(diff > 0).sum().item()} of "
            f"{diff.numel()} elements differ)"
        )


def contain_failed_capture(pool):
    """Test-side cleanup after a deliberately failed capture, so that a library bug
    found by one test does not cascade into later ones. It runs in ``finally``, after
    the test has checked the state the library left behind: it stops any leftover
    allocator routing into ``pool`` and takes the CUDA generator out of capture mode
    (a successful capture does that)."""
    end_routing = getattr(torch._C, "_cuda_endAllocateToPool", None)
    handle = getattr(pool, "handle", pool)
    if end_routing is not None and handle is not None:
        with contextlib.suppress(Exception):
            end_routing(torch.cuda.current_device(), handle)
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph):
        x.add_(1)


class CopyOps(TorchDispatchMode):
    """Records the copy ops that reach the dispatcher (a fused copy is one op)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "copy" in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))
