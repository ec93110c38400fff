"""The Hugging Face generator on the CPU, with the eager stand-in for CUDA capture: greedy
and sampled tokens equal to HF's ``generate`` over a static cache (every batch size,
left padding, EOS, batches above the largest bucket, MoE experts), the models it
refuses, and the runner's per-bucket warmup counts, capture times, progress and the
collector paused while it captures."""

import gc
import io
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")


from cudagraphs.capture import gc_paused  # noqa: E402
from cudagraphs.errors import (  # noqa: E402
    CudaGraphsStateError,
    CudaGraphsValueError,
    UnsupportedModelError,
)
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec  # noqa: E402
from cudagraphs.serving.buckets import warmup_runs  # noqa: E402
from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import (  # noqa: E402
    GraphedGenerator,
    Sampling,
)
from cudagraphs.serving.hf.sampling import sampling_rule  # noqa: E402
from cudagraphs.serving.startup import progress_bar  # noqa: E402
from helpers.hf_generate import (  # noqa: E402
    EOS,
    PAD,
    PROMPT,
    L,
    captured,
    ended,
    hf_generate,
    hf_keyword,
    prompts,
)

CPU = torch.device("cpu")
NEW = 10
GENERATOR_LOG = "cudagraphs.serving.hf.generator"
RUNNER_LOG = "cudagraphs.serving.runner"


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


# ---- generator.py: tokens equal HF's ----------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_tokens_equal_hf_static_cache_generate(model, batch):
    gen = captured(model)
    ids, mask = prompts(batch, seed=batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert ours.dtype == torch.long and ours.shape == ref.shape
    assert torch.equal(ours, ref)
    assert torch.equal(ours[:, :PROMPT], ids)


def test_without_a_mask_the_padding_is_read_from_the_pad_id_as_hf_does(model):
    # Left-padded with the pad id (0) and no mask: generate infers ids != pad.
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=3)
    assert bool((ids == PAD).any())
    ours = gen.generate(ids, None, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = model.generate(
        ids,
        max_new_tokens=NEW,
        eos_token_id=EOS,
        pad_token_id=PAD,
        do_sample=False,
        disable_compile=True,
        **{hf_keyword(model): transformers.StaticCache(config=model.config, max_cache_len=L)},
    )
    assert torch.equal(ours, ref)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))


def test_request_filling_the_cache_exactly_equals_hf(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(2, seed=11)
    new = L - PROMPT + 1  # the last token is returned, never written
    ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, new, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)
    free = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=[])
    assert free.shape == (2, L + 1)


def test_batch_above_the_largest_bucket_equals_hf_and_is_counted_and_said_once(model, caplog):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(6, seed=6)
    with caplog.at_level(logging.WARNING, logger="cudagraphs"):
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert gen.stats()["requests"] == {"too_large": 1}
        again = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref) and torch.equal(again, ref)
    stats = gen.stats()
    assert stats["requests"] == {"too_large": 2}
    assert sum(stats["replays"].values()) == 0 and stats["eager_runs"] == {}
    warnings = [
        r
        for r in caplog.records
        if r.name.startswith("cudagraphs") and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1
    assert warnings[0].name == GENERATOR_LOG
    assert "a batch of 6 is larger than the largest bucket (4)" in warnings[0].getMessage()


def test_rows_after_their_eos_are_pad_and_equal_hf(model):
    gen = captured(model)
    ids, mask = prompts(3, seed=3)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    assert free.shape == (3, NEW)
    # an EOS that row 0 makes first at a middle step
    step = next(t for t in range(2, NEW - 2) if int(free[0, t]) not in free[0, :t].tolist())
    eos = int(free[0, step])
    pad = 1 if eos != 1 else 0
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad)
    expected = ended(free, {eos}, pad)
    assert torch.equal(ours[:, PROMPT:], expected)
    assert ours.shape == (3, PROMPT + NEW)  # rows 1 and 2 never make this EOS
    assert int(ours[0, PROMPT + step]) == eos
    assert bool((ours[0, PROMPT + step + 1 :] == pad).all())
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(ours, ref)


