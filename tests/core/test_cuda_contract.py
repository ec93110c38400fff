"""The package-wide contract on a real GPU, for the core and programs: what used to be
silently wrong is refused, what users pass is accepted, and CUDAGRAPHS_DISABLE runs
the same paths eagerly with results equal to the graphed ones."""

import copy
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import cudagraphs
from cudagraphs import (
    CudaGraphInputError,
    CudaGraphProgram,
    CudaGraphsValueError,
    SignatureMismatchError,
    graph_stack,
    make_graphed_callables,
)
from cudagraphs.capture import EagerGraph
from cudagraphs.settings import DISABLE_ENV
from helpers.asserts import assert_bitwise_equal

pytestmark = pytest.mark.cuda

Pair = namedtuple("Pair", "x scale")


def _randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)
    return t.requires_grad_(requires_grad)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).cuda()


# ---- wrong results that are refused now ---------------------------------------------------
def test_a_buffer_that_requires_grad_is_refused_before_capture():
    module = _mlp()
    module.register_buffer("bias2", torch.zeros(16, device="cuda", requires_grad=True))
    with pytest.raises(CudaGraphsValueError, match=r"buffer\(s\) \['bias2'\]"):
        make_graphed_callables(module, (_randn(4, 16),))
    assert "forward" not in module.__dict__  # nothing was installed
    module.bias2.requires_grad_(False)
    make_graphed_callables(module, (_randn(4, 16),))
    assert module.cuda_graph.graphs.fwd_graph is not None


def test_program_inputs_on_meta_or_sparse_are_refused_before_any_byte_is_copied():
    program = CudaGraphProgram.capture(
        lambda x, y: x @ y, example_inputs=(_randn(4, 4), _randn(4, 4, seed=1))
    )
    try:
        x, y = _randn(4, 4, seed=2), _randn(4, 4, seed=3)
        expected = (x @ y).clone()
        assert_bitwise_equal(program.replay(x, y, synchronize=True), expected, "good replay")
        before = [t.clone() for t in program._buffer.tensors]
        for bad in (
            (_randn(4, 4, seed=4), torch.empty(4, 4, device="meta")),
            (_randn(4, 4, seed=4), _randn(4, 4, seed=5).to_sparse_csr()),
        ):
            for call in (program.replay, program.copy_inputs_from):
                with pytest.raises(SignatureMismatchError, match=r"inputs\[1\]: (device|layout)"):
                    call(*bad)
                torch.cuda.synchronize()
                for b, t in zip(before, program._buffer.tensors):
                    assert torch.equal(b, t), "a rejected input reached the buffer"
        assert_bitwise_equal(program.replay(x, y, synchronize=True), expected, "after refusals")
    finally:
        program.close()


