"""GraphedGenerator(compile_options=...) on the CPU, with the eager stand-in for CUDA
capture and a counting dynamo backend: the decode step runs through the compiled model
(tokens still HF's: the backend runs what dynamo traced as it is), the prefill and
batches above every bucket stay eager, every bucket warms up in full, and options that
would make inductor record CUDA graphs of its own are refused."""

import pytest
import torch

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.compile_watch import check_compile_options  # noqa: E402
from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError  # noqa: E402
from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec  # noqa: E402
from cudagraphs.serving.graphs import eager_backend  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from helpers.hf_generate import EOS, PAD, captured, hf_generate, prompts  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


class CountingBackend:
    """A dynamo backend that runs the traced graph as it is and records the shape of
    every graph input it was compiled for."""

    def __init__(self):
        self.compiles = []

    def __call__(self, gm, example_inputs):
        self.compiles.append([tuple(x.shape) for x in example_inputs if hasattr(x, "shape")])
        return gm.forward


def test_decode_steps_run_the_compiled_model_and_tokens_stay_hfs(model, fresh_dynamo):
    backend = CountingBackend()
    gen = captured(model, (1, 2, 4), compile_options={"backend": backend, "fullgraph": True})
    compiled = len(backend.compiles)
    assert compiled >= 1  # the warmups traced the decode step
    times = gen.stats()["capture_seconds"]
    assert [t["warmup_runs"] for t in times.values()] == [2, 2, 2]
    for batch in (3, 4, 1):
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, ref), batch
    # Requests compiled nothing more: the prefill (any prompt length) is eager, and
    # every decode step met a shape its bucket's warmup compiled.
    ids, mask = prompts(2, prompt_len=9, seed=9)
    gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert len(backend.compiles) == compiled
    assert gen.stats()["eager_runs"] == {}


def test_a_batch_above_every_bucket_decodes_with_the_eager_model(model, fresh_dynamo):
    backend = CountingBackend()
    gen = captured(model, (1, 2), compile_options={"backend": backend})
    compiled = len(backend.compiles)
    ids, mask = prompts(5, seed=5)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert len(backend.compiles) == compiled  # a new shape mid-request compiled nothing
    assert gen.stats()["requests"] == {"too_large": 1}


def test_compile_options_must_be_a_mapping(model):
    with pytest.raises(CudaGraphsTypeError, match="compile_options must be a mapping"):
        GraphedGenerator(model, (1, 2), max_cache_len=16, compile_options="max-autotune")


@pytest.mark.parametrize(
    "options, said",
    [
        ({"mode": "reduce-overhead"}, "mode='reduce-overhead'"),
        ({"mode": "max-autotune", "fullgraph": True}, "mode='max-autotune'"),
        ({"options": {"triton.cudagraphs": True}}, "triton.cudagraphs=True"),
    ],
)
def test_modes_that_record_graphs_of_their_own_are_refused_with_the_fix(model, options, said):
    with pytest.raises(CudaGraphsValueError) as info:
        GraphedGenerator(model, (1, 2), max_cache_len=16, compile_options=options)
    text = str(info.value)
    assert text.startswith(f"GraphedGenerator: compile_options with {said} make inductor")
    assert "mode='max-autotune-no-cudagraphs'" in text and "leave 'mode' out" in text
    spec = [InputSpec("x", (2, 4), torch.float32)]
    with pytest.raises(CudaGraphsValueError, match=f"^GraphRunner: compile_options with {said}"):
        GraphRunner(lambda x: x, spec, BucketConfig((1, 2)), device="cpu", compile_options=options)


@pytest.mark.parametrize(
    "options",
    [
        None,
        {},
        {"mode": "default"},
        {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
        {"options": {"triton.cudagraphs": False}},
    ],
)
def test_options_without_graphs_of_their_own_pass_as_a_copy(options):
    out = check_compile_options("here", options)
    assert out == options
    assert out is None or out is not options


def test_compiled_inside_gives_every_bucket_the_full_warmup():
    calls = []

    def forward(x):
        calls.append(x.shape[0])
        return x * 2

    spec = [InputSpec("x", (4, 3), torch.float32)]
    config = BucketConfig((1, 2, 4))
    runner = GraphRunner(
        forward, spec, config, device="cpu", capture_backend=eager_backend, compiled_inside=True
    )
    assert runner.compiles and runner.forward is forward  # nothing compiled by the runner
    runner.capture(lambda b: {"x": torch.ones(b.rows, 3)}, warmup=3)
    assert [t.warmup_runs for t in runner.capture_times.values()] == [3, 3, 3]
    with pytest.raises(CudaGraphsTypeError, match="compiled_inside must be a bool"):
        GraphRunner(forward, spec, config, device="cpu", compiled_inside=1)


def test_one_compile_serves_every_bucket_a_bucket_of_one_row_too(model, fresh_dynamo):
    # The batch dimension is marked dynamic before the first compile (inputs and the
    # cache's views), and capture reasons about sizes without specializing 1, so the
    # largest bucket's compile serves 8, 4, 2 and 1. A decode step that traced its
    # bucket's cache lookup (or guarded on the cache object) would compile per bucket.
    backend = CountingBackend()
    gen = captured(model, (1, 2, 4, 8, 16), compile_options={"backend": backend, "fullgraph": True})
    assert [shapes[0][0] for shapes in backend.compiles] == [16]
    for batch in (1, 3):  # the one-row bucket, and a padded one, through that compile
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        ref = hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, ref), batch
    assert len(backend.compiles) == 1


