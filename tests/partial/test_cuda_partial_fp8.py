"""Partial graphs over torchao's float8 training on the GPU (``convert_to_float8_training``,
dynamic tensorwise and rowwise scaling, FP8 tensor cores): a tiny HF Llama converted by
torchao trains bit for bit like the same converted model run eagerly, and its graphs
replay. torchao is an optional extra (``.[torchao]``): skipped without it."""

import copy

import pytest
import torch

from cudagraphs.partial import PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_training import token_batches, train_both

pytestmark = pytest.mark.cuda

float8 = pytest.importorskip("torchao.float8")


@pytest.fixture(autouse=True)
def _fp8_device():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or newer")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_layers_graph_and_train_like_torchaos_eager_float8_model(recipe):
    # Every linear of the tiny Llama has dimensions in multiples of 16 (FP8 GEMMs), and
    # a batch of 2 x 16 tokens gives 32 rows.
    model = tiny("llama").to("cuda", torch.bfloat16)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(model, config=config)
    ref = copy.deepcopy(model)
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batches = token_batches(6, 5)
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
    try:
        train_both(model, ref, mgr, batches, (opt, ref_opt))
        stats = mgr.stats()
        assert stats["captured"] == 2 and stats["fallbacks"] == 0, stats
        assert stats["replayed"] == 4 * 2, stats
    finally:
        mgr.close()
