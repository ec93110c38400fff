"""GraphedGenerator on the GPU: greedy tokens equal HF's static-cache generate with
compilation off, for batches at and between buckets and prompts of different lengths;
seeded sampling repeats; requests do not leak into each other; every decode step
replays a graph."""

import pytest
import torch

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from cudagraphs.torch_private import upstream_caches_subgraph_schemas  # noqa: E402
from helpers.hf_gpu import (  # noqa: E402
    EOS,
    LLAMA,
    MAX_CACHE_LEN,
    NEW,
    PAD,
    build,
    hf_static,
    prompts,
)


def captured(model, sizes=(1, 2, 4, 8, 16, 32)):
    gen = GraphedGenerator(model, sizes, max_cache_len=MAX_CACHE_LEN, require_all_buckets=True)
    gen.capture()
    return gen


def compiled(model, sizes, **kwargs):
    """A generator of ``model`` through ``torch.compile(fullgraph=True)``, every bucket
    captured."""
    gen = GraphedGenerator(
        model,
        sizes,
        max_cache_len=MAX_CACHE_LEN,
        require_all_buckets=True,
        compile_options={"fullgraph": True, **kwargs.pop("compile_options", {})},
        **kwargs,
    )
    gen.capture()
    return gen


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tokens_equal_hf_static_cache_at_a_bucket_in_bf16(family, batch):
    model = build(family, torch.bfloat16)
    gen = captured(model)
    ids, mask = prompts(batch, seed=batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    want = hf_static(model, ids, mask)
    assert torch.equal(ours, want)
    stats = gen.stats()
    assert stats["eager_runs"] == {}
    assert stats["replays"][f"bucket(bs={batch})"] == ours.shape[1] - ids.shape[1] - 1


@pytest.mark.parametrize("batch", [3, 20])
def test_greedy_tokens_equal_hf_static_cache_on_a_padded_bucket_in_fp32(batch):
    # Bucket 4 or 32 serves the batch: the matmuls run at the bucket's rows, so the
    # real rows agree with HF's to rounding; in fp32 (no TF32) that keeps argmax equal.
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    gen = captured(model)
    ids, mask = prompts(batch, seed=batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_static(model, ids, mask))
    bucket = 4 if batch == 3 else 32
    assert gen.stats()["replays"][f"bucket(bs={bucket})"] > 0


@pytest.mark.parametrize("batch", [3, 20])
def test_greedy_tokens_equal_hf_static_cache_at_buckets_of_that_size_in_bf16(batch):
    model = build("llama", torch.bfloat16)
    gen = captured(model, sizes=(1, 3, 8, 20))
    ids, mask = prompts(batch, seed=batch)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_static(model, ids, mask))


def test_sequences_stop_at_eos_as_in_hf():
    model = build("llama", torch.bfloat16)
    gen = captured(model)
    ids, mask = prompts(4, seed=7)
    free = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=PAD)
    eos = int(free[1, ids.shape[1] + 3])  # a token row 1 makes at its 4th step
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours, hf_static(model, ids, mask, eos_token_id=eos))
    row = ours[1, ids.shape[1] :]
    first = int((row == eos).nonzero()[0])
    assert (row[first + 1 :] == PAD).all()


def test_seeded_sampling_repeats_and_the_seed_matters():
    model = build("llama", torch.bfloat16)
    gen = captured(model)
    ids, mask = prompts(8, seed=3)

    def sample(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return gen.generate(
            ids,
            mask,
            max_new_tokens=NEW,
            do_sample=True,
            temperature=0.8,
            top_k=50,
            top_p=0.9,
            eos_token_id=[],
            generator=g,
        )

    first, again, other = sample(11), sample(11), sample(12)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_a_request_does_not_leak_into_the_next():
    model = build("llama", torch.bfloat16)
    gen = captured(model)
    a_ids, a_mask = prompts(8, seed=1, longest=8)
    b_ids, b_mask = prompts(8, seed=2, longest=30)
    first = gen.generate(a_ids, a_mask, max_new_tokens=NEW, eos_token_id=[])
    gen.generate(b_ids, b_mask, max_new_tokens=60, eos_token_id=[])
    again = gen.generate(a_ids, a_mask, max_new_tokens=NEW, eos_token_id=[])
    assert torch.equal(first, again)


def test_a_batch_above_the_largest_bucket_decodes_eagerly_and_equals_hf():
    model = build("llama", torch.bfloat16)
    gen = captured(model, sizes=(1, 2, 4))
    ids, mask = prompts(6, seed=5)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_static(model, ids, mask))
    assert gen.stats()["requests"] == {"too_large": 1}