def test_size_oblivious_reasoning_is_on_during_a_compiled_capture_only(model, fresh_dynamo):
    import torch.fx.experimental._config as shapes_config

    seen = []

    def backend(gm, example_inputs):
        seen.append(shapes_config.backed_size_oblivious)
        return gm.forward

    captured(model, (1, 2), compile_options={"backend": backend, "fullgraph": True})
    assert seen == [True] and shapes_config.backed_size_oblivious is False


def test_compile_seconds_are_reported_per_bucket_and_zero_where_a_compile_was_reused(
    model, fresh_dynamo
):
    backend = CountingBackend()
    gen = captured(model, (1, 2, 4, 8, 16), compile_options={"backend": backend, "fullgraph": True})
    times = gen.runner.capture_times
    frames = {b.rows: t.compiled_frames for b, t in times.items()}
    # As above: the largest bucket compiles for every bucket.
    assert frames[16] == 1
    assert frames[8] == frames[4] == frames[2] == frames[1] == 0
    assert sum(frames.values()) == len(backend.compiles)
    for b, t in times.items():
        assert (t.compile_s > 0) == (t.compiled_frames > 0), b
        assert t.compile_s <= t.warmup_s, b
    # stats() carries the same per-bucket figures, beside the warmup and capture seconds.
    reported = gen.stats()["capture_seconds"]
    assert reported == {
        str(b): {
            "warmup_runs": t.warmup_runs,
            "warmup": t.warmup_s,
            "capture": t.capture_s,
            "compile": t.compile_s,
            "compiled_frames": t.compiled_frames,
        }
        for b, t in times.items()
    }


# Falcon's decode step in transformers before 5.25 specializes one size: one compile
# more. From 5.25 on it compiles once, as the others do.
FALCON_COMPILES = (
    2 if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 25) else 1
)


@pytest.mark.parametrize(
    "family, compiles",
    [("qwen3_moe", 1), ("mistral", 1), ("gpt2", 1), ("falcon", FALCON_COMPILES)],
)
def test_the_compiles_of_four_buckets_across_architectures(family, compiles, fresh_dynamo):
    # The batch dimension marked dynamic holds through each architecture's decode step
    # (a specialization of a marked dimension would be an error at compile, its bucket
    # dropped).
    from helpers.hf_models import tiny_arch

    net = (tiny(family) if family == "qwen3_moe" else tiny_arch(family)).eval()
    backend = CountingBackend()
    gen = captured(net, (1, 2, 4, 8), compile_options={"backend": backend, "fullgraph": True})
    assert len(backend.compiles) == compiles and backend.compiles[0][0][0] == 8
    assert gen.stats()["dropped"] == {}
    vocab = net.config.vocab_size
    ids, mask = prompts(1, seed=1)
    ids = torch.where(mask.bool(), ids % (vocab - 3) + 3, torch.zeros_like(ids))
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(net, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))


def test_a_largest_bucket_of_two_rows_compiles_dynamic_and_drops_nothing(model, fresh_dynamo):
    # Two rows is the smallest size a marked dimension may have: its cache views must
    # be marked as the inputs are, or dynamo finds the two sizes unequal constraints.
    backend = CountingBackend()
    gen = captured(model, (1, 2), compile_options={"backend": backend, "fullgraph": True})
    assert [shapes[0][0] for shapes in backend.compiles] == [2]
    assert gen.stats()["dropped"] == {} and len(gen.stats()["captured"]) == 2


@pytest.mark.parametrize("compiled", [False, True])
def test_only_a_compiled_capture_marks_shapes_and_turns_size_oblivious_reasoning_on(
    model, fresh_dynamo, monkeypatch, compiled
):
    from contextlib import contextmanager

    import cudagraphs.serving.hf.generator as generator

    marked, oblivious = [], []
    monkeypatch.setattr(generator, "mark_dynamic", lambda t, d: marked.append((t.shape[0], d)))

    @contextmanager
    def recorded():
        oblivious.append(True)
        yield True

    monkeypatch.setattr(generator, "size_oblivious_shapes", recorded)
    options = {"compile_options": {"backend": CountingBackend()}} if compiled else {}
    captured(model, (1, 2, 4), **options)
    if not compiled:
        assert marked == [] and oblivious == []
        return
    assert oblivious == [True]
    # Each decode input of a warmup or capture of two rows or more, dimension 0; never
    # a one-row bucket's (a size dynamo specializes).
    assert marked and {rows for rows, _ in marked} == {2, 4}
    assert {d for _, d in marked} == {0}