def test_output_is_shorter_when_every_row_ends_early(model):
    gen = captured(model)
    ids, mask = prompts(3, seed=4)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    eos = sorted({int(free[r, 1]) for r in range(3)})  # every row ends by its 2nd token
    pad = next(p for p in range(128) if p not in eos)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad)
    expected = ended(free, set(eos), pad)
    assert expected.shape[1] <= 2
    assert torch.equal(ours[:, PROMPT:], expected)
    assert gen.stats()["tokens"] == 3 * NEW + 3 * expected.shape[1]
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("after", [1, 0])
def test_eos_at_one_of_the_last_two_steps(model, after):
    # an EOS made at step s of max_new_tokens = s + 1 + after: with one step left the
    # request ends one token early; at the last step nothing changes
    gen = captured(model, (1, 2))
    ids, mask = prompts(1, seed=12)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    step = next(t for t in range(3, NEW) if int(free[0, t]) not in free[0, :t].tolist())
    eos, new = int(free[0, step]), step + 1 + after
    ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours[:, PROMPT:], free[:, : step + 1])
    ref = hf_generate(model, ids, mask, new, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours, ref)


def test_a_row_ending_one_step_before_the_last_gets_pad(model):
    gen = captured(model, (1, 2))
    ids, mask = prompts(2, seed=10)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    step = next(t for t in range(3, NEW) if int(free[0, t]) not in free[0, :t].tolist())
    eos, new = int(free[0, step]), step + 2
    assert eos not in free[1, :new].tolist()  # row 1 runs to the end
    ours = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=PAD)
    assert ours.shape == (2, PROMPT + new)
    assert torch.equal(ours[1, PROMPT:], free[1, :new])
    assert ours[0, PROMPT:].tolist() == free[0, : step + 1].tolist() + [PAD]
    ref = hf_generate(model, ids, mask, new, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours, ref)


def test_stop_tokens_default_to_the_models_generation_config():
    model = tiny("llama").eval()
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(2, seed=5)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])[:, PROMPT:]
    model.generation_config.eos_token_id = int(free[0, 3])
    model.generation_config.pad_token_id = 1 if int(free[0, 3]) != 1 else 0
    by_default = gen.generate(ids, mask, max_new_tokens=NEW)
    explicit = gen.generate(
        ids,
        mask,
        max_new_tokens=NEW,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    assert torch.equal(by_default, explicit)
    expected = ended(
        free, {model.generation_config.eos_token_id}, model.generation_config.pad_token_id
    )
    assert torch.equal(by_default[:, PROMPT:], expected)
    assert not torch.equal(expected, free[:, : expected.shape[1]])  # the EOS changed something


def test_sampling_with_a_seeded_generator_repeats_and_other_seeds_differ(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=7)

    def sample(seed):
        return gen.generate(
            ids,
            mask,
            max_new_tokens=NEW,
            do_sample=True,
            temperature=0.8,
            eos_token_id=[],
            generator=torch.Generator().manual_seed(seed),
        )

    first, second, other = sample(1), sample(1), sample(2)
    assert first.shape == (3, PROMPT + NEW)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)
    assert bool(((first[:, PROMPT:] >= 0) & (first[:, PROMPT:] < 128)).all())