# ---- accept what users pass ----------------------------------------------------------------
def test_a_lossless_dtype_is_converted_into_the_captured_input():
    # As under autocast: a bf16 activation into a graph captured with an fp32 input.
    graphed_mod = _mlp()
    eager_mod = copy.deepcopy(graphed_mod)
    make_graphed_callables(graphed_mod, (_randn(4, 16, requires_grad=True),))
    x = _randn(4, 16, seed=1, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = graphed_mod(x)
    out_ref = eager_mod(x_ref.float())
    assert_bitwise_equal(out, out_ref, "output of a converted input")
    grad = _randn(4, 16, seed=2)
    out.backward(grad)
    out_ref.backward(grad)
    assert x.grad.dtype == torch.bfloat16  # autograd hands the input its own dtype back
    assert_bitwise_equal(x.grad, x_ref.grad, "gradient of the converted input")
    assert_bitwise_equal(graphed_mod[0].weight.grad, eager_mod[0].weight.grad, "weight grad")
    with pytest.raises(CudaGraphInputError, match=r"args\[0\]: dtype expected torch.float32"):
        graphed_mod(_randn(4, 16, seed=3, dtype=torch.float64))


def test_graph_stack_of_a_module_list_graphs_its_layers():
    layers = nn.ModuleList(_mlp(seed=i) for i in range(3))
    eager = copy.deepcopy(layers)
    stack = graph_stack(layers, (_randn(4, 16, requires_grad=True),))
    assert list(stack.layers) == list(layers)
    x = _randn(4, 16, seed=5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = stack(x)
    ref = x_ref
    for layer in eager:
        ref = layer(ref)
    assert_bitwise_equal(out, ref, "stack output")
    # A dense incoming gradient: sum()'s is an expanded tensor (stride 0), which eager
    # matmuls read with another kernel than the graph's dense static buffer.
    grad = _randn(4, 16, seed=6)
    out.backward(grad)
    ref.backward(grad)
    assert_bitwise_equal(layers[0][0].weight.grad, eager[0][0].weight.grad, "first layer grad")
    assert stack.cuda_graph.graphs.fwd_graph is not None and not stack.cuda_graph.graphs.eager_only


def _tree_fn(batch, extra):
    h = batch.x * batch.scale
    out = OrderedDict(y=h + extra["bias"], z=h.sum(0))
    return Pair(out, None)


def _tree_args(seed):
    return (
        Pair(_randn(8, 4, seed=seed), _randn(4, seed=seed + 1)),
        OrderedDict(bias=_randn(8, 4, seed=seed + 2)),
    )


@pytest.mark.parametrize("staging", ["copy", "auto"])
def test_programs_take_and_return_namedtuples_ordereddicts_and_none(staging):
    program = CudaGraphProgram.capture(_tree_fn, example_inputs=_tree_args(0), staging=staging)
    try:
        for seed in (10, 20):
            args = _tree_args(seed)
            out = program.replay(*args, copy_output=True)
            ref = _tree_fn(*args)
            assert type(out) is Pair and type(out.x) is OrderedDict and out.scale is None
            for key in ("y", "z"):
                assert_bitwise_equal(out.x[key], ref.x[key], f"output {key}, seed {seed}")
        with pytest.raises(SignatureMismatchError, match=r"inputs\[0\]: type expected 'Pair'"):
            program.replay(tuple(_tree_args(1)[0]), _tree_args(1)[1])
    finally:
        program.close()


def test_programs_take_and_return_hugging_face_model_outputs():
    transformers = pytest.importorskip("transformers")
    output_cls = transformers.modeling_outputs.CausalLMOutputWithPast

    def head(hidden, weight):
        logits = hidden @ weight
        return output_cls(logits=logits, loss=logits.float().pow(2).mean())

    example = (output_cls(logits=_randn(2, 8)), _randn(8, 16, seed=1))
    program = CudaGraphProgram.capture(lambda out, w: head(out.logits, w), example_inputs=example)
    try:
        args = (output_cls(logits=_randn(2, 8, seed=2)), _randn(8, 16, seed=3))
        out = program.replay(*args, copy_output=True)
        ref = head(args[0].logits, args[1])
        assert type(out) is output_cls
        assert_bitwise_equal(out.logits, ref.logits, "logits")
        assert_bitwise_equal(out.loss, ref.loss, "loss")
    finally:
        program.close()


# ---- CUDAGRAPHS_DISABLE: the same paths, eagerly ------------------------------------------
def test_disabled_make_graphed_callables_equals_graphed_and_captures_nothing(monkeypatch):
    graphed_mod, eager_mod = _mlp(), _mlp()
    make_graphed_callables(graphed_mod, (_randn(4, 16, requires_grad=True),))
    monkeypatch.setenv(DISABLE_ENV, "1")
    make_graphed_callables(eager_mod, (_randn(4, 16, requires_grad=True),))
    entry = eager_mod.cuda_graph.graphs
    assert entry.eager_only and entry.fwd_graph is None and entry.bwd_graph is None
    for seed in (1, 2):
        x = _randn(4, 16, seed=seed, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        out, ref = graphed_mod(x), eager_mod(x_ref)
        assert_bitwise_equal(out, ref, "output")
        grad = _randn(4, 16, seed=10 + seed)  # dense: see the graph_stack test
        out.backward(grad)
        ref.backward(grad)
        assert_bitwise_equal(x.grad, x_ref.grad, "input grad")
    assert_bitwise_equal(graphed_mod[2].weight.grad, eager_mod[2].weight.grad, "weight grad")
    with pytest.raises(CudaGraphInputError, match=r"args\[0\]: shape"):
        eager_mod(_randn(5, 16))  # validated as a replay would be


def test_disabled_program_runs_eagerly_into_the_same_borrowed_output(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    program = CudaGraphProgram.capture(_tree_fn, example_inputs=_tree_args(0))
    try:
        assert isinstance(program.cuda_graph, EagerGraph)
        first = program.replay(*_tree_args(30))
        y = first.x["y"]
        args = _tree_args(40)
        second = program.replay(*args)
        assert second.x["y"] is y  # borrowed and overwritten, as after a graph replay
        assert_bitwise_equal(second.x["y"], _tree_fn(*args).x["y"], "eager program output")
        handle = program.copy_inputs_from(*_tree_args(50))
        out = program.replay_prepared(copy_handle=handle, copy_output=True)
        assert_bitwise_equal(out.x["z"], _tree_fn(*_tree_args(50)).x["z"], "prefetched")
        with pytest.raises(SignatureMismatchError, match=r"inputs\[0\]: type expected 'Pair'"):
            program.replay(_randn(3), _tree_args(1)[1])
    finally:
        program.close()
    monkeypatch.delenv(DISABLE_ENV)
    graphed = CudaGraphProgram.capture(_tree_fn, example_inputs=_tree_args(0))
    try:
        assert not isinstance(graphed.cuda_graph, EagerGraph)
        assert_bitwise_equal(graphed.replay(*args).x["y"], _tree_fn(*args).x["y"], "graphed")
    finally:
        graphed.close()


def test_a_bad_disable_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "sometimes")
    with pytest.raises(CudaGraphsValueError, match="CUDAGRAPHS_DISABLE='sometimes'"):
        make_graphed_callables(_mlp(), (_randn(4, 16),))


def test_no_cuda_error_is_not_raised_where_cuda_exists():
    assert cudagraphs.new_pool() is not None
    cudagraphs.CudaGraphPool(0).close()
