"""The serving contract with real CUDA graphs (issue 13): a wrong output_row_dim is
refused at capture naming the output, a bucket whose memory measurement fails is
dropped while the others capture and replay equal to eager, CUDAGRAPHS_DISABLE=1 gives
the graphed runner's results without capturing, and lossless input dtypes are
converted by the staging copy."""

import pytest
import torch

from cudagraphs.capture import EagerGraph
from cudagraphs.errors import CudaGraphOutputError
from cudagraphs.models import DecoderConfig, TinyDecoder, greedy_decode
from cudagraphs.serving import Bucket, BucketConfig, GraphRunner, InputSpec
from cudagraphs.settings import DISABLE_ENV

pytestmark = pytest.mark.cuda

WIDTH = 48  # no bucket has 48 rows: a wrong row dim cannot hold the rows by chance
ROW_SPECS = [
    InputSpec("x", (64, WIDTH), torch.float32),
    InputSpec("scale", (64, 1), torch.float32),
]


def row_forward(x, scale):
    return {"y": x * scale + 1.0}


def row_inputs(bucket):
    return {
        "x": torch.zeros(bucket.rows, WIDTH, device="cuda"),
        "scale": torch.ones(bucket.rows, 1, device="cuda"),
    }


def row_batch(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "x": torch.randn(n, WIDTH, device="cuda", generator=g),
        "scale": torch.rand(n, 1, device="cuda", generator=g),
    }


@pytest.fixture(autouse=True)
def _graphs_enabled(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)


@pytest.mark.parametrize("row_dim", [1, -1])
@torch.no_grad()
def test_wrong_output_row_dim_is_refused_naming_the_output(row_dim):
    runner = GraphRunner(
        row_forward, ROW_SPECS, device="cuda", output_row_dim=row_dim, require_all_buckets=False
    )
    with pytest.raises(
        CudaGraphOutputError,
        match=(
            rf"outputs of bucket\(bs=64\) do not hold its 64 rows in output_row_dim={row_dim}"
            rf"[\s\S]*output\['y'\]: shape expected 64 rows in dim {row_dim}, received \(64, 48\)"
            r"[\s\S]*1\. set output_row_dim"
        ),
    ):
        runner.capture(row_inputs)
    assert runner.graphs == {} and runner.dropped_buckets == {}
    # The failed capture left CUDA usable: the generator is out of capture mode and the
    # same runner captures once the configuration is right.
    torch.rand(2, device="cuda")
    runner.output_row_dim = 0
    runner.capture(row_inputs)
    try:
        inputs = row_batch(5, seed=5)
        torch.testing.assert_close(runner.run(inputs)["y"], row_forward(**inputs)["y"])
        assert runner.stats()["replays"]["bucket(bs=8)"] == 1
    finally:
        runner.close()


@pytest.mark.parametrize("row_dim", [1, -1])
@torch.no_grad()
def test_rows_in_the_last_dim_replay_equal_to_eager(row_dim):
    def transposed(x, scale):
        return (x * scale + 1.0).t().contiguous()  # [width, rows]

    runner = GraphRunner(
        transposed, ROW_SPECS, BucketConfig(batch_sizes=(4, 64)), output_row_dim=row_dim
    )
    runner.capture(row_inputs)
    try:
        for n in (3, 4, 40):
            inputs = row_batch(n, seed=n)
            got = runner.run(inputs, copy_output=True)
            assert got.shape == (WIDTH, n)
            torch.testing.assert_close(got, transposed(**inputs))
        assert runner.stats()["replays"] == {"bucket(bs=64)": 1, "bucket(bs=4)": 2}
        assert runner.stats()["eager_runs"] == {}
    finally:
        runner.close()