def test_sampling_with_a_generator_leaves_the_global_rng_alone(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(2, seed=8)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    gen.generate(
        ids, mask, max_new_tokens=4, do_sample=True, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(torch.rand(4), expected)


def test_sampling_from_the_global_rng_equals_hf_sampling(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(4, seed=9)
    rule = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(5)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    torch.manual_seed(5)
    ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    assert torch.equal(ours, ref)


def test_a_request_that_ends_early_draws_no_more_random_numbers_than_hf(model):
    # Whether every sequence has ended is read one step late (the next step is already
    # queued); the request must still stop before sampling that step, as HF does, or
    # the next request from the same RNG would draw different tokens.
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=10)
    rule = dict(do_sample=True, temperature=1.5)
    many = list(range(3, 100))  # most of the vocabulary ends a sequence: all end early
    torch.manual_seed(6)
    ours_a = gen.generate(
        ids, mask, max_new_tokens=NEW, eos_token_id=many, pad_token_id=PAD, **rule
    )
    ours_b = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    torch.manual_seed(6)
    ref_a = hf_generate(model, ids, mask, NEW, eos_token_id=many, pad_token_id=PAD, **rule)
    ref_b = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD, **rule)
    assert ours_a.shape[1] < PROMPT + NEW, "the first request should end early"
    assert torch.equal(ours_a, ref_a)
    assert torch.equal(ours_b, ref_b)


def test_no_state_leaks_between_requests(model):
    gen = captured(model, (1, 2, 4))
    ids_a, mask_a = prompts(2, prompt_len=4, seed=21)
    ids_b, mask_b = prompts(3, prompt_len=9, seed=22)  # longer: writes past A's positions
    stops = dict(eos_token_id=EOS, pad_token_id=PAD)
    first = gen.generate(ids_a, mask_a, max_new_tokens=NEW, **stops)
    other = gen.generate(ids_b, mask_b, max_new_tokens=12, **stops)
    again = gen.generate(ids_a, mask_a, max_new_tokens=NEW, **stops)
    assert torch.equal(first, again)
    assert torch.equal(first, hf_generate(model, ids_a, mask_a, NEW, **stops))
    assert torch.equal(other, hf_generate(model, ids_b, mask_b, 12, **stops))


def test_generate_before_capture_and_after_close_is_a_state_error(model):
    gen = GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=eager_backend)
    ids, mask = prompts(2, seed=1)
    with pytest.raises(CudaGraphsStateError, match="before capture"):
        gen.generate(ids, mask, max_new_tokens=3)
    gen.capture(progress=False)
    tokens = gen.generate(ids, mask, max_new_tokens=3, eos_token_id=[])
    gen.close()
    gen.close()  # idempotent
    assert gen.kv is None and gen.stats()["cache_bytes"] == 0
    with pytest.raises(CudaGraphsStateError, match="after close"):
        gen.generate(ids, mask, max_new_tokens=3)
    gen.capture(progress=False)
    assert torch.equal(gen.generate(ids, mask, max_new_tokens=3, eos_token_id=[]), tokens)


def test_a_bad_request_runs_nothing_and_counts_nothing(model):
    gen = captured(model, (1, 2))
    ids, mask = prompts(2, seed=1)
    with pytest.raises(CudaGraphsValueError, match="max_cache_len=24"):
        gen.generate(ids, mask, max_new_tokens=L)
    with pytest.raises(CudaGraphsValueError, match="temperature"):
        gen.generate(ids, mask, max_new_tokens=2, do_sample=True, temperature=0.0)
    stats = gen.stats()
    assert stats["requests"] == {} and stats["tokens"] == 0
    assert sum(stats["replays"].values()) == 0


def test_stats_count_requests_tokens_cache_bytes_and_runner_keys(model):
    gen = GraphedGenerator(model, (1, 2, 4), max_cache_len=L, capture_backend=eager_backend)
    assert gen.stats()["cache_bytes"] == 0 and gen.stats()["tokens"] == 0
    gen.capture(progress=False)
    gen.generate(*prompts(2, seed=1), max_new_tokens=5, eos_token_id=[])
    gen.generate(*prompts(4, seed=2), max_new_tokens=4, eos_token_id=[])  # the largest
    stats = gen.stats()
    assert stats["requests"] == {"graphs": 2}
    assert stats["tokens"] == 2 * 5 + 4 * 4
    assert stats["cache_bytes"] == gen.kv.nbytes == 2 * 2 * (4 * 2 * L * 16) * 4
    assert stats["captured"] == [str(Bucket(b)) for b in (4, 2, 1)]
    # the first token comes from the prefill: max_new_tokens - 1 decode steps
    assert stats["replays"] == {str(Bucket(4)): 3, str(Bucket(2)): 4, str(Bucket(1)): 0}
    assert stats["eager_runs"] == {} and stats["dropped"] == {}
    assert {b: t["warmup_runs"] for b, t in stats["capture_seconds"].items()} == {
        str(Bucket(4)): 2,
        str(Bucket(2)): 1,
        str(Bucket(1)): 1,
    }


