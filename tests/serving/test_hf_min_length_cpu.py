"""GraphedGenerator's minimum lengths on the CPU, with the eager stand-in for CUDA
capture: HF's own processors hold the end-of-sequence ids back until ``min_new_tokens``
new tokens (or ``min_length`` tokens in all), from the arguments or the model's
generation_config; tokens equal HF's ``generate``, with a control that the minimum
changed them."""

import pytest
import torch

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.errors import CudaGraphsValueError  # noqa: E402
from cudagraphs.serving.hf import Sampling  # noqa: E402
from cudagraphs.serving.hf.sampling import sampling_rule  # noqa: E402
from helpers.hf_generate import PROMPT, captured, hf_generate, prompts  # noqa: E402

NEW = 10
PAD = 0


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


@pytest.fixture(scope="module")
def early_eos(model):
    """Prompts, and an id that row 0 makes as its second new token when nothing stops
    it: as an end-of-sequence id it ends row 0 early unless a minimum holds it back."""
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=3)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])
    eos = int(free[0, PROMPT + 1])
    assert eos not in free[0, PROMPT : PROMPT + 1].tolist()
    return ids, mask, eos


@pytest.mark.parametrize("minimum", [dict(min_new_tokens=5), dict(min_length=PROMPT + 5)])
def test_minimum_lengths_hold_the_end_back_as_hf_does(model, early_eos, minimum):
    ids, mask, eos = early_eos
    gen = captured(model, (1, 2, 4))
    stops = dict(eos_token_id=eos, pad_token_id=PAD)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, **minimum, **stops)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, **minimum, **stops))
    early = gen.generate(ids, mask, max_new_tokens=NEW, **stops)
    assert int(early[0, PROMPT + 1]) == eos and int(early[0, PROMPT + 2]) == PAD
    assert not torch.equal(ours[:, : early.shape[1]], early)  # the minimum mattered
    assert int(ours[0, PROMPT + 1]) != eos  # held back at the second new token


def test_the_minimum_of_the_generation_config_applies(model, early_eos):
    ids, mask, eos = early_eos
    model.generation_config.min_new_tokens = 4
    try:
        gen = captured(model, (1, 2, 4))
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD)
        ref = hf_generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=PAD)
        assert torch.equal(ours, ref)
        off = gen.generate(
            ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, min_new_tokens=0
        )
        assert int(off[0, PROMPT + 1]) == eos
    finally:
        model.generation_config.min_new_tokens = None


def test_without_end_ids_a_minimum_holds_nothing_back():
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    rule = Sampling(min_new_tokens=3, min_length=9)
    assert rule.reads_sequences
    assert len(rule.processors(6, torch.tensor([], dtype=torch.long))) == 0
    assert len(rule.processors(6)) == 0
    made = rule.processors(6, torch.tensor([2]))
    assert [type(p).__name__ for p in made] == [
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
    ]
    assert isinstance(made[1], MinNewTokensLengthLogitsProcessor)
    assert made[0].min_length == 9 and made[1].min_new_tokens == 3
    assert made[1].prompt_length_to_skip == 6


@pytest.mark.parametrize("name", ["min_length", "min_new_tokens"])
def test_a_negative_minimum_is_refused_naming_it(name):
    with pytest.raises(CudaGraphsValueError, match=f"^{name} must be an int >= 0, got -1"):
        Sampling(**{name: -1})


def test_the_rule_takes_the_minimums_from_the_arguments_then_the_config():
    config = transformers.GenerationConfig(min_new_tokens=4, min_length=7)
    rule = sampling_rule(config, None, None, None, None)
    assert (rule.min_length, rule.min_new_tokens) == (7, 4)
    rule = sampling_rule(config, None, None, None, None, None, 2, 1)
    assert (rule.min_length, rule.min_new_tokens) == (2, 1)
    rule = sampling_rule(None, None, None, None, None)
    assert (rule.min_length, rule.min_new_tokens) == (0, None)  # None: not set


def test_a_minimum_of_one_counts_and_none_adds_nothing():
    eos = torch.tensor([2])
    assert len(Sampling().processors(6, eos)) == 0  # no minimum: no processor
    one = Sampling(min_length=1, min_new_tokens=1).processors(6, eos)
    assert [(type(p).__name__) for p in one] == [
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
    ]
    # Without a prompt length, none is skipped: every token counts as new. As in
    # generate, a set min_new_tokens also makes the minimum length prompt + it.
    first, second = Sampling(min_new_tokens=2).processors(eos=eos)
    assert first.min_length == 2 and second.prompt_length_to_skip == 0


def test_the_minimum_processors_keep_their_ids_on_the_requests_device():
    # On the GPU the ids must sit with the scores; a meta tensor stands for a device
    # tensor here (HF's processors would move CPU ids onto their default device).
    eos = torch.tensor([2], device="meta")
    made = Sampling(min_length=3, min_new_tokens=2).processors(5, eos)
    assert [p.eos_token_id.device.type for p in made] == ["meta", "meta"]
