"""Every refused ``GraphedGenerator.generate`` request, one after another on one
generator (eager capture stand-in): each ends in a typed error (a ``CudaGraphsError``)
naming the argument, before anything runs; the good request after it returns HF's
static-cache tokens, decoded through the captured buckets."""

import pytest
import torch

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.errors import CudaGraphsError  # noqa: E402
from helpers.hf_generate import EOS, PAD, L, captured, hf_generate, prompts  # noqa: E402

NEW = 6
VOCAB = 128  # the tiny llama's

BAD = {
    "eos outside the vocabulary": (dict(eos_token_id=VOCAB), r"eos_token_id 128 outside"),
    "negative pad": (dict(pad_token_id=-1), r"pad_token_id -1 outside"),
    "nan temperature": (dict(do_sample=True, temperature=float("nan")), r"temperature .* got nan"),
    "inf temperature": (dict(do_sample=True, temperature=float("inf")), r"temperature .* got inf"),
    "nan repetition penalty": (dict(repetition_penalty=float("nan")), r"repetition_penalty"),
    "no new tokens": (dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
    "more than the cache holds": (dict(max_new_tokens=L), r"max_cache_len=24"),
    "top_p above 1": (dict(do_sample=True, top_p=1.5), r"top_p must be in \[0, 1\], got 1.5"),
    "negative top_k": (dict(do_sample=True, top_k=-1), r"top_k must be an int >= 0, got -1"),
    "float ids": (dict(ids=lambda i, m: (i.float(), m)), r"integer token ids"),
    "ids outside the vocabulary": (
        dict(ids=lambda i, m: (i + VOCAB, m)),
        r"input_ids\[0, 0\] = \d+ is outside the model's vocabulary \[0, 128\)",
    ),
    "mask of another shape": (dict(ids=lambda i, m: (i, m[:, 1:])), r"attention_mask"),
    "right padding": (dict(ids=lambda i, m: (i, m.flip(-1))), r"left padding"),
    "one-dimensional ids": (dict(ids=lambda i, m: (i[0], m[0])), r"unsqueeze\(0\)"),
}


@pytest.fixture(scope="module")
def gen():
    return captured(tiny("llama").eval(), batch_sizes=(1, 2, 4))


def _good(gen, batch, seed):
    ids, mask = prompts(batch, seed=seed)
    replays = sum(gen.runner.stats()["replays"].values())
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    want = hf_generate(gen.model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, want)
    assert sum(gen.runner.stats()["replays"].values()) > replays, "decoded by replays"


def _refused(gen, name, batch, seed):
    kw, match = BAD[name]
    kw = dict(kw)
    ids, mask = prompts(batch, seed=seed)
    if "ids" in kw:
        ids, mask = kw.pop("ids")(ids, mask)
    kw.setdefault("max_new_tokens", NEW)
    with pytest.raises(CudaGraphsError, match=match):
        gen.generate(ids, mask, **kw)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_refused_request_names_its_argument_and_the_next_request_equals_hf(gen, name):
    _refused(gen, name, 3, seed=1)
    _good(gen, 3, seed=2)


def test_every_refusal_in_a_row_then_good_requests_at_every_bucket(gen):
    for name in BAD:
        _refused(gen, name, 2, seed=4)
    for batch in (1, 2, 3, 4):
        _good(gen, batch, seed=10 + batch)
