"""Settings of a model's generation_config that GraphedGenerator does not apply: found
by value (neutral values and None are not settings), sampling-only warpers only for
sampled requests, and said once per distinct set at WARNING by a request."""

import logging

import pytest
import torch

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.serving.hf.unapplied import (  # noqa: E402
    SAMPLING_ONLY,
    UNAPPLIED,
    unapplied_settings,
)
from helpers.hf_generate import EOS, PAD, captured, hf_generate, prompts  # noqa: E402

GENERATOR_LOG = "cudagraphs.serving.hf.generator"


def config(**kw):
    return transformers.GenerationConfig(**kw)


def test_a_fresh_config_and_no_config_set_nothing():
    assert unapplied_settings(config(), do_sample=True) == {}
    assert unapplied_settings(None, do_sample=True) == {}


def test_neutral_values_are_not_settings():
    neutral = config(
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        num_beams=1,
        suppress_tokens=[],
        typical_p=1.0,
        epsilon_cutoff=0.0,
        guidance_scale=1.0,
    )
    assert unapplied_settings(neutral, do_sample=True) == {}


def test_set_values_are_named_with_their_values_in_a_fixed_order():
    cfg = config(forced_eos_token_id=4, no_repeat_ngram_size=3, bad_words_ids=[[7]])
    got = unapplied_settings(cfg, do_sample=False)
    assert got == {"no_repeat_ngram_size": 3, "bad_words_ids": [[7]], "forced_eos_token_id": 4}
    assert list(got) == ["no_repeat_ngram_size", "bad_words_ids", "forced_eos_token_id"]


def test_sampling_only_warpers_count_only_for_sampled_requests():
    cfg = config(typical_p=0.9, min_p=0.05, no_repeat_ngram_size=2)
    assert unapplied_settings(cfg, do_sample=False) == {"no_repeat_ngram_size": 2}
    assert unapplied_settings(cfg, do_sample=True) == {
        "no_repeat_ngram_size": 2,
        "min_p": 0.05,
        "typical_p": 0.9,
    }


def test_every_listed_setting_is_a_generation_config_attribute():
    fields = set(transformers.GenerationConfig().to_dict())
    assert not set(UNAPPLIED) - fields and not set(SAMPLING_ONLY) - fields
    applied = ("temperature", "top_k", "top_p", "repetition_penalty", "min_length")
    applied += ("min_new_tokens",)
    assert not set(applied) & (set(UNAPPLIED) | set(SAMPLING_ONLY))
    assert unapplied_settings(config(repetition_penalty=1.3), do_sample=True) == {}


def test_a_config_without_some_settings_reads_the_ones_it_has():
    # An older transformers (or a hand-made config) may lack attributes: absent is unset.
    from types import SimpleNamespace

    cfg = SimpleNamespace(no_repeat_ngram_size=2, typical_p=0.5)
    assert unapplied_settings(cfg, do_sample=True) == {"no_repeat_ngram_size": 2, "typical_p": 0.5}


def test_a_value_that_refuses_comparison_counts_as_set():
    class Odd:
        def __eq__(self, other):
            raise TypeError("no")

    cfg = config()
    cfg.sequence_bias = Odd()
    assert list(unapplied_settings(cfg, do_sample=False)) == ["sequence_bias"]


@pytest.fixture
def penalized():
    model = tiny("llama").eval()
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.bad_words_ids = [[5]]
    return model


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == GENERATOR_LOG]


def test_a_request_says_once_which_settings_it_leaves_out(penalized, caplog):
    gen = captured(penalized, (1, 2, 4))
    ids, mask = prompts(2, seed=2)
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        gen.generate(ids, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
        gen.generate(ids, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
    said = warnings_of(caplog)
    assert said == [
        "GraphedGenerator: the model's generation_config sets no_repeat_ngram_size=2, "
        "bad_words_ids=[[5]], which this generator does not apply (it applies "
        "temperature, top_k, top_p, repetition_penalty, min_length, min_new_tokens and "
        "the stop and pad ids): its tokens can differ from model.generate()'s. Fix: unset "
        "them in model.generation_config (None), or generate with model.generate."
    ]
    # Another set is said again; unsetting them says nothing more.
    penalized.generation_config.no_repeat_ngram_size = None
    penalized.generation_config.bad_words_ids = None
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        caplog.clear()
        ours = gen.generate(ids, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
        assert warnings_of(caplog) == []
        penalized.generation_config.forced_eos_token_id = 3
        gen.generate(ids, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
    assert len(warnings_of(caplog)) == 1 and "forced_eos_token_id=3" in warnings_of(caplog)[0]
    penalized.generation_config.forced_eos_token_id = None
    ref = hf_generate(penalized, ids, mask, 4, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)  # with the settings unset, HF's tokens again


def test_a_sampled_request_names_the_sampling_only_warpers_a_greedy_one_does_not(caplog):
    model = tiny("llama").eval()
    model.generation_config.typical_p = 0.8
    gen = captured(model, (1, 2))
    ids, mask = prompts(2, seed=4)
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        gen.generate(ids, mask, max_new_tokens=3, do_sample=False, eos_token_id=[])
        assert warnings_of(caplog) == []
        rng = torch.Generator().manual_seed(0)
        gen.generate(ids, mask, max_new_tokens=3, do_sample=True, generator=rng, eos_token_id=[])
    said = warnings_of(caplog)
    assert len(said) == 1 and "sets typical_p=0.8, which this generator" in said[0]
