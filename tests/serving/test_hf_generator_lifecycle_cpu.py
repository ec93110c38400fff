"""A compiled generator over its lifetime, on the CPU: weights replaced after capture
(the stacked projection groups laid anew by the capture the error asks for, and
refused under CUDAGRAPHS_DISABLE too), and many generators in one process, each
decoding through its own compile rather than the ninth falling back to eager at
dynamo's recompile limit."""

import pytest
import torch

from cudagraphs.errors import CudaGraphsStateError
from cudagraphs.settings import DISABLE_ENV
from helpers.hf_generate import EOS, PAD, assert_serves_hf_tokens, captured, prompts
from helpers.hf_models import tiny


@pytest.mark.usefixtures("fresh_dynamo")
def test_replaced_weights_are_refused_and_the_capture_after_lays_the_groups_anew():
    model = tiny("llama").eval()
    gen = captured(model, (1, 2, 4), compile_options={}, prefill_lengths=())
    groups = gen.stats()["stacked_projections"]
    assert groups > 0
    model.load_state_dict(tiny("llama", seed=1).state_dict(), assign=True)
    ids, mask = prompts(3, seed=3)
    with pytest.raises(CudaGraphsStateError, match=r"close\(\) and capture\(\) again"):
        gen.generate(ids, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
    gen.close()
    gen.capture(progress=False)
    assert gen.stats()["stacked_projections"] == groups and not gen.stacked.moved()
    assert_serves_hf_tokens(gen, model, batches=(3,))


@pytest.mark.usefixtures("fresh_dynamo")
def test_under_disable_a_replaced_grouped_weight_is_refused_not_read_as_it_was(monkeypatch):
    # Eager steps, but the decode step reads the groups' buffers: refused by name.
    monkeypatch.setenv(DISABLE_ENV, "1")
    model = tiny("llama").eval()
    gen = captured(model, (1, 2, 4), compile_options={}, prefill_lengths=())
    ids, mask = prompts(2, seed=2)
    gen.generate(ids, mask, max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD)
    model.load_state_dict(tiny("llama", seed=1).state_dict(), assign=True)
    with pytest.raises(CudaGraphsStateError, match=r"q_proj\.weight.*close\(\) and capture"):
        gen.generate(ids, mask, max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD)


@pytest.mark.usefixtures("fresh_dynamo")
def test_ten_generators_in_one_process_each_decode_through_their_compile():
    # Each generator's layers share one compiled body through regions of its own,
    # which dynamo's guards check: over one shared code object the ninth generator
    # would hit the recompile limit (8) and decode eagerly.
    calls = []

    def backend(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)

        return run

    model = tiny("llama").eval()
    ids, mask = prompts(3, seed=0)
    for _ in range(10):
        gen = captured(model, (1, 2, 4), compile_options={"backend": backend}, prefill_lengths=())
        before = len(calls)
        gen.generate(ids, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=PAD)
        assert len(calls) - before == 5  # every decode step after the prefill's token
        assert gen.stats()["eager_runs"] == {}
        gen.close()
    torch._dynamo.reset()
