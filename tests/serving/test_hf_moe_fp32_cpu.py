"""The generator's decode experts for float32 grouped_mm MoE models, on the CPU: the
rule against its reference, HF's decode map, when HF's generate switches, and the
generator's wiring with the probe answering as torch 2.11 on an H200 (no float32
grouped GEMM) and the eager stand-in for capture: refused at capture() before anything
is allocated or captured where HF's generate would not switch, else the prefill runs
grouped_mm and every decode step (the captures included) batched_mm, with HF's tokens
under HF's switch and the model restored after. On a GPU: test_cuda_hf_moe_fp32.py."""

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

transformers = pytest.importorskip("transformers")

from cudagraphs.errors import UnsupportedModelError  # noqa: E402
from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator, experts  # noqa: E402
from cudagraphs.serving.hf.experts import (  # noqa: E402
    DecodeExperts,
    choose_decode_experts,
    decode_implementations,
    hf_decodes_with_batched_mm,
)
from helpers.hf_generate import L, captured, hf_generate, prompts  # noqa: E402
from helpers.moe_models import FIXES, moe, probe_says  # noqa: E402

NEW = 6
PAD = 1


# ---- the rule ----------------------------------------------------------------------------
def reference_choice(syncs, hf_switches, capturing):
    """Nothing to do unless a capture would sync; then decode as HF does if it switches;
    else refuse a capture (an eager decode, graphs disabled, syncs harmlessly)."""
    if syncs and hf_switches:
        return "batched_mm"
    if syncs and capturing:
        return "refuse"
    return "as_loaded"


@given(st.booleans(), st.booleans(), st.booleans())
def test_the_decode_rule_equals_its_reference(syncs, hf_switches, capturing):
    got = choose_decode_experts(syncs=syncs, hf_switches=hf_switches, capturing=capturing)
    assert got == reference_choice(syncs, hf_switches, capturing)


IMPLEMENTATIONS = st.sampled_from([None, "grouped_mm", "batched_mm", "eager", "sonicmoe"])


@given(st.dictionaries(st.sampled_from(["", "text_config", "vision_config"]), IMPLEMENTATIONS))
def test_the_decode_map_is_hfs(current):
    # HF's _optimize_model_for_decode: every grouped_mm entry becomes batched_mm.
    want = {k: "batched_mm" if v == "grouped_mm" else v for k, v in current.items()}
    assert decode_implementations(current) == want


class Switchable(nn.Module):
    def __init__(self, device, with_switch=True):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, device=device))
        if with_switch:
            self._optimize_model_for_decode = contextlib.nullcontext
        self.get_experts_implementation = dict
        self.set_experts_implementation = lambda value: None


def test_hf_switches_where_it_has_the_switch_and_the_model_is_off_the_cpu():
    assert hf_decodes_with_batched_mm(Switchable("meta"))
    assert not hf_decodes_with_batched_mm(Switchable("cpu"))
    assert not hf_decodes_with_batched_mm(Switchable("meta", with_switch=False))
    assert not hf_decodes_with_batched_mm(nn.Linear(2, 2))


def test_the_installed_transformers_has_the_switch():
    # transformers 5.17 (the GPU image) and 5.24 (here) decode with batched_mm off the CPU.
    model = moe()
    assert callable(getattr(model, "_optimize_model_for_decode", None))
    assert not hf_decodes_with_batched_mm(model)  # on the CPU HF keeps grouped_mm


# ---- the generator -----------------------------------------------------------------------
def seen_implementations(model):
    """The experts implementation in effect at each call of layer 0's experts, with the
    call's row count (the prefill has more rows than the batch)."""
    seen = []
    experts_module = model.model.layers[0].mlp.experts

    def hook(module, args):
        seen.append((module.config._experts_implementation, args[0].shape[0]))

    experts_module.register_forward_pre_hook(hook)
    return seen