@torch.no_grad()
def test_a_bucket_whose_measurement_fails_is_dropped_and_the_others_serve():
    def forward(x, scale):
        if x.shape[0] == 8:
            x.sum().item()  # a host sync: fine eagerly, invalid inside a capture
        return x * scale + 1.0

    runner = GraphRunner(forward, ROW_SPECS, device="cuda", require_all_buckets=False)
    runner.capture(row_inputs, plan_memory=True)
    try:
        assert list(runner.dropped_buckets) == [Bucket(8)]
        assert runner.dropped_buckets[Bucket(8)].startswith("memory measurement failed: ")
        plan = runner.memory_plan
        assert Bucket(8) not in plan.chosen and Bucket(8) not in plan.dropped
        assert sorted(b.batch_size for b in runner.graphs) == [1, 2, 4, 16, 32, 64]
        assert runner.select(6) == Bucket(16)
        for n in (3, 6, 64):
            inputs = row_batch(n, seed=n)
            torch.testing.assert_close(runner.run(inputs), forward(**inputs))
        replays = runner.stats()["replays"]
        assert replays["bucket(bs=4)"] == 1 and replays["bucket(bs=16)"] == 1
        assert replays["bucket(bs=64)"] == 1 and runner.stats()["eager_runs"] == {}
        torch.rand(2, device="cuda")  # the generator left capture mode
    finally:
        runner.close()


CFG = DecoderConfig(
    vocab=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, max_seq=16, max_batch=64
)
DECODE_SPECS = [
    InputSpec("tokens", (CFG.max_batch,), torch.long),
    InputSpec("positions", (CFG.max_batch,), torch.long),
]

SPECS_UP_TO_8 = [
    InputSpec("tokens", (8,), torch.long),
    InputSpec("positions", (8,), torch.long),
]


def decoder():
    torch.manual_seed(0)
    return TinyDecoder(CFG).cuda().eval()


def decode_dummy(bucket):
    z = torch.zeros(bucket.rows, dtype=torch.long, device="cuda")
    return {"tokens": z, "positions": z.clone()}


def decode_with(model, step, prompts, new_tokens=5):
    model.k_cache.zero_()
    model.v_cache.zero_()
    return greedy_decode(step, prompts, new_tokens)


@torch.no_grad()
def test_disabled_runner_equals_the_graphed_runner_and_eager(monkeypatch):
    model = decoder()
    config = BucketConfig(batch_sizes=(2, 4, 8))
    runners = {}
    for mode in ("graphed", "disabled"):
        if mode == "disabled":
            monkeypatch.setenv(DISABLE_ENV, "1")
        runner = GraphRunner(
            lambda tokens, positions: model(tokens, positions), SPECS_UP_TO_8, config
        )
        runner.capture(decode_dummy)
        runners[mode] = runner
    try:
        graphed, disabled = runners["graphed"], runners["disabled"]
        assert graphed.stats()["disabled"] is False and len(graphed.stats()["captured"]) == 3
        assert disabled.stats()["disabled"] is True and disabled.stats()["captured"] == []
        assert all(isinstance(g.graph, EagerGraph) for g in disabled.graphs.values())
        assert not any(isinstance(g.graph, EagerGraph) for g in graphed.graphs.values())
        for batch in (1, 3, 8):
            gen = torch.Generator(device="cuda").manual_seed(batch)
            prompts = torch.randint(0, CFG.vocab, (batch, 4), device="cuda", generator=gen)
            want = decode_with(model, model, prompts)
            for runner in (graphed, disabled):
                got = decode_with(
                    model, lambda t, p, r=runner: r.run({"tokens": t, "positions": p}), prompts
                )
                assert torch.equal(got, want), (batch, runner.stats())
        steps = 3 * (4 + 5 - 1)
        assert sum(graphed.stats()["replays"].values()) == steps
        assert disabled.stats()["eager_runs"] == {"disabled": steps}
    finally:
        for runner in runners.values():
            runner.close()


@torch.no_grad()
def test_int32_tokens_are_converted_by_the_staging_copy():
    model = decoder()
    runner = GraphRunner(
        lambda tokens, positions: model(tokens, positions), DECODE_SPECS, BucketConfig((4, 64))
    )
    runner.capture(decode_dummy)
    try:
        prompts = torch.randint(0, CFG.vocab, (3, 4), device="cuda")
        want = decode_with(model, model, prompts)
        got = decode_with(
            model,
            lambda t, p: runner.run({"tokens": t.int(), "positions": p.int()}),
            prompts,
        )
        assert torch.equal(got, want)
        assert runner.stats()["replays"]["bucket(bs=4)"] == 4 + 5 - 1
    finally:
        runner.close()
