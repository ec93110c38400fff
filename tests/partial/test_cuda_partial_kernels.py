"""The grouped-GEMM probe on a GPU: its answer for each dtype agrees with whether a
capture of that grouped GEMM succeeds, and it leaves the sync debug mode as found."""

import pytest
import torch

from cudagraphs.capture import capture_into_graph
from cudagraphs.errors import CudaGraphCaptureError
from cudagraphs.moe_kernels import GroupedMMProbe

pytestmark = pytest.mark.cuda


def captures(dtype):
    a = torch.randn(32, 16, device="cuda", dtype=dtype)
    b = torch.randn(2, 32, 16, device="cuda", dtype=dtype)  # (experts, out, in)
    offs = torch.tensor([16, 32], device="cuda", dtype=torch.int32)
    run = lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)  # noqa: E731
    run()  # warm up: library handles and workspaces exist before the capture
    try:
        capture_into_graph(run, what="grouped GEMM")
    except CudaGraphCaptureError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_probe_says_what_a_capture_finds(dtype):
    probe = GroupedMMProbe()
    said = probe.on_device(torch.zeros(1, device="cuda", dtype=dtype))
    assert said == captures(dtype), f"{dtype}: probe said {said}"


def test_bfloat16_runs_on_the_device_on_hopper():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch's bfloat16 grouped GEMM kernel is built for SM 9.x / 10.x")
    assert GroupedMMProbe().on_device(torch.zeros(1, device="cuda", dtype=torch.bfloat16))


def test_the_sync_debug_mode_is_left_as_found():
    prior = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        GroupedMMProbe().on_device(torch.zeros(1, device="cuda", dtype=torch.float32))
        assert torch.cuda.get_sync_debug_mode() == 1
    finally:
        torch.cuda.set_sync_debug_mode(prior)