def test_padding_rows_of_a_bucket_attend_everywhere_and_stay_finite(model):
    gen = captured(model, (1, 2, 4))
    ids, mask = prompts(3, seed=1)
    gen.generate(ids, mask, max_new_tokens=4, eos_token_id=[])
    staged = gen.runner.static.views(Bucket(4))
    assert bool(staged["attention_mask"][3].all())  # the padding row: every position
    assert staged["attention_mask"][:3, PROMPT + 3 :].sum() == 0  # real rows: not yet
    logits = gen.runner.graphs[Bucket(4)].slots[0].output
    assert logits.shape == (4, 128) and bool(torch.isfinite(logits).all())


# ---- generator.py: models it refuses, MoE -----------------------------------------------
def _encoder_decoder(model):
    model.config.is_encoder_decoder = True


def _stateful(model):
    model._is_stateful = True


def _not_graph_safe(model):
    model._can_compile_fullgraph = False


@pytest.mark.parametrize(
    "change, start, text",
    [
        (_encoder_decoder, "LlamaForCausalLM is an encoder-decoder model", "decoder-only"),
        (_stateful, "LlamaForCausalLM keeps recurrent state outside a KV cache", "generate"),
        (_not_graph_safe, "LlamaForCausalLM does not support a static cache", "_can_compile"),
    ],
)
def test_models_without_a_static_decode_step_are_refused_naming_the_class(change, start, text):
    model = tiny("llama").eval()
    change(model)
    with pytest.raises(UnsupportedModelError) as err:
        GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=eager_backend)
    assert str(err.value).startswith(start)
    assert text in str(err.value)


@pytest.fixture(scope="module")
def moe():
    model = tiny("qwen3_moe").eval()
    model.set_experts_implementation("grouped_mm")
    try:
        with torch.no_grad():
            model(input_ids=torch.ones(2, 3, dtype=torch.long))
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"grouped_mm experts cannot run on this CPU torch build: {exc}")
    return model


def test_moe_with_looping_experts_is_refused_naming_grouped_mm():
    model = tiny("qwen3_moe").eval()
    model.set_experts_implementation("eager")
    with pytest.raises(UnsupportedModelError, match="'eager' implementation") as err:
        GraphedGenerator(model, (1, 2), max_cache_len=L, capture_backend=eager_backend)
    assert "set_experts_implementation('grouped_mm')" in str(err.value)


