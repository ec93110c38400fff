"""GraphRunner with real CUDA graphs: decode tokens equal eager, a failed bucket is
dropped, a tight memory budget drops the expensive buckets, a piecewise region with
static outputs equals eager."""

import pytest
import torch

from cudagraphs.models import DecoderConfig, TinyDecoder, greedy_decode
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec
from cudagraphs.torch_private import clear_cublas_workspaces

pytestmark = pytest.mark.cuda

CFG = DecoderConfig(
    vocab=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, max_seq=16, max_batch=64
)
SPECS = [
    InputSpec("tokens", (CFG.max_batch,), torch.long),
    InputSpec("positions", (CFG.max_batch,), torch.long),
]


def decoder():
    torch.manual_seed(0)
    return TinyDecoder(CFG).cuda().eval()


def dummy(bucket):
    z = torch.zeros(bucket.rows, dtype=torch.long, device="cuda")
    return {"tokens": z, "positions": z.clone()}


def reset_cache(model):
    model.k_cache.zero_()
    model.v_cache.zero_()


@torch.no_grad()
def test_decode_tokens_equal_eager_for_every_bucket_and_padded_sizes():
    model = decoder()
    runner = GraphRunner(lambda tokens, positions: model(tokens, positions), SPECS, device="cuda")
    runner.capture(dummy)
    assert runner.dropped_buckets == {}
    try:
        for batch in (1, 2, 3, 4, 5, 8, 16, 32, 33, 64):
            gen = torch.Generator(device="cuda").manual_seed(batch)
            prompts = torch.randint(0, CFG.vocab, (batch, 4), device="cuda", generator=gen)
            reset_cache(model)
            want = greedy_decode(model, prompts, 6)
            reset_cache(model)
            got = greedy_decode(lambda t, p: runner.run({"tokens": t, "positions": p}), prompts, 6)
            assert torch.equal(got, want), f"batch {batch}"
        # Every step replayed a graph (an eager run would equal eager trivially).
        stats = runner.stats()
        assert stats["eager_runs"] == {}, stats
        assert sum(stats["replays"].values()) == 10 * (4 + 6 - 1), stats
    finally:
        runner.close()


@torch.no_grad()
def test_a_bucket_whose_capture_fails_is_dropped_and_the_others_serve():
    model = decoder()

    def forward(tokens, positions):
        if tokens.shape[0] == 8 and torch.cuda.is_current_stream_capturing():
            tokens.sum().item()  # a host sync: invalid inside capture
        return model(tokens, positions)

    runner = GraphRunner(forward, SPECS, device="cuda", require_all_buckets=False)
    runner.capture(dummy)
    try:
        assert list(runner.dropped_buckets) == [Bucket(8)]
        assert runner.select(6) == Bucket(16)
        prompts = torch.randint(0, CFG.vocab, (6, 4), device="cuda")
        reset_cache(model)
        want = greedy_decode(model, prompts, 4)
        reset_cache(model)
        got = greedy_decode(lambda t, p: runner.run({"tokens": t, "positions": p}), prompts, 4)
        assert torch.equal(got, want)
        assert runner.stats()["replays"]["bucket(bs=16)"] == 4 + 4 - 1, runner.stats()
        assert runner.stats()["eager_runs"] == {}
        torch.rand(2, device="cuda")  # the generator left capture mode
    finally:
        runner.close()


@torch.no_grad()
def test_a_tight_memory_budget_drops_the_expensive_buckets():
    # A forward whose temporaries grow with the rows (4 MiB per row), so pool bytes
    # differ between buckets by far more than the allocator's segment rounding.
    weight = torch.randn(1024, 1024, device="cuda")

    def forward(x):
        return (x[:, :, None] * weight[None]).sum(-1)

    specs = [InputSpec("x", (64, 1024), torch.float32)]

    def inputs(bucket):
        return {"x": torch.ones(bucket.rows, 1024, device="cuda")}

    runner_all = GraphRunner(forward, specs, device="cuda")
    runner_all.capture(inputs, plan_memory=True)  # measures every bucket; all fit
    plan = runner_all.memory_plan
    used = runner_all.memory_used
    runner_all.close()
    # The all-bucket pool is about the largest bucket's: within 1.5x of the prediction.
    assert 0 < used.pool_bytes <= 1.5 * plan.predicted_pool_bytes, used.against(plan)
    assert len(plan.chosen) == 7 and plan.predicted_pool_bytes >= 64 * 4 * 2**20, plan
    budget = plan.eager_reserve_bytes + plan.predicted_bytes // 2
    runner = GraphRunner(forward, specs, device="cuda", require_all_buckets=False)
    runner.capture(inputs, plan_memory=True, free_bytes=budget)
    try:
        assert Bucket(64) in runner.dropped_buckets, runner.memory_plan.describe()
        assert "memory plan" in runner.dropped_buckets[Bucket(64)]
        assert Bucket(1) in runner.graphs and Bucket(8) in runner.graphs
        x = torch.randn(3, 1024, device="cuda")
        torch.testing.assert_close(runner.run({"x": x}), forward(x))
        assert runner.stats()["replays"]["bucket(bs=4)"] == 1, runner.stats()
    finally:
        runner.close()


