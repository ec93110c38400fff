"""GraphedGenerator's repetition penalty on the CPU, with the eager stand-in for CUDA
capture: HF's own processor over the prompt and the tokens made so far, greedy and
sampled, from the argument or the model's generation_config; tokens equal HF's
``generate`` with the same penalty, and a control that the penalty changes them."""

import logging

import pytest
import torch

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.errors import CudaGraphsValueError  # noqa: E402
from cudagraphs.serving.hf import Sampling  # noqa: E402
from cudagraphs.serving.hf.sampling import sampling_rule  # noqa: E402
from helpers.hf_generate import EOS, PAD, captured, hf_generate, prompts  # noqa: E402

NEW = 10
PENALTY = 3.0  # strong, so that a tiny random model's greedy tokens change


@pytest.fixture
def model():
    return tiny("llama").eval()


def test_greedy_tokens_with_a_penalty_equal_hfs_and_differ_without_it(model):
    gen = captured(model, (1, 2, 4))
    for batch in (1, 3):
        ids, mask = prompts(batch, seed=batch)
        kw = dict(eos_token_id=EOS, pad_token_id=PAD)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, repetition_penalty=PENALTY, **kw)
        ref = hf_generate(model, ids, mask, NEW, repetition_penalty=PENALTY, **kw)
        assert torch.equal(ours, ref), batch
        plain = gen.generate(ids, mask, max_new_tokens=NEW, **kw)
        assert not torch.equal(ours, plain), batch  # the control: the penalty mattered


def test_the_penalty_of_the_generation_config_applies_without_a_warning(model, caplog):
    model.generation_config.repetition_penalty = PENALTY
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=8)
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert not [r for r in caplog.records if r.name.startswith("cudagraphs")]
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)
    off = gen.generate(
        ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, repetition_penalty=1.0
    )
    assert torch.equal(
        off,
        hf_generate(
            model, ids, mask, NEW, repetition_penalty=1.0, eos_token_id=EOS, pad_token_id=PAD
        ),
    )
    assert not torch.equal(off, ours)


def test_sampled_tokens_with_a_penalty_equal_hfs_from_the_same_seed(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(4, seed=9)
    rule = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.7)
    torch.manual_seed(5)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    torch.manual_seed(5)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    assert torch.equal(ours, ref)


def test_the_penalty_comes_first_and_applies_to_greedy_decoding_too():
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    greedy = Sampling(False, 0.5, 10, 0.9, repetition_penalty=1.2).processors()
    assert [type(p) for p in greedy] == [RepetitionPenaltyLogitsProcessor]
    sampled = Sampling(True, 0.5, 10, 0.9, repetition_penalty=1.2).processors()
    assert [type(p) for p in sampled] == [
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    ]
    assert sampled[0].penalty == 1.2
    assert Sampling(repetition_penalty=1.2).reads_sequences
    assert not Sampling().reads_sequences and len(Sampling().processors()) == 0


@pytest.mark.parametrize("penalty", [0, 0.0, -1.5, float("inf")])
def test_a_penalty_that_is_not_positive_and_finite_is_refused(penalty):
    with pytest.raises(
        CudaGraphsValueError,
        match=f"repetition_penalty must be a finite number > 0, got {penalty}",
    ):
        Sampling(repetition_penalty=penalty)


def test_the_rule_takes_the_penalty_from_the_argument_then_the_config():
    config = transformers.GenerationConfig(repetition_penalty=1.4)
    assert sampling_rule(config, None, None, None, None).repetition_penalty == 1.4
    assert sampling_rule(config, None, None, None, None, 1.1).repetition_penalty == 1.1
    assert sampling_rule(None, None, None, None, None).repetition_penalty == 1.0


@pytest.mark.parametrize("penalty", ["1.2", None, True])
def test_a_penalty_that_is_not_a_number_is_a_type_error_naming_it(penalty):
    from cudagraphs.errors import CudaGraphsTypeError

    with pytest.raises(CudaGraphsTypeError, match="^repetition_penalty must be"):
        Sampling(repetition_penalty=penalty)
