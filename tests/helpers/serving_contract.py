"""Helpers of the runner's contract CPU tests (tests/serving/test_serving_contract*.py):
input specs and a small bucket config, a runner over them, a capture stand-in whose
output is a tree, and the warnings a log holds about a subject."""

import logging

import torch

from cudagraphs.serving import (
    BucketConfig,
    GraphRunner,
    InputSpec,
)
from helpers.serving_runner import (
    HIDDEN,
    forward,
)

RUNNER_LOG = "cudagraphs.serving.runner"


SPECS = [
    InputSpec("x", (4, HIDDEN), torch.float32),
    InputSpec("scale", (4, 1), torch.float32),
]


SMALL = BucketConfig(batch_sizes=(1, 2, 4))


def small_runner(fwd=forward, backend=None, **kw):
    return GraphRunner(
        fwd, SPECS, kw.pop("config", SMALL), device="cpu", capture_backend=backend, **kw
    )


class TreeEagerGraph:
    """An eager stand-in for a capture whose output is a tree (copies every leaf)."""

    def __init__(self, run, output):
        self.run, self.output = run, output

    def replay(self):
        new = torch.utils._pytree.tree_leaves(self.run())
        with torch.no_grad():
            for buf, x in zip(torch.utils._pytree.tree_leaves(self.output), new):
                if isinstance(buf, torch.Tensor):
                    buf.copy_(x)

    def reset(self):
        pass


def tree_backend(run, pool, what):
    out = run()
    return TreeEagerGraph(run, out), out


def warnings_about(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]
