"""Fixtures shared by the partial-graph tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def process_group(tmp_path):
    """A gloo process group of world size 1 (file rendezvous in ``tmp_path``) for the
    test's duration, for FSDP2 and DTensor models on the CPU."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
