"""Prefill graphs on the CPU (serving/hf/prefill.py), with the eager stand-in for CUDA
capture: the length-bucket policy against a plain reference (hypothesis), the checks
of ``prefill_lengths``, and the generator's prefill path: padded prompts keep HF's
tokens, every request is counted by path, and the graphs capture into the decode
graphs' pool."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError  # noqa: E402
from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from cudagraphs.serving.hf.prefill import (  # noqa: E402
    check_prefill_lengths,
    choose_length,
    default_prefill_lengths,
)
from helpers.hf_generate import EOS, PAD, prompts  # noqa: E402
from helpers.hf_generate import hf_generate as generate  # noqa: E402

NEW = 6
CACHE = 40  # max_cache_len of the generators here


def hf_generate(model, ids, mask, new, **kw):
    """HF's static-cache generate over a cache as long as ours."""
    return generate(
        model,
        ids,
        mask,
        new,
        max_cache_len=CACHE,
        **{"eos_token_id": EOS, "pad_token_id": PAD, **kw},
    )


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


def reference_length(lengths, prompt_len, new, cache):
    """Every bucket that holds the prompt and fits the cache once padded; the shortest."""
    holding = [n for n in lengths if n >= prompt_len]
    if not holding:
        return None, "longer"
    fitting = [n for n in holding if n + new - 1 <= cache]
    return (min(fitting), None) if fitting else (None, "no_room")


@given(
    lengths=st.sets(st.integers(1, 64), max_size=6),
    prompt_len=st.integers(1, 70),
    new=st.integers(1, 40),
    cache=st.integers(2, 100),
)
def test_the_length_choice_is_the_shortest_bucket_that_holds_the_prompt_and_fits(
    lengths, prompt_len, new, cache
):
    choice = choose_length(sorted(lengths), prompt_len, new, cache)
    assert (choice.length, choice.eager_cause) == reference_length(lengths, prompt_len, new, cache)


@pytest.mark.parametrize(
    "cache, lengths",
    [
        (96, (16, 32, 64)),
        (512, (16, 32, 64, 128, 256, 512)),
        (4096, (16, 32, 64, 128, 256, 512)),
        (16, (16,)),
        (10, (10,)),
    ],
)
def test_default_lengths_are_powers_of_two_from_16_to_512_that_fit_the_cache(cache, lengths):
    assert default_prefill_lengths(cache) == lengths


def test_lengths_are_checked_naming_the_problem_and_the_fix():
    assert check_prefill_lengths([32, 8], 40) == (8, 32)
    assert check_prefill_lengths((), 40) == ()
    with pytest.raises(CudaGraphsTypeError, match="prefill_lengths must be a sequence"):
        check_prefill_lengths(16, 40)
    with pytest.raises(CudaGraphsTypeError, match=r"prefill_lengths\[1\]"):
        check_prefill_lengths([8, 16.0], 40)
    with pytest.raises(CudaGraphsValueError, match=r"repeats \[8\]"):
        check_prefill_lengths([8, 16, 8], 40)
    with pytest.raises(CudaGraphsValueError, match=r"\[64\] exceed max_cache_len=40"):
        check_prefill_lengths([8, 64], 40)
    with pytest.raises(CudaGraphsValueError, match=r"prefill_lengths\[0\]"):
        check_prefill_lengths([0], 40)


def make(model, sizes=(1, 2, 4), **kw):
    gen = GraphedGenerator(model, sizes, max_cache_len=CACHE, capture_backend=eager_backend, **kw)
    gen.capture(progress=False)
    return gen


def test_padded_prefills_keep_hfs_tokens_and_each_request_is_counted_by_path(model):
    gen = make(model, prefill_lengths=(8, 16))
    cases = [(1, 5, NEW), (3, 8, NEW), (4, 12, NEW), (2, 17, NEW), (2, 12, 29), (8, 6, NEW)]
    for batch, prompt_len, new in cases:
        ids, mask = prompts(batch, prompt_len=prompt_len, seed=batch + prompt_len)
        ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=EOS, pad_token_id=PAD)
        ref = hf_generate(model, ids, mask, new)
        assert torch.equal(ours, ref), (batch, prompt_len, new)
    stats = gen.stats()
    # 17 is longer than every bucket; 12 padded to 16 with 29 new tokens needs 44 > 40
    # positions; 8 rows are above every bucket (their own cache, eager throughout).
    assert stats["prefills"] == {"graphs": 3, "longer": 1, "no_room": 1, "too_large": 1}
    replays = stats["prefill_graphs"]
    assert replays["8"]["replays"] == {"bucket(bs=4)": 1, "bucket(bs=2)": 0, "bucket(bs=1)": 1}
    assert replays["16"]["replays"] == {"bucket(bs=4)": 1, "bucket(bs=2)": 0, "bucket(bs=1)": 0}
    assert stats["eager_runs"] == {}


