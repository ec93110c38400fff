"""GPU tests of compiled callables inside make_graphed_callables: a torch.compile'd
module graphs (inductor's kernels, forward and backward) and replays bit for bit like
the same compiled module run eagerly; one that still compiles in the last warmup
iteration is refused by name, and the next good call graphs."""

import copy

import pytest
import torch

import cudagraphs
from cudagraphs import CompiledCaptureError
from helpers.asserts import assert_bitwise_equal

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128, device="cuda", dtype=torch.bfloat16)
        self.down = torch.nn.Linear(128, 64, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Counted(torch.nn.Module):
    """Counts the Python calls of its forward: a replay makes none."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def test_a_compiled_module_replays_like_its_eager_compiled_self():
    block = Block()
    ref = copy.deepcopy(block)
    counted = Counted(torch.compile(block))
    ref_compiled = torch.compile(ref)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = cudagraphs.make_graphed_callables(counted, (x,))
    calls = counted.calls
    for seed in range(3):
        torch.manual_seed(seed)
        a = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = a.detach().clone().requires_grad_()
        out, ref_out = graphed(a), ref_compiled(b)
        assert_bitwise_equal(out, ref_out, f"output {seed}")
        out.float().sum().backward()
        ref_out.float().sum().backward()
        assert_bitwise_equal(a.grad, b.grad, f"input grad {seed}")
        for (name, p), q in zip(block.named_parameters(), ref.parameters()):
            assert_bitwise_equal(p.grad, q.grad, f"{name}.grad {seed}")
            p.grad = q.grad = None
    assert counted.calls == calls, "a graphed call ran the forward's Python: it did not replay"


def test_the_set_up_seconds_give_the_compile_apart_from_the_capture():
    compiled = Counted(torch.compile(Block()))
    eager = Counted(Block())
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = cudagraphs.make_graphed_callables(compiled, (x,))
    plain = cudagraphs.make_graphed_callables(eager, (x,))
    setup, eager_setup = graphed.cuda_graph.setup_seconds, plain.cuda_graph.setup_seconds
    # The warmup compiled the forward and, at its first backward, the backward.
    assert setup.compiled_frames >= 1
    assert 0 < setup.compile <= setup.warmup
    assert setup.capture > 0
    assert eager_setup.compile == 0 and eager_setup.compiled_frames == 0
    assert eager_setup.warmup > 0 and eager_setup.capture > 0
    calls = compiled.calls
    graphed(x).float().sum().backward()
    assert compiled.calls == calls, "the graphed call ran the forward's Python: no replay"


def test_a_callable_that_recompiles_every_iteration_is_refused_and_the_next_graphs():
    counter = {"n": 0}

    @torch.compile(dynamic=False)
    def shifted(x, n):
        return x * 2 + 0 * n

    def changing(x):
        counter["n"] += 1  # a new Python int each call: a guard fails every time
        return shifted(x, counter["n"])

    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with pytest.raises(CompiledCaptureError) as err:
        cudagraphs.make_graphed_callables(changing, (x,))
    text = str(err.value)
    assert "the last warmup iteration" in text and "shifted" in text
    assert "recompiled because" in text
    steady = torch.compile(lambda t: t * 2)
    graphed = cudagraphs.make_graphed_callables(steady, (x,))
    y = graphed(torch.ones(4, 8, device="cuda", requires_grad=True))
    assert torch.equal(y, torch.full((4, 8), 2.0, device="cuda"))
