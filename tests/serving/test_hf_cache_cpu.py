"""The Hugging Face generator's shared static cache on the CPU: one storage at the
largest bucket, every bucket's StaticCache bound to its leading rows, shared write
counters, and the layers it refuses."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers.hf_models import CONFIGS, tiny

transformers = pytest.importorskip("transformers")


from cudagraphs.errors import (  # noqa: E402
    CudaGraphsValueError,
    UnsupportedModelError,
)
from cudagraphs.serving.hf import (  # noqa: E402
    LayerShape,
    SharedStaticCache,
)
from cudagraphs.serving.hf.cache import (  # noqa: E402
    cache_keyword,
    layer_shapes,
    static_layer_check,
)
from helpers.hf_generate import (  # noqa: E402
    hf_keyword,
)

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


# The tiny Llama's sizes with an explicit head width, for the other architectures here.
TINY = dict(CONFIGS["llama"], head_dim=16)
# Llama 4's text model with chunked attention (chunks of 4).
LLAMA4_TEXT = dict(TINY, intermediate_size_mlp=128, attention_chunk_size=4, num_local_experts=2)


def _sliding_mistral():
    config = transformers.AutoConfig.for_model("mistral", **CONFIGS["llama"], sliding_window=4)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_a_static_cache_of_sliding_window_layers_counts_its_layers():
    assert static_layer_check(_sliding_mistral(), 16) == 2


def test_sliding_window_layers_are_bound_full_length_to_the_shared_storage():
    from transformers.cache_utils import StaticLayer

    model = _sliding_mistral()
    shapes = [LayerShape(2, 16, 16, torch.float32)] * 2
    kv = SharedStaticCache(model, shapes, 4, 16, CPU)
    cache = kv.cache_for(3)
    assert [type(layer) for layer in cache.layers] == [StaticLayer, StaticLayer]
    assert cache.is_sliding == [False, False]  # so masks are sized by a full-length layer
    for layer, keys, counter in zip(cache.layers, kv.keys, kv.counters):
        assert layer.max_cache_len == 16 and layer.keys.shape == (3, 2, 16, 16)
        assert layer.keys.data_ptr() == keys.data_ptr() and layer.cumulative_length is counter


def test_chunked_attention_layers_are_refused_naming_the_kind():
    config = transformers.AutoConfig.for_model("llama4_text", **LLAMA4_TEXT)
    stand_in = SimpleNamespace(config=config)
    with pytest.raises(UnsupportedModelError) as info:
        static_layer_check(stand_in, 16)
    message = str(info.value)
    assert message.startswith(
        "SimpleNamespace's static cache has layers of kind ['chunked_attention']; the graphed "
        "generator supports full-attention and sliding-window layers only"
    )
    assert "Use model.generate for this model" in message


def test_linear_attention_layers_are_refused_naming_class_and_type():
    config = transformers.AutoConfig.for_model(
        "qwen3_next",
        **TINY,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"],
    )
    with pytest.raises(UnsupportedModelError) as info:
        static_layer_check(SimpleNamespace(config=config), 16)
    # Both what the cache holds (its class) and what the config says (its type).
    assert "layers of kind ['LinearAttentionLayer', 'linear_attention']; the" in str(info.value)


def test_a_composite_config_is_read_through_its_text_config():
    # A multimodal config keeps the decoder's layer types in its text config only.
    config = transformers.Llama4Config(
        text_config=LLAMA4_TEXT,
        vision_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        ),
    )
    assert getattr(config, "layer_types", None) is None
    with pytest.raises(UnsupportedModelError, match=r"of kind \['chunked_attention'\]"):
        static_layer_check(SimpleNamespace(config=config), 16)


def test_a_full_attention_static_cache_counts_its_layers(model):
    assert static_layer_check(model, 16) == 2


def test_bound_layers_carry_what_hfs_own_lazy_initialization_sets(model):
    # Heads, key and value widths all different, in bf16: a mix-up of any two shows.
    from transformers.cache_utils import StaticLayer

    shapes = [LayerShape(3, 4, 5, torch.bfloat16)] * 2
    kv = SharedStaticCache(model, shapes, 4, 8, CPU)
    ref = StaticLayer(max_cache_len=8)
    ref.lazy_initialization(
        torch.zeros(2, 3, 1, 4, dtype=torch.bfloat16), torch.zeros(2, 3, 1, 5, dtype=torch.bfloat16)
    )
    for layer in kv.cache_for(2).layers:
        for name, want in vars(ref).items():
            if isinstance(want, torch.Tensor):
                got = getattr(layer, name)
                assert (got.shape, got.dtype) == (want.shape, want.dtype), name
            else:
                assert getattr(layer, name) == want, name
        assert layer.dtype == torch.bfloat16


def test_storage_takes_each_layers_dtype_and_the_given_device():
    model = SimpleNamespace(config=None)
    shapes = [LayerShape(2, 16, 8, torch.bfloat16), LayerShape(1, 4, 4, torch.float16)]
    kv = SharedStaticCache(model, shapes, 3, 10, torch.device("meta"))
    assert [(k.shape, k.dtype, k.device.type) for k in kv.keys] == [
        ((3, 2, 10, 16), torch.bfloat16, "meta"),
        ((3, 1, 10, 4), torch.float16, "meta"),
    ]
    assert [(v.shape, v.dtype, v.device.type) for v in kv.values] == [
        ((3, 2, 10, 8), torch.bfloat16, "meta"),
        ((3, 1, 10, 4), torch.float16, "meta"),
    ]
    assert [(c.shape, c.dtype, c.device.type) for c in kv.counters] == [
        ((), torch.long, "meta"),
        ((), torch.long, "meta"),
    ]


def test_layer_shapes_step_on_the_models_own_device():
    meta = tiny("llama").eval().to("meta")  # a CPU input would not mix with meta weights
    assert layer_shapes(meta, cache_keyword(meta)) == [LayerShape(2, 16, 16, torch.float32)] * 2


def test_a_cache_layout_other_than_one_layer_per_attention_layer_is_refused(model):
    kv = SharedStaticCache(model, [LayerShape(2, 16, 16, torch.float32)] * 3, 4, 16, CPU)
    with pytest.raises(
        UnsupportedModelError,
        match="StaticCache has 2 layers but one step filled 3; its cache layout is not one "
        "layer per attention layer",
    ):
        kv.cache_for(2)


class OneStepRecorder(nn.Module):
    """Records the step layer_shapes makes and fills one cache layer (keys 8 wide,
    values 4), with its weights on the meta device."""

    def __init__(self):
        super().__init__()
        self.config = transformers.AutoConfig.for_model(
            "llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
        self.weight = nn.Parameter(torch.zeros(1, device="meta"))
        self.seen = []

    def forward(self, input_ids, use_cache=False, cache=None):
        self.seen.append((tuple(input_ids.shape), input_ids.dtype, input_ids.device, use_cache))
        keys = torch.zeros(input_ids.shape[0], 2, input_ids.shape[1], 8, device=input_ids.device)
        cache.update(keys, keys[..., :4], 0)
        return None


def test_layer_shapes_step_one_token_with_the_cache_on_the_models_device():
    model = OneStepRecorder()
    assert layer_shapes(model, "cache") == [LayerShape(2, 8, 4, torch.float32)]
    assert model.seen == [((1, 1), torch.long, torch.device("meta"), True)]


def _marked(t):
    # dynamo keeps a tensor's dimensions marked dynamic on the tensor itself.
    return set(getattr(t, "_dynamo_dynamic_indices", set()))


def test_views_of_two_rows_or_more_are_marked_dynamic_only_when_asked(model):
    shapes = layer_shapes(model, cache_keyword(model))
    plain = SharedStaticCache(model, shapes, 4, 16, CPU)
    for rows in (1, 2, 4):
        for layer in plain.cache_for(rows).layers:
            assert _marked(layer.keys) == _marked(layer.values) == set(), rows
    dynamic = SharedStaticCache(model, shapes, 4, 16, CPU, dynamic_rows=True)
    assert dynamic.dynamic_rows and not plain.dynamic_rows
    for rows, want in ((1, set()), (2, {0}), (3, {0}), (4, {0})):
        for layer in dynamic.cache_for(rows).layers:
            assert _marked(layer.keys) == _marked(layer.values) == want, rows
    # The storage itself is never marked: only the views the compiled step reads.
    assert all(_marked(t) == set() for t in dynamic.keys + dynamic.values)
