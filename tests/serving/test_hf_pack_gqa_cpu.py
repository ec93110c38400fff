"""Packed grouped-query attention at decode (``GraphedGenerator(pack_gqa=...)``): the
packed SDPA against HF's repeated-heads SDPA, which calls are packed, transformers'
``"sdpa"`` replaced only while installed, and generators that pack serving HF's
greedy tokens with and without inductor."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.errors import CudaGraphsTypeError
from cudagraphs.serving.hf import GraphedGenerator, gqa
from helpers.hf_generate import L, assert_serves_hf_tokens, captured
from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402


class _Attention:
    """What HF's attention functions read of the module."""

    is_causal = True

    def __init__(self, groups):
        self.num_key_value_groups = groups


def _repeated(query, key, value, mask, scaling):
    """The reference: every key/value head repeated for its group (``repeat_kv``), then
    SDPA over as many heads as the query has, as HF's compiled attention runs it."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


@settings(max_examples=80, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.integers(2, 4),
    length=st.integers(1, 20),
    dim=st.sampled_from([4, 8]),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    scaling=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_packed_attention_equals_the_repeated_heads(
    batch, kv_heads, group, length, dim, mask_kind, scaling, seed
):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=gen, dtype=torch.float64)
    key, value = (
        torch.randn(batch, kv_heads, length, dim, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(batch, 1, 1, length, generator=gen) > 0.4
        mask[..., 0] = True  # every row attends somewhere
    elif mask_kind == "float":
        mask = torch.randn(batch, 1, 1, length, generator=gen, dtype=torch.float64)
    got = gqa.packed_attention(query, key, value, mask, scaling)
    assert got.shape == (batch, 1, kv_heads * group, dim) and got.is_contiguous()
    want = _repeated(query, key, value, mask, scaling)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _tensors(heads=4, kv_heads=2, q_len=1, mask_heads=1):
    query = torch.randn(2, heads, q_len, 8)
    key = torch.randn(2, kv_heads, 6, 8)
    mask = torch.ones(2, mask_heads, q_len, 6, dtype=torch.bool)
    return query, key, mask


@pytest.mark.parametrize(
    ("case", "packed"),
    [
        ({}, True),
        ({"mask": None}, True),
        ({"q_len": 3}, False),  # a prefill: HF's own
        ({"kv_heads": 4}, False),  # no groups
        ({"heads": 10, "kv_heads": 4, "groups": 2}, False),  # heads no multiple of kv heads
        ({"heads": 8, "kv_heads": 2}, True),  # groups of four
        ({"groups": 1}, False),  # the module says none
        ({"kwargs": {"softcap": 30.0}}, False),  # something SDPA's attention refuses
        ({"kwargs": {"s_aux": torch.zeros(4)}}, False),  # attention sinks
        # Passed as None, they ask nothing: SDPA's attention reads them as absent.
        ({"kwargs": {"softcap": None, "position_bias": None, "s_aux": None}}, True),
        ({"kwargs": {"head_mask": torch.ones(4)}}, False),
        ({"kwargs": {"dropout": 0.1}}, False),
        ({"kwargs": {"output_attentions": True}}, False),
        ({"kwargs": {"sliding_window": 4, "position_ids": None, "dropout": 0.0}}, True),
        ({"mask_heads": 4}, False),  # a mask per head: not the group's rows
    ],
)
def test_only_one_token_steps_of_grouped_heads_with_plain_options_are_packed(case, packed):
    query, key, mask = _tensors(
        heads=case.get("heads", 4),
        kv_heads=case.get("kv_heads", 2),
        q_len=case.get("q_len", 1),
        mask_heads=case.get("mask_heads", 1),
    )
    mask = case.get("mask", mask)
    module = _Attention(case.get("groups", query.shape[1] // key.shape[1]))
    assert gqa.packable(module, query, key, mask, case.get("kwargs", {})) is packed


def test_installed_replaces_sdpa_inside_only_and_passes_other_calls_on_unchanged():
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    packer = gqa.PackedGqa()
    seen = []

    def spy(*args, **kwargs):
        seen.append(args[1].shape[2])
        return original(*args, **kwargs)

    transformers.AttentionInterface.register("sdpa", spy)
    try:
        with packer.installed():
            inside = ALL_ATTENTION_FUNCTIONS["sdpa"]
            assert inside is not spy
            with packer.installed():  # reentrant: the same function, restored once
                assert ALL_ATTENTION_FUNCTIONS["sdpa"] is inside
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is inside
            query, key, mask = _tensors()
            value = torch.randn_like(key)
            module = _Attention(2)
            out, _ = inside(module, query, key, value, mask, dropout=0.0, scaling=None)
            assert seen == []  # packed: the replaced function not called
            want, _ = original(module, query, key, value, mask, dropout=0.0, scaling=None)
            torch.testing.assert_close(out, want)
            prefill = torch.randn(2, 4, 3, 8)
            inside(module, prefill, key, value, None, dropout=0.0)
            assert seen == [3]  # a prefill goes to the function replaced
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is spy
        with pytest.raises(RuntimeError, match="boom"), packer.installed():
            raise RuntimeError("boom")
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is spy  # restored after an error too
    finally:
        transformers.AttentionInterface.register("sdpa", original)


@pytest.mark.parametrize("last", ["first_in", "second_in"])
def test_overlapping_generators_leave_transformers_own_function(last):
    # Two generators' decode steps overlapping (threads): the second installs over the
    # first's function, onto the one beneath it; whichever leaves last, HF's own is
    # registered afterwards, never a generator's.
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    a, b = gqa.PackedGqa(), gqa.PackedGqa()
    enter_a, enter_b = a.installed(), b.installed()
    enter_a.__enter__()
    enter_b.__enter__()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] not in (original, None)
    _, key, _ = _tensors()
    value = torch.randn_like(key)
    prefill = torch.randn(2, 4, 3, 8)
    # b's calls that are not packed reach HF's own, not a's function.
    out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](_Attention(2), prefill, key, value, None)
    want, _ = original(_Attention(2), prefill, key, value, None)
    torch.testing.assert_close(out, want)
    first, second = (enter_a, enter_b) if last == "second_in" else (enter_b, enter_a)
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original


def test_a_local_sdpa_override_stays_the_users_and_the_class_wide_one_is_restored():
    # ALL_ATTENTION_FUNCTIONS["sdpa"] = fn overrides transformers' own instance only
    # (its local mapping); the packer installs and restores the class-wide entry, the
    # one register writes, so the user's function never becomes transformers' own.
    original = transformers.AttentionInterface()["sdpa"]
    calls = []

    def users(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    packer = gqa.PackedGqa()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = users
    try:
        for _ in range(2):  # a second step finds the same state as the first
            with packer.installed():
                assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users  # the override wins
                assert transformers.AttentionInterface()["sdpa"] is not original
            assert transformers.AttentionInterface()["sdpa"] is original
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    query, key, mask = _tensors()
    ALL_ATTENTION_FUNCTIONS["sdpa"](_Attention(2), query, key, torch.randn_like(key), mask)
    assert calls == []  # the dropped override is not called beneath anything


def test_a_query_of_one_row_against_a_cache_of_several_broadcasts_as_hfs_does():
    query, key, mask = _tensors()
    mask[1, ..., :2] = False  # the second row left-padded
    value = torch.randn_like(key)
    one = query[:1]
    out = gqa.packed_attention(one, key, value, mask, None)
    want, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](_Attention(2), one, key, value, mask)
    assert out.shape == want.shape == (2, 1, 4, 8)
    torch.testing.assert_close(out, want)


def test_pack_gqa_must_be_a_bool_or_none():
    with pytest.raises(CudaGraphsTypeError, match="pack_gqa must be a bool"):
        GraphedGenerator(tiny("llama").eval(), (1, 2), max_cache_len=L, pack_gqa="yes")


def test_an_eager_kernel_generator_that_packs_serves_hf_tokens_with_its_steps_packed(
    monkeypatch,
):
    model = tiny("llama").eval()
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls = []
    real = gqa.packed_attention

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(gqa, "packed_attention", counting)
    assert captured(model, (2, 4)).stats()["pack_gqa"] is False  # off by default
    assert calls == []
    gen = captured(model, (2, 4), pack_gqa=True)
    assert gen.stats()["pack_gqa"] is True
    assert len(calls) > 0  # the capture's decode steps packed
    calls.clear()
    assert_serves_hf_tokens(gen, model, batches=(4, 3, 2, 1), new=4)
    # Replays run no Python (the eager backend stands in for the graphs and does):
    # every layer's attention in each decode step was packed.
    assert len(calls) >= model.config.num_hidden_layers
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original  # HF's own again, outside the steps


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_generator_that_packs_serves_hf_tokens_with_one_compile():
    from torch._dynamo.utils import counters

    model = tiny("qwen3_moe").eval()
    # Off by default, compiled or not, until it has run on a GPU.
    unpacked = GraphedGenerator(model, (2, 4), max_cache_len=L, compile_options={})
    assert unpacked.stats()["pack_gqa"] is False
    counters.clear()
    gen = captured(model, (2, 4), compile_options={}, require_all_buckets=True, pack_gqa=True)
    assert gen.stats()["pack_gqa"] is True
    assert_serves_hf_tokens(gen, model, batches=(4, 3, 2, 1), new=4)
    # One compile for every bucket: the packed attention adds no guard that fails.
    assert counters["stats"]["unique_graphs"] == 1
