"""The Hugging Face generator's shared static cache on the CPU: one storage at the
largest bucket, every bucket's StaticCache bound to its leading rows, shared write
counters, and the layers it refuses."""

import pytest
import torch
from torch import nn

from _hf_models import tiny

transformers = pytest.importorskip("transformers")


from _hf_generate import (  # noqa: E402
    hf_keyword,
)
from cudagraphs.errors import (  # noqa: E402
    CudaGraphsValueError,
    UnsupportedModelError,
)
from cudagraphs.serving.hf import (  # noqa: E402
    LayerShape,
    SharedStaticCache,
)
from cudagraphs.serving.hf.cache import cache_keyword, layer_shapes  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


# ---- cache.py --------------------------------------------------------------------------
class TakesCache(nn.Module):
    def forward(self, input_ids, cache=None, use_cache=True):
        return input_ids


class TakesPastKeyValues(nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=True):
        return input_ids


class TakesBoth(nn.Module):
    def forward(self, input_ids, past_key_values=None, cache=None):
        return input_ids


class TakesNoCache(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids


@pytest.mark.parametrize(
    "module, expected",
    [(TakesCache, "cache"), (TakesPastKeyValues, "past_key_values"), (TakesBoth, "cache")],
)
def test_cache_keyword_follows_the_forward_signature(module, expected):
    assert cache_keyword(module()) == expected


def test_cache_keyword_refuses_a_forward_without_a_cache():
    with pytest.raises(UnsupportedModelError, match="TakesNoCache.forward takes no cache"):
        cache_keyword(TakesNoCache())


def test_cache_keyword_of_the_installed_transformers(model):
    assert cache_keyword(model) == hf_keyword(model)


def test_layer_shapes_read_heads_and_widths(model):
    shapes = layer_shapes(model, cache_keyword(model))
    # tiny llama: 2 layers, 2 KV heads of 64 / 4 = 16
    assert shapes == [LayerShape(2, 16, 16, torch.float32)] * 2


@pytest.fixture
def kv(model):
    return SharedStaticCache(model, layer_shapes(model, cache_keyword(model)), 4, 16, CPU)


def test_shared_cache_nbytes(kv):
    assert kv.nbytes == 2 * 2 * (4 * 2 * 16 * 16) * 4  # layers x (k, v) x elements x fp32
    assert kv.nbytes == sum(t.numel() * t.element_size() for t in kv.keys + kv.values)


def test_cache_for_the_same_rows_is_the_same_object(kv):
    assert kv.cache_for(2) is kv.cache_for(2)
    assert kv.cache_for(2) is not kv.cache_for(4)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_cache_for_rows_binds_the_leading_rows_of_the_storage(kv, rows):
    cache = kv.cache_for(rows)
    assert len(cache.layers) == 2
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape == (rows, 2, 16, 16)
        assert layer.keys.data_ptr() == kv.keys[i][:rows].data_ptr()
        assert layer.values.data_ptr() == kv.values[i][:rows].data_ptr()
        assert layer.cumulative_length is kv.counters[i]


def test_caches_of_all_row_counts_share_the_write_counters(model, kv):
    small, large = kv.cache_for(2), kv.cache_for(4)
    with torch.no_grad():
        model(
            input_ids=torch.randint(3, 128, (2, 3)),
            use_cache=True,
            **{cache_keyword(model): small},
        )
    assert [int(c) for c in kv.counters] == [3, 3]
    for i, layer in enumerate(large.layers):
        assert int(layer.cumulative_length) == 3
        # the prefill wrote rows 0-1, positions 0-2 of the shared storage only
        assert bool(kv.keys[i][:2, :, :3].ne(0).any())
        assert not bool(kv.keys[i][2:].ne(0).any())
        assert not bool(kv.keys[i][:, :, 3:].ne(0).any())
    kv.reset()
    assert [int(c) for c in kv.counters] == [0, 0]
    assert all(int(layer.cumulative_length) == 0 for layer in small.layers)


@pytest.mark.parametrize("rows", [0, 5, -1])
def test_cache_for_rows_outside_the_storage_is_refused(kv, rows):
    with pytest.raises(CudaGraphsValueError, match=f"a cache of {rows} rows"):
        kv.cache_for(rows)


def test_shared_cache_needs_a_layer(model):
    with pytest.raises(CudaGraphsValueError, match="at least one layer"):
        SharedStaticCache(model, [], 4, 16, CPU)