def test_capture_times_are_reported_per_bucket():
    model = build("llama", torch.bfloat16)
    gen = captured(model)
    times = gen.stats()["capture_seconds"]
    assert set(times) == {f"bucket(bs={b})" for b in (1, 2, 4, 8, 16, 32)}
    assert times["bucket(bs=32)"]["warmup_runs"] == 2
    assert all(t["warmup_runs"] == 1 for k, t in times.items() if k != "bucket(bs=32)")
    assert all(t["capture"] > 0 for t in times.values())


def test_plan_memory_drops_the_costly_buckets_and_tokens_stay_equal():
    # A first capture with room for everything gives the plan's own figures; a second
    # with half of the graphs' predicted bytes free must drop the costly (large)
    # buckets, keep bucket 1, say why, and decode as HF does through what is left.
    torch.backends.cuda.matmul.allow_tf32 = False  # padded rows: see the fp32 test
    model = build("llama", torch.float32)
    sizes = (1, 2, 4, 8, 16, 32)
    roomy = GraphedGenerator(model, sizes, max_cache_len=MAX_CACHE_LEN)
    roomy.capture(plan_memory=True, free_bytes=1 << 40)
    plan = roomy.runner.memory_plan
    assert {b.batch_size for b in plan.chosen} == set(sizes) and not plan.dropped
    assert plan.predicted_pool_bytes > 0 and roomy.runner.memory_used is not None
    roomy.close()

    tight = GraphedGenerator(model, sizes, max_cache_len=MAX_CACHE_LEN)
    tight.capture(plan_memory=True, free_bytes=plan.eager_reserve_bytes + plan.predicted_bytes // 2)
    stats = tight.stats()
    assert 0 < len(stats["dropped"]) < len(sizes), stats["dropped"]
    assert all(why.startswith("memory plan: does not fit") for why in stats["dropped"].values())
    assert "bucket(bs=1)" in stats["captured"]
    assert "bucket(bs=32)" in stats["dropped"]  # the most expensive goes first
    for batch in (1, 8):
        ids, mask = prompts(batch, seed=40 + batch)
        ours = tight.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, hf_static(model, ids, mask)), f"batch {batch}"
    assert tight.stats()["replays"]["bucket(bs=1)"] > 0


def test_disabled_generator_decodes_eagerly_through_the_same_path(monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    model = build("llama", torch.bfloat16)
    gen = captured(model, sizes=(1, 2, 4, 8))
    ids, mask = prompts(4, seed=9)  # at a bucket: the same kernels as HF's batch of 4
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_static(model, ids, mask))
    stats = gen.stats()
    assert stats["disabled"] is True and stats["captured"] == []
    assert stats["eager_runs"].get("disabled", 0) == ours.shape[1] - ids.shape[1] - 1


class InductorTraces:
    """Inductor as the backend, keeping each graph dynamo hands it."""

    def __init__(self) -> None:
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def layer_bodies(self) -> list[list[str]]:
        hop = torch.ops.higher_order.invoke_subgraph
        return [[n.args[0].target for n in g.graph.nodes if n.target is hop] for g in self.graphs]