@pytest.mark.parametrize("batch", [3, 4])
def test_moe_with_grouped_mm_experts_equals_hf(moe, batch):
    gen = captured(moe, (1, 2, 4))
    ids, mask = prompts(batch, seed=30 + batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    ref = hf_generate(moe, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, ref)


# ---- runner: warmup runs, progress, capture times ----------------------------------------
@pytest.mark.parametrize(
    "index, warmup, compiled, expected",
    [
        (0, 2, False, 2),
        (1, 2, False, 1),
        (5, 3, False, 1),
        (3, 0, False, 0),
        (0, 0, False, 0),
        (1, 1, False, 1),
        (0, 3, True, 3),
        (4, 3, True, 3),
    ],
)
def test_warmup_runs_full_for_the_first_bucket_one_for_later_ones(
    index, warmup, compiled, expected
):
    assert warmup_runs(index, warmup, compiled) == expected


@pytest.mark.parametrize("progress, total", [(False, 3), (True, 0), (None, 0), (False, 0)])
def test_no_progress_bar_when_off_or_nothing_to_do(progress, total):
    assert progress_bar(progress, total, "capturing buckets") is None


def test_progress_bar_counts_buckets():
    pytest.importorskip("tqdm")
    bar = progress_bar(True, 3, "capturing buckets")
    try:
        assert (bar.total, bar.desc, bar.unit, bar.disable) == (
            3,
            "capturing buckets",
            "bucket",
            False,
        )
    finally:
        bar.close()


def test_default_progress_bar_is_off_without_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress_bar(None, 3, "capturing buckets")
    try:
        assert bar.disable is True
    finally:
        bar.close()


HIDDEN = 4


def counting_runner(calls, backend=eager_backend, **kw):
    def forward(x):
        calls.append(x.shape[0])
        return x * 2.0 + 1.0

    return GraphRunner(
        forward,
        [InputSpec("x", (4, HIDDEN), torch.float32)],
        BucketConfig(batch_sizes=(1, 2, 4)),
        device="cpu",
        capture_backend=backend,
        **kw,
    )


def dummy(bucket):
    return {"x": torch.zeros(bucket.rows, HIDDEN)}


@pytest.mark.parametrize(
    "warmup, runs, calls",
    [
        (2, [2, 1, 1], [4, 4, 4, 2, 2, 1, 1]),  # warmups, then one run at capture
        (3, [3, 1, 1], [4, 4, 4, 4, 2, 2, 1, 1]),
        (0, [0, 0, 0], [4, 2, 1]),
    ],
)
def test_only_the_first_bucket_gets_the_full_warmup(warmup, runs, calls):
    seen = []
    runner = counting_runner(seen)
    runner.capture(dummy, warmup, progress=False)
    assert seen == calls
    seconds = runner.stats()["capture_seconds"]
    assert list(seconds) == [str(Bucket(b)) for b in (4, 2, 1)]
    assert [seconds[str(Bucket(b))]["warmup_runs"] for b in (4, 2, 1)] == runs
    for entry in seconds.values():
        assert entry["warmup"] >= 0.0 and entry["capture"] > 0.0


def test_capture_says_each_bucket_at_info(caplog):
    runner = counting_runner([])
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
        runner.capture(dummy, 2, progress=False)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == RUNNER_LOG and r.levelno == logging.INFO and "captured" in r.getMessage()
    ]
    assert len(lines) == 3
    for line, (b, n) in zip(lines, [(4, 1), (2, 2), (1, 3)]):
        assert f"captured {Bucket(b)} ({n}/3)" in line
        assert "warmup" in line and "capture" in line


def test_a_dropped_bucket_has_no_capture_time_nor_info_line(caplog):
    def backend(run, pool, what):
        if what == str(Bucket(2)):
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_backend(run, pool, what)

    runner = counting_runner([], backend=backend, require_all_buckets=False)
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
        runner.capture(dummy, 2, progress=False)
    assert set(runner.stats()["capture_seconds"]) == {str(Bucket(4)), str(Bucket(1))}
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert not any(f"captured {Bucket(2)}" in m for m in infos)
    assert any(f"captured {Bucket(1)} (3/3)" in m for m in infos)


def test_capture_with_progress_shows_a_bar_over_the_buckets(capsys):
    pytest.importorskip("tqdm")
    runner = counting_runner([])
    runner.capture(dummy, 1, progress=True)
    err = capsys.readouterr().err
    assert "capturing buckets" in err and "3/3" in err


def test_generator_capture_without_progress_shows_no_bar(model, capsys):
    captured(model, (1, 2))
    assert "capturing buckets" not in capsys.readouterr().err


def test_collector_is_off_for_warmups_and_captures_and_back_on_after():
    enabled = []

    def forward(x):
        enabled.append(gc.isenabled())
        return x + 1.0

    runner = GraphRunner(
        forward,
        [InputSpec("x", (2, HIDDEN), torch.float32)],
        BucketConfig(batch_sizes=(1, 2)),
        device="cpu",
        capture_backend=eager_backend,
    )
    assert gc.isenabled()
    runner.capture(dummy, 2, progress=False)
    assert enabled == [False] * 5  # 2 + 1 runs for bucket 2, 1 + 1 for bucket 1
    assert gc.isenabled()
    runner.run({"x": torch.ones(1, HIDDEN)})
    assert enabled[-1] is True  # replays run with the collector on


def test_gc_paused_restores_the_collector_also_on_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_gc_paused_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_sampling_rule_takes_unset_values_from_the_generation_config():
    config = SimpleNamespace(do_sample=True, temperature=0.5, top_k=7, top_p=None)
    rule = sampling_rule(config, None, None, None, 0.9)
    assert rule == Sampling(do_sample=True, temperature=0.5, top_k=7, top_p=0.9)
    assert sampling_rule(config, False, 1.5, 3, None) == Sampling(False, 1.5, 3, 1.0)
    config = SimpleNamespace(do_sample=False, temperature=None, top_k=None, top_p=0.8)
    assert sampling_rule(config, None, None, None, None) == Sampling(False, 1.0, 50, 0.8)