def test_it_refuses_at_capture_where_hf_would_not_switch(monkeypatch):
    probe_says(monkeypatch)
    model = moe().eval()
    calls = []

    def backend(run, pool, what):
        calls.append(what)
        return eager_backend(run, pool, what)

    gen = GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=backend)
    with pytest.raises(UnsupportedModelError) as err:
        gen.capture(progress=False)
    text = str(err.value)
    assert text.startswith("GraphedGenerator(OlmoeForCausalLM): the MoE experts at model.layers.0")
    assert all(fix in text for fix in FIXES), text
    assert "only where HF's generate decodes with it" in text
    assert calls == [] and gen.kv is None, "nothing allocated or captured"
    assert model.get_experts_implementation() == {"": "grouped_mm"}


@pytest.fixture
def hf_switches(monkeypatch):
    """The model counts as on a GPU for HF's decode switch (the generator's reading and
    HF's own), so the CPU runs what an H200 would."""
    monkeypatch.setattr(experts, "hf_decodes_with_batched_mm", lambda model: True)

    @contextlib.contextmanager
    def switch(self):
        # transformers' _optimize_model_for_decode without its device condition.
        before = self.get_experts_implementation()
        self.set_experts_implementation(decode_implementations(before))
        try:
            yield
        finally:
            self.set_experts_implementation(before)

    monkeypatch.setattr(transformers.GenerationMixin, "_optimize_model_for_decode", switch)


def test_where_hf_switches_the_decode_steps_run_batched_mm_with_hfs_tokens(
    monkeypatch, hf_switches
):
    probe_says(monkeypatch)
    model = moe().eval()
    seen = seen_implementations(model)
    gen = captured(model, batch_sizes=(1, 2, 4))
    shape_read, *captures = seen  # one eager token reads the cache shapes, as loaded
    assert shape_read == ("grouped_mm", 1)
    assert captures and {impl for impl, _ in captures} == {"batched_mm"}, "captures decode"
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    assert gen.stats()["decode_experts"] == {"": "batched_mm"}
    for batch in (2, 3, 5):  # a bucket, a padded bucket, above every bucket (eager)
        ids, mask = prompts(batch, seed=batch)
        del seen[:]
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=PAD)
        prefill, *decode = seen
        assert prefill == ("grouped_mm", batch * ids.shape[1])
        assert {impl for impl, _ in decode} == {"batched_mm"} and len(decode) == NEW - 1
        assert model.get_experts_implementation() == {"": "grouped_mm"}
        want = hf_generate(model, ids, mask, NEW, eos_token_id=[], pad_token_id=PAD)
        assert torch.equal(ours, want), batch
    assert gen.stats()["requests"] == {"graphs": 2, "too_large": 1}


def test_graphs_disabled_decode_the_model_as_loaded(monkeypatch):
    probe_says(monkeypatch)
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    model = moe().eval()
    seen = seen_implementations(model)
    gen = captured(model, batch_sizes=(1, 2))
    ids, mask = prompts(2)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=PAD)
    assert {impl for impl, _ in seen} == {"grouped_mm"}
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=[], pad_token_id=PAD))


@pytest.mark.parametrize(
    "dtype, implementation", [(torch.bfloat16, None), (torch.float32, "batched_mm")]
)
def test_models_whose_experts_capture_are_left_as_loaded(monkeypatch, dtype, implementation):
    probe_says(monkeypatch)
    model = moe(dtype=dtype, implementation=implementation).eval()
    switched = []
    monkeypatch.setattr(model, "set_experts_implementation", switched.append)
    gen = captured(model, batch_sizes=(1, 2))
    ids, mask = prompts(2)
    gen.generate(ids, mask, max_new_tokens=3, eos_token_id=[], pad_token_id=PAD)
    assert switched == []


def test_a_switch_that_does_not_reach_the_experts_is_refused(monkeypatch, hf_switches):
    probe_says(monkeypatch)
    model = moe().eval()
    monkeypatch.setattr(model, "set_experts_implementation", lambda value: None)
    gen = GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=eager_backend)
    with pytest.raises(UnsupportedModelError, match="left these experts on grouped_mm"):
        gen.capture(progress=False)


def test_the_model_is_restored_when_a_decode_step_raises():
    model = moe()
    switch = DecodeExperts(model, {"": "batched_mm"})
    with pytest.raises(RuntimeError, match="boom"), switch.decoding():
        assert model.get_experts_implementation() == {"": "batched_mm"}
        raise RuntimeError("boom")
    assert model.get_experts_implementation() == {"": "grouped_mm"}
