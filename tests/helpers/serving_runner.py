"""A GraphRunner on the CPU for the serving tests: a rows-independent function, its
input specs, an eager stand-in for CUDA capture (a "graph" that re-runs the function
into the captured output buffers) and synthetic bucket costs."""

import torch

from cudagraphs.serving import BucketConfig, BucketCost, GraphRunner, InputSpec

HIDDEN = 4


class EagerGraph:
    def __init__(self, run, output):
        self.run, self.output, self.was_reset = run, output, False

    def replay(self):
        with torch.no_grad():
            self.output.copy_(self.run())

    def reset(self):
        self.was_reset = True


def eager_backend(fail_on=()):
    captured = []

    def backend(run, pool, what):
        if what in {str(b) for b in fail_on}:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(what)
        out = run()
        return EagerGraph(run, out), out

    backend.captured = captured
    return backend


def forward(x, scale):
    # rows independent of each other, like a decode step
    return x * scale + 1.0


def make_runner(config=None, backend=None, **kw):
    specs = [
        InputSpec("x", (64, HIDDEN), torch.float32),
        InputSpec("scale", (64, 1), torch.float32, pad_value=0),
    ]
    return GraphRunner(
        forward,
        specs,
        config or BucketConfig(),
        device="cpu",
        capture_backend=backend or eager_backend(),
        **kw,
    )


def dummy(bucket):
    return {"x": torch.zeros(bucket.rows, HIDDEN), "scale": torch.ones(bucket.rows, 1)}


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, HIDDEN, generator=g), "scale": torch.rand(n, 1, generator=g)}


def synthetic_cost(bucket):
    mib = 1 << 20
    return BucketCost(
        bucket,
        eager_peak_bytes=bucket.rows * mib,
        pool_bytes=bucket.rows * 4 * mib,
        graph_nodes=100,
        exec_bytes_per_node=1024,
    )