def test_without_lengths_every_prefill_is_eager_and_said_so(model):
    gen = make(model)  # eager kernels: no prefill graphs by default
    assert gen.prefill_lengths == ()
    ids, mask = prompts(2, prompt_len=5, seed=1)
    gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    stats = gen.stats()
    assert stats["prefills"] == {"off": 1}
    assert stats["prefill_graphs"] == {}


def test_compiled_generators_take_the_default_lengths(model):
    def build(**kw):
        return GraphedGenerator(
            model,
            (1, 2),
            max_cache_len=CACHE,
            compile_options={"backend": "eager"},
            capture_backend=eager_backend,
            **kw,
        )

    assert build().prefill_lengths == (16, 32)
    assert build(prefill_lengths=()).prefill_lengths == ()


def test_the_token_cap_leaves_out_the_rows_buckets_above_it(model):
    gen = make(model, prefill_lengths=(8, 16), prefill_tokens=32)
    graphs = gen.stats()["prefill_graphs"]
    assert graphs["8"]["captured"] == ["bucket(bs=4)", "bucket(bs=2)", "bucket(bs=1)"]
    assert graphs["16"]["captured"] == ["bucket(bs=2)", "bucket(bs=1)"]
    ids, mask = prompts(3, prompt_len=12, seed=3)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW))
    assert gen.stats()["prefills"] == {"too_large": 1}
    with pytest.raises(CudaGraphsValueError, match="prefill_tokens"):
        GraphedGenerator(model, (1,), max_cache_len=CACHE, prefill_tokens=0)


def test_lengths_no_rows_bucket_fits_under_the_token_cap_are_refused_at_construction(model):
    # Their prefills could never replay a graph: said before anything is captured.
    with pytest.raises(CudaGraphsValueError) as err:
        GraphedGenerator(
            model, (2, 4), max_cache_len=CACHE, prefill_lengths=(4, 8, 16), prefill_tokens=8
        )
    said = str(err.value)
    assert said.startswith("prefill_lengths [8, 16] cannot have a prefill graph")
    assert "smallest rows bucket (2)" in said and "prefill_tokens >= 32" in said


def test_prefill_graphs_capture_into_the_decode_graphs_pool_and_close_with_them(model):
    gen = make(model, prefill_lengths=(8,))
    pool = gen.runner.captured.pool
    assert all(r.captured.pool is pool for r in gen.prefill.runners.values())
    gen.close()
    assert gen.prefill is None and gen.stats()["prefill_graphs"] is None
    gen.capture(progress=False)  # and again
    ids, mask = prompts(2, prompt_len=5, seed=2)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW))
    assert gen.stats()["prefills"] == {"graphs": 1}


def test_a_failed_prefill_capture_releases_the_decode_graphs_and_the_next_capture_works(
    model, monkeypatch
):
    gen = GraphedGenerator(
        model,
        (1, 2),
        max_cache_len=CACHE,
        capture_backend=eager_backend,
        prefill_lengths=(8,),
        require_all_buckets=True,
    )
    calls = []

    def failing(run, pool, what):
        calls.append(what)
        if len(calls) == 1:  # the first prefill bucket (the decode runner has its own)
            raise RuntimeError("capture failed")
        return eager_backend(run, pool, what)

    gen._capture_backend = failing
    with pytest.raises(Exception, match="capture failed|dropped"):
        gen.capture(progress=False)
    assert gen.runner.captured is None and gen.prefill is None
    gen._capture_backend = eager_backend
    gen.capture(progress=False)
    ids, mask = prompts(2, prompt_len=5, seed=4)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW))


def test_disabled_graphs_run_the_padded_prefill_on_the_same_path_and_say_so(model, monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    gen = make(model, prefill_lengths=(8,))
    ids, mask = prompts(2, prompt_len=5, seed=6)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW))
    assert gen.stats()["prefills"] == {"disabled": 1}
    assert gen.stats()["prefill_graphs"]["8"]["replays"]["bucket(bs=2)"] == 1


SLIDING = {
    "mistral": {},
    "qwen2": dict(use_sliding_window=True, max_window_layers=1),
    "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16),
}


def architecture(family):
    if family not in SLIDING:
        return tiny(family).eval()
    from helpers.hf_models import CONFIGS

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        family, **CONFIGS["llama"], **SLIDING[family], sliding_window=4
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", *SLIDING])
def test_padded_prefills_keep_hfs_tokens_across_architectures(family):
    # MoE experts and sliding windows (a window of 4, shorter than the padding plus the
    # prompt): the padding hides keys the window or the mask would hide anyway.
    model = architecture(family)
    gen = make(model, prefill_lengths=(8, 16))
    for batch, prompt_len in ((1, 5), (3, 8), (2, 11)):
        ids, mask = prompts(batch, prompt_len=prompt_len, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, hf_generate(model, ids, mask, 10)), (family, batch)
    assert gen.stats()["prefills"] == {"graphs": 3}