def test_sampling_rule_without_a_config_uses_hf_defaults():
    assert sampling_rule(None, None, None, None, None) == Sampling(False, 1.0, 50, 1.0)
    assert sampling_rule(None, True, None, None, None).top_k == 50


def test_sampling_without_top_k_equals_hf_generate_with_its_default_top_k(model):
    gen = captured(model)
    ids, mask = prompts(4)
    torch.manual_seed(5)
    ours = gen.generate(ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=[])
    torch.manual_seed(5)
    want = hf_generate(model, ids, mask, 8, do_sample=True, eos_token_id=None)
    assert torch.equal(ours, want)


def test_sampling_follows_the_model_generation_config(model, monkeypatch):
    gen = captured(model)
    ids, mask = prompts(4)
    monkeypatch.setattr(model.generation_config, "temperature", 0.5)
    monkeypatch.setattr(model.generation_config, "top_k", 5)
    torch.manual_seed(9)
    ours = gen.generate(ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=[])
    torch.manual_seed(9)
    want = hf_generate(model, ids, mask, 8, do_sample=True, eos_token_id=None)
    assert torch.equal(ours, want)


def _replace(module, name="weight"):
    setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().clone()))


def test_replaced_weights_are_a_state_error_naming_them_and_capture_again_cures_it():
    model = tiny("llama").eval()
    gen = captured(model, (1, 2))
    ids, mask = prompts(2, seed=21)
    with torch.no_grad():
        for p in model.parameters():  # in place: the graphs still read these tensors
            p.mul_(1.0)
    gen.generate(ids, mask, max_new_tokens=3, eos_token_id=EOS, pad_token_id=PAD)
    _replace(model.model.layers[0].mlp.up_proj)
    with pytest.raises(CudaGraphsStateError) as info:
        gen.generate(ids, mask, max_new_tokens=3, eos_token_id=EOS, pad_token_id=PAD)
    text = str(info.value)
    assert "tensors were replaced since capture() (model.layers.0.mlp.up_proj.weight)" in text
    assert "load_state_dict() without assign" in text and "close() and capture() again" in text
    assert gen.stats()["requests"] == {"graphs": 1}  # the refused request ran nothing
    gen.close()
    gen.capture(progress=False)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))


@pytest.mark.parametrize(
    "count, said",
    [
        (
            3,
            "(model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
            "model.layers.0.self_attn.v_proj.weight)",
        ),
        (
            4,
            "(model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
            "model.layers.0.self_attn.v_proj.weight and 1 more)",
        ),
    ],
    ids=["three", "four"],
)
def test_replaced_weights_are_named_up_to_three_then_counted(count, said):
    model = tiny("llama").eval()
    gen = captured(model, (1,))
    attn = model.model.layers[0].self_attn
    for module in [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj][:count]:
        _replace(module)
    ids, mask = prompts(1, seed=1)
    with pytest.raises(CudaGraphsStateError) as info:
        gen.generate(ids, mask, max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD)
    assert f"replaced since capture() {said}, e.g. by" in str(info.value)


def test_a_replaced_buffer_is_named_too():
    model = tiny("llama").eval()
    gen = captured(model, (1,))
    name, buffer = next(iter(model.named_buffers()))  # the rotary table (inv_freq)
    owner = model.get_submodule(name.rpartition(".")[0])
    owner.register_buffer(name.rpartition(".")[2], buffer.clone(), persistent=False)
    ids, mask = prompts(1, seed=1)
    with pytest.raises(CudaGraphsStateError, match=f"replaced since capture\\(\\) \\({name}\\)"):
        gen.generate(ids, mask, max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD)


def test_a_disabled_generator_reads_the_model_as_it_is_now(monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    model = tiny("llama").eval()
    gen = captured(model, (1, 2))
    _replace(model.lm_head)
    ids, mask = prompts(2, seed=3)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