@pytest.mark.parametrize("regions", [None, False], ids=["layer_regions", "whole_model"])
def test_compiled_decode_steps_are_captured_and_keep_hfs_greedy_tokens_in_fp32(regions):
    # compile_options: inductor's fused kernels are what the bucket graphs record.
    # Fused kernels round differently from eager ones, so the comparison is in fp32 (no
    # TF32), at a bucket (4, 1) and on a padded one (3 on 4), against HF's eager
    # static-cache generate. By default the four decoder layers share one compiled
    # body (the step's one graph calls it once per layer); False inlines them all.
    import torch._dynamo

    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    sizes = (1, 2, 4, 8)
    traces = InductorTraces()
    gen = compiled(model, sizes, compile_options={"backend": traces}, compile_regions=regions)
    bodies = traces.layer_bodies()
    # One compile for the buckets of two rows or more; fp32 attention (no flash kernel)
    # may compile the one-row bucket apart.
    assert 1 <= len(bodies) <= 2, bodies
    for calls in bodies:
        if regions is None:
            # Every layer calls a body, the layers after the first one body (the first
            # may trace apart: its input is the embedding's output).
            assert len(calls) == LLAMA["num_hidden_layers"] and len(set(calls[1:])) == 1, calls
        else:
            assert calls == []
    layers = LLAMA["num_hidden_layers"] if regions is None else 0
    assert gen.stats()["compile_regions"] == layers
    # The layers' region schema: made once and reused by the later layers, where torch
    # does not keep it itself.
    memo = gen.stats()["subgraph_schemas"]
    assert memo["active"] is (regions is None and not upstream_caches_subgraph_schemas())
    if memo["active"]:
        assert memo["built"] >= 1 and memo["reused"] >= layers - 1, memo
    times = gen.stats()["capture_seconds"]
    assert set(times) == {f"bucket(bs={b})" for b in sizes}
    assert all(t["warmup_runs"] == 2 for t in times.values())  # each compiles its shape
    for batch in (4, 3, 1):
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, hf_static(model, ids, mask)), batch
    stats = gen.stats()
    assert stats["eager_runs"] == {}
    assert stats["replays"]["bucket(bs=4)"] > 0 and stats["replays"]["bucket(bs=1)"] > 0
    gen.close()
    torch._dynamo.reset()


def test_a_compiled_capture_compiles_once_for_every_bucket_without_cudnn_attention():
    # The default sdpa_backends of a compiled capture (every backend but cuDNN's): one
    # compile serves every bucket, the bucket of one row too, and no replayed kernel is
    # cuDNN's. Under torch's own choice on the H200 the one-row bucket compiles again.
    import torch._dynamo
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    gen = compiled(build("llama", torch.bfloat16), (1, 2, 4, 8))
    frames = {b.rows: t.compiled_frames for b, t in gen.runner.capture_times.items()}
    assert frames[8] >= 1, frames
    assert frames[4] == frames[2] == frames[1] == 0, frames
    assert gen.stats()["sdpa_backends"] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    # An eager prefill is torch's choice (cuDNN on the H200): kept off cuDNN here so
    # that a cuDNN kernel seen can only be a replayed one (decode steps and, for these
    # prompts, prefill graphs), whose kernels the capture fixed.
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with profile(activities=[ProfilerActivity.CUDA]) as prof, sdpa_kernel(no_cudnn):
        for batch in (1, 4):
            ids, mask = prompts(batch, seed=batch)
            gen.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "the profiler saw the replays' kernels"
    assert not [k for k in kernels if "cudnn" in k.lower()], "a cuDNN kernel was replayed"
    stats = gen.stats()
    assert stats["eager_runs"] == {}
    assert stats["replays"]["bucket(bs=1)"] > 0 and stats["replays"]["bucket(bs=4)"] > 0
    assert stats["prefills"] == {"graphs": 2}
    gen.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_models_keep_hfs_greedy_tokens_past_the_window(family):
    # A window of 8 under prompts of up to 12 and 24 new tokens: HF's static cache keeps
    # the window in its storage, ours in the mask (serving/hf/cache.py), so attention
    # runs over another key length (masked keys add exact zeros, in another order): in
    # fp32 without TF32, as for padded buckets, that keeps argmax equal.
    torch.backends.cuda.matmul.allow_tf32 = False
    extra = dict(sliding_window=8)
    if family == "qwen2":
        extra.update(use_sliding_window=True, max_window_layers=2)  # layers 2, 3 slide
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **LLAMA, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(device="cuda", dtype=torch.float32).eval()
    gen = captured(model, sizes=(1, 4, 8))
    for batch in (1, 8):
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, hf_static(model, ids, mask)), (family, batch)
    assert gen.stats()["eager_runs"] == {}