def test_the_penalty_min_lengths_and_seeded_sampling_read_the_prompt_not_its_padding(model):
    # The bucket's extra padding (id 0) is the cache's, not the request's: the
    # repetition penalty, the minimum lengths and sampling see the prompt as given.
    gen = make(model, prefill_lengths=(16,))
    ids, mask = prompts(3, prompt_len=7, seed=11)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=PAD)
    # The token row 0 makes third ends it there under min_new_tokens=2 (two new tokens
    # before it, counted from the prompt as given) and is held back under 3.
    eos = int(free[0, 7 + 2])
    kw = dict(eos_token_id=eos, pad_token_id=PAD)
    for least, ends in ((2, True), (3, False)):
        ours = gen.generate(ids, mask, max_new_tokens=NEW, min_new_tokens=least, **kw)
        assert torch.equal(ours, hf_generate(model, ids, mask, NEW, min_new_tokens=least, **kw))
        assert (int(ours[0, 7 + 2]) == eos) is ends, least
    ours = gen.generate(ids, mask, max_new_tokens=NEW, repetition_penalty=3.0, **kw)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, repetition_penalty=3.0, **kw))
    seeded = dict(do_sample=True, top_k=8, temperature=0.9, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(5)
    sampled = gen.generate(ids, mask, max_new_tokens=NEW, **seeded)
    torch.manual_seed(5)
    assert torch.equal(sampled, hf_generate(model, ids, mask, NEW, **seeded))
    assert gen.stats()["prefills"] == {"graphs": 5}


def test_the_prefill_graphs_plan_against_what_the_decode_graphs_left(model, monkeypatch):
    from types import SimpleNamespace

    from cudagraphs.serving.hf.prefill import PrefillGraphs

    gen = make(model, prefill_lengths=(8,))
    gen.close()
    handed = []
    monkeypatch.setattr(PrefillGraphs, "capture", lambda self, make, **kw: handed.append(kw))
    measure = SimpleNamespace(device_bytes=300)
    monkeypatch.setattr(type(gen.runner), "memory_used", property(lambda self: measure))
    gen.capture(progress=False, free_bytes=1000, headroom_bytes=7)
    assert handed[-1] == dict(plan_memory=False, headroom_bytes=7, free_bytes=700, progress=False)
    gen.close()
    measure.device_bytes = 5000  # more than was given: nothing left, not a negative budget
    gen.capture(progress=False, free_bytes=1000)
    assert handed[-1]["free_bytes"] == 0
    gen.close()
    gen.capture(progress=False)  # no budget given: the device's free memory then
    assert handed[-1]["free_bytes"] is None


@pytest.mark.parametrize(
    "family", ["qwen3", "gemma", "phi", "olmoe", "gpt_neox", "falcon", "opt", "gpt2"]
)
def test_padded_prefills_keep_hfs_tokens_for_more_architectures(family):
    # Embedding scales, partial rotary, learned positions (OPT, GPT-2: the positions
    # come from the mask, 0 on padding) and fused projections, at a 64-token vocabulary.
    from helpers.hf_models import tiny_arch

    model = tiny_arch(family).eval()
    gen = make(model, prefill_lengths=(8, 16))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 60, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    ids[1, :2], mask[1, :2] = 0, 0
    ours = gen.generate(ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    ref = generate(model, ids, mask, 8, max_cache_len=CACHE, eos_token_id=[], pad_token_id=0)
    assert torch.equal(ours, ref)
    assert gen.stats()["prefills"] == {"graphs": 1}


@given(
    lengths=st.sets(st.integers(1, 64), min_size=1, max_size=5),
    sizes=st.sets(st.integers(1, 32), min_size=1, max_size=5),
    cap=st.integers(1, 512),
)
def test_each_length_graphs_the_rows_buckets_under_the_token_cap_as_a_reference_does(
    lengths, sizes, cap
):
    from cudagraphs.serving import BucketConfig
    from cudagraphs.serving.hf.prefill import PrefillGraphs

    graphs = PrefillGraphs(
        lambda **kw: None,
        sorted(lengths),
        BucketConfig(tuple(sizes)),
        cap,
        device=torch.device("cpu"),
        pool=None,
        require_all_buckets=None,
        capture_backend=eager_backend,
    )
    reference = {
        n: sorted(r for r in sizes if r * n <= cap)
        for n in sorted(lengths)
        if any(r * n <= cap for r in sizes)
    }
    got = {
        n: sorted(b.rows for b in runner.config.buckets()) for n, runner in graphs.runners.items()
    }
    assert got == reference
    for n, runner in graphs.runners.items():
        assert {s.name: s.shape for s in runner.specs} == {
            name: (max(reference[n]), n) for name in ("input_ids", "position_ids", "attention_mask")
        }
