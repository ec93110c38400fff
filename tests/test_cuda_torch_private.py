"""The seam of private torch API on a CUDA build: every name that only CUDA builds
have resolves."""

import pytest
import torch

from cudagraphs.torch_private import REQUIRED_WITH_CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU-only torch build")
@pytest.mark.parametrize("name", REQUIRED_WITH_CUDA, ids=lambda n: n.name)
def test_every_cuda_name_resolves_on_this_cuda_build(name):
    assert name.lookup() is not None