def test_refused_requests_leave_the_generator_serving_hfs_tokens():
    """Each bad request ends in a typed error before anything runs on the device (ids
    outside the vocabulary would be a device-side assert, which loses the CUDA
    context); the good request after each equals HF, decoded by replays."""
    from cudagraphs.errors import CudaGraphsError

    model = build("llama", torch.float32)
    gen = captured(model, sizes=(1, 2, 4))
    ids, mask = prompts(4, seed=21)
    vocab = LLAMA["vocab_size"]
    bad = [
        (dict(input_ids=ids + vocab), r"input_ids\[0, \d+\] = \d+ is outside"),
        (dict(input_ids=ids.float()), r"integer token ids"),
        (dict(attention_mask=mask.flip(-1)), r"left padding"),
        (dict(eos_token_id=vocab), r"eos_token_id 1024 outside"),
        (dict(pad_token_id=-1), r"pad_token_id -1 outside"),
        (dict(do_sample=True, temperature=float("nan")), r"temperature"),
        (dict(max_new_tokens=MAX_CACHE_LEN), r"max_cache_len=96"),
    ]
    want = hf_static(model, ids, mask)
    for kw, match in bad:
        args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD)
        args.update(kw)
        args.setdefault("eos_token_id", EOS)
        with pytest.raises(CudaGraphsError, match=match):
            gen.generate(args.pop("input_ids"), args.pop("attention_mask"), **args)
        before = sum(gen.runner.stats()["replays"].values())
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, want), kw
        assert sum(gen.runner.stats()["replays"].values()) > before


def _kernels(gen, ids, mask, new):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.generate(ids, mask, max_new_tokens=new, eos_token_id=EOS, pad_token_id=PAD)
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def _kernels_a_step_serving_hf_tokens(gen, model, label):
    """The kernels of one decode step of ``gen`` at batch 4 (those of four more steps,
    the prefill's cancelled), after checking HF's greedy tokens at batches 4, 3 and 1,
    every step replayed."""
    for batch in (4, 3, 1):
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
        assert torch.equal(ours, hf_static(model, ids, mask)), (label, batch)
    ids, mask = prompts(4, seed=4)
    per_step = (_kernels(gen, ids, mask, 6) - _kernels(gen, ids, mask, 2)) / 4
    stats = gen.stats()
    assert stats["eager_runs"] == {}
    assert stats["replays"]["bucket(bs=4)"] > 0 and stats["replays"]["bucket(bs=1)"] > 0
    return per_step


def test_stacked_projections_cut_three_gemms_a_layer_and_keep_hfs_greedy_tokens_in_fp32():
    # The default of a compiled generator: q/k/v and gate/up one GEMM each, so three
    # kernels fewer a layer or more in every decode step than with stack_projections=False
    # (counted as the kernels of four more decode steps, the prefill's cancelled).
    import torch._dynamo

    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    layers = LLAMA["num_hidden_layers"]
    per_step = {}
    for stack in (None, False):
        gen = compiled(model, (1, 4), stack_projections=stack)
        assert gen.stats()["stacked_projections"] == (2 * layers if stack is None else 0)
        per_step[stack] = _kernels_a_step_serving_hf_tokens(gen, model, stack)
        gen.close()
        gen.stacked.unstack()
        torch._dynamo.reset()
    # At least the three GEMMs a layer (cuBLAS may run a small one as two kernels),
    # the copies of each projection's columns fused into their readers.
    assert per_step[False] - per_step[None] >= 3 * layers, per_step


def test_packed_gqa_drops_the_repeated_cache_copies_and_keeps_hfs_greedy_tokens_in_fp32():
    # pack_gqa=True: each key/value head's group of query heads read as its rows, so
    # the decode step no longer copies the cache to repeat its heads: two kernels
    # fewer a layer (keys and values) or more than pack_gqa=False, the same tokens.
    import torch._dynamo

    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", torch.float32)
    assert LLAMA["num_attention_heads"] > LLAMA["num_key_value_heads"]  # grouped heads
    layers = LLAMA["num_hidden_layers"]
    per_step = {}
    for pack in (True, False):
        gen = compiled(model, (1, 4), pack_gqa=pack)
        assert gen.stats()["pack_gqa"] is pack
        regions = gen.stats()["compile_regions"]
        if pack:
            # On torch 2.11 the packed layers fall back to the whole model compiled as
            # one (docs/serving-hf.md says why); never silently: the reason is kept.
            assert regions == layers or gen.compile_regions_error is not None
        else:
            assert regions == layers, gen.compile_regions_error
        per_step[pack] = _kernels_a_step_serving_hf_tokens(gen, model, pack)
        gen.close()
        torch._dynamo.reset()
    assert per_step[False] - per_step[True] >= 2 * layers, per_step