@torch.no_grad()
def test_piecewise_region_with_static_outputs_equals_eager():
    model = decoder()
    layer = model.layers[0]

    def region(x, positions):
        return layer(x, positions, model.k_cache[0], model.v_cache[0])

    # Static inputs are sized for the largest bucket (8).
    specs = [
        InputSpec("x", (8, CFG.hidden), torch.float32),
        InputSpec("positions", (8,), torch.long),
    ]
    runner = GraphRunner(
        region, specs, BucketConfig(batch_sizes=(4, 8)), device="cuda", static_outputs=True
    )
    runner.capture(
        lambda b: {
            "x": torch.zeros(b.rows, CFG.hidden, device="cuda"),
            "positions": torch.zeros(b.rows, dtype=torch.long, device="cuda"),
        }
    )
    try:
        x = torch.randn(5, CFG.hidden, device="cuda")
        pos = torch.zeros(5, dtype=torch.long, device="cuda")
        got = runner.run({"x": x, "positions": pos}).clone()
        want = region(x, pos)
        assert torch.equal(got, want)
        assert runner.stats()["replays"] == {"bucket(bs=8)": 1, "bucket(bs=4)": 0}
    finally:
        runner.close()


@torch.no_grad()
def test_all_buckets_reserve_little_more_than_the_largest_alone():
    # Every bucket captures on the pool's one capture stream: one cuBLAS workspace in
    # the pool, not one per bucket, and smaller buckets reuse the largest one's memory.
    model = decoder()

    def reserved_by(config):
        runner = GraphRunner(lambda tokens, positions: model(tokens, positions), SPECS, config)
        torch.cuda.synchronize()
        # The capture drops torch's eager cuBLAS workspaces (GraphMemoryPool.
        # capture_stream): drop them first, so that both measurements start alike
        # whatever earlier tests left.
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        runner.capture(dummy)
        grown = torch.cuda.memory_reserved() - before
        runner.close()
        torch.cuda.empty_cache()
        return grown

    alone = reserved_by(BucketConfig(batch_sizes=(64,)))
    every = reserved_by(BucketConfig())
    # The largest bucket alone warms up inside the pool only; the second bucket's warmup
    # runs on the warmup stream, outside it, and makes that stream's one cuBLAS
    # workspace (32 MiB on Hopper). A workspace per bucket would be six more.
    workspace = 32 * 2**20
    assert every <= alone + workspace + 16 * 2**20, (
        f"all buckets {every} bytes, largest alone {alone}"
    )


@torch.no_grad()
def test_compiled_forward_is_captured_per_bucket_and_matches_eager():
    # torch.compile (inductor) compiles each bucket's shape during its warmup; the
    # capture then records the compiled kernels without recompiling.
    model = decoder()
    runner = GraphRunner(
        lambda tokens, positions: model(tokens, positions),
        SPECS,
        BucketConfig(batch_sizes=(2, 4, 64)),
        device="cuda",
        compile_options={"dynamic": False},
    )
    runner.capture(dummy)
    try:
        assert runner.dropped_buckets == {}
        for batch in (2, 3):
            tokens = torch.randint(0, CFG.vocab, (batch,), device="cuda")
            positions = torch.zeros(batch, dtype=torch.long, device="cuda")
            reset_cache(model)
            want = model(tokens, positions)
            reset_cache(model)
            got = runner.run({"tokens": tokens, "positions": positions})
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        runner.close()


def test_refused_runs_leave_the_runner_replaying_eagers_result():
    """Every refused call of run() ends in a typed error naming the input; the good
    call after it replays (counted) and equals eager."""
    from cudagraphs.errors import CudaGraphsError

    def fn(x, scale):
        return x * scale + 1.0

    specs = [
        InputSpec("x", (16, 8), torch.float32),
        InputSpec("scale", (16, 1), torch.float32),
    ]
    runner = GraphRunner(fn, specs, BucketConfig(batch_sizes=(4, 8, 16)), device="cuda")
    runner.capture(
        lambda b: {
            "x": torch.zeros(b.rows, 8, device="cuda"),
            "scale": torch.ones(b.rows, 1, device="cuda"),
        }
    )

    def good(n, seed):
        g = torch.Generator().manual_seed(seed)
        return {
            "x": torch.randn(n, 8, generator=g).cuda(),
            "scale": torch.rand(n, 1, generator=g).cuda(),
        }

    def changed(**kw):
        b = good(5, 0)
        b.update(kw)
        return b

    bad = [
        (changed(x=good(5, 0)["x"].double()), r"inputs\['x'\]: dtype"),
        (changed(x=good(5, 0)["x"].requires_grad_(True)), r"inputs\['x'\]: requires_grad"),
        (changed(x=good(5, 0)["x"].cpu()), r"inputs\['x'\]"),
        (changed(scale=torch.ones(6, 1, device="cuda")), r"row counts"),
        (changed(x=torch.zeros(5, 9, device="cuda")), r"inputs\['x'\]: shape"),
        ({"x": good(5, 0)["x"]}, r"names expected"),
    ]
    try:
        for i, (inputs, match) in enumerate(bad):
            with pytest.raises(CudaGraphsError, match=match):
                runner.run(inputs)
            batch = good(3 + 2 * i, seed=i)
            before = sum(runner.stats()["replays"].values())
            out = runner.run(batch)
            assert torch.equal(out, fn(batch["x"], batch["scale"]))
            assert sum(runner.stats()["replays"].values()) == before + 1
        assert runner.stats()["eager_runs"] == {}
    finally:
        runner.close()
