"""Drop-in at Transformer Engine, Megatron and torch call sites, on the CPU: the
signature in Transformer Engine's order, its quantization arguments, torch's pool
position, the pools users have, and the capturing state other code reads (with a
stand-in for Transformer Engine's graph module)."""

import inspect
import sys
import threading
import types

import pytest
import torch
from torch import nn

import cudagraphs
from cudagraphs import (
    CudaGraphsError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    GraphMemoryPool,
    QuantizationNotSupportedError,
    is_graph_capturing,
    make_graphed_callables,
)
from cudagraphs.capture import as_graph_pool
from cudagraphs.capture_state import TE_GRAPH_MODULE, capture_scope
from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec
from helpers.dropin import FakeTE, past_the_argument_checks

# Transformer Engine's positional parameters (2.x names), in its order.
TE_ORDER = [
    "modules",
    "sample_args",
    "num_warmup_iters",
    "allow_unused_input",
    "sample_kwargs",
    "enabled",
    "calibrating",
    "recipe",
    "amax_reduction_group",
    "cache_quantized_params",
    "_order",
    "_num_layers_per_chunk",
    "pool",
    "retain_graph_in_backward",
    "_reuse_graph_input_output_buffers",
]


def lin():
    return nn.Linear(4, 4)


def x():
    return torch.randn(2, 4)


# ---- the signature -------------------------------------------------------------------------
def test_positional_parameters_follow_transformer_engine():
    params = list(inspect.signature(make_graphed_callables).parameters.values())
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == TE_ORDER
    keyword_only = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    assert {
        "fp8_enabled",
        "fp8_calibrating",
        "fp8_recipe",
        "fp8_group",
        "fp8_weight_caching",
        "clone_param_grads_on_return",
        "pre_warmup_hook",
        "post_warmup_hook",
        "capture_time_hooks",
        "accumulate_grads_in_graph",
        "main_grad_attr",
    } <= keyword_only


def test_a_sixteenth_positional_argument_is_refused_not_misplaced():
    with pytest.raises(TypeError, match="positional argument"):
        make_graphed_callables(lin(), (x(),), *([None] * 13), True)


# ---- quantization arguments ----------------------------------------------------------------
RECIPE = object()  # stands for a TE recipe: accepted, unused, while quantization is off
GROUP = object()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enabled": False, "recipe": RECIPE, "amax_reduction_group": GROUP},
        {"enabled": None, "calibrating": False, "cache_quantized_params": True},
        {"fp8_enabled": False, "fp8_recipe": RECIPE, "fp8_group": GROUP},
        {"fp8_weight_caching": True, "fp8_calibrating": False},
        {"enabled": (False, False)},
        {"enabled": False, "fp8_enabled": False},
    ],
    ids=["te2", "te2_caching", "te1", "te1_caching", "per_module", "both_names_agree"],
)
def test_quantization_arguments_that_leave_it_off_are_accepted(kwargs):
    past_the_argument_checks(lambda: make_graphed_callables(lin(), (x(),), **kwargs))


def test_quantization_arguments_in_transformer_engine_positions_are_accepted():
    # As a TE 1.x call site passes them: fp8_enabled, fp8_calibrating, fp8_recipe,
    # fp8_group, fp8_weight_caching after sample_kwargs.
    past_the_argument_checks(
        lambda: make_graphed_callables(
            lin(), (x(),), 3, False, None, False, False, RECIPE, GROUP, True
        )
    )


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"enabled": True}, "enabled=True"),
        ({"fp8_enabled": True, "fp8_recipe": RECIPE}, "fp8_enabled=True"),
        ({"calibrating": True}, "calibrating=True"),
        ({"fp8_calibrating": True}, "fp8_calibrating=True"),
        ({"enabled": (False, True)}, r"enabled=\(False, True\)"),
    ],
)
def test_quantization_turned_on_is_refused_naming_the_argument(kwargs, named):
    with pytest.raises(QuantizationNotSupportedError, match=named) as info:
        make_graphed_callables(lin(), (x(),), **kwargs)
    assert isinstance(info.value, NotImplementedError)
    assert isinstance(info.value, CudaGraphsError)
    assert "transformer_engine.pytorch.make_graphed_callables" in str(info.value)


def test_quantization_turned_on_positionally_is_refused():
    with pytest.raises(QuantizationNotSupportedError, match="enabled=True"):
        make_graphed_callables(lin(), (x(),), 3, False, None, True)


def test_both_names_of_one_argument_must_agree():
    with pytest.raises(CudaGraphsValueError, match="enabled=False and .* fp8_enabled=True"):
        make_graphed_callables(lin(), (x(),), enabled=False, fp8_enabled=True)


# ---- torch's positional order --------------------------------------------------------------
@pytest.mark.parametrize(
    "pool", [(0, 1), GraphMemoryPool(handle=(0, 1))], ids=["handle", "graph_pool"]
)
def test_a_pool_passed_fifth_is_named_as_a_pool(pool):
    # torch: make_graphed_callables(callables, sample_args, warmup, allow_unused, pool)
    with pytest.raises(
        CudaGraphsTypeError, match="torch.cuda.make_graphed_callables takes pool fifth"
    ):
        make_graphed_callables((lin(), lin()), ((x(),), (x(),)), 3, False, pool)
    with pytest.raises(CudaGraphsTypeError, match=r"pool=pool"):
        make_graphed_callables(lin(), (x(),), 3, False, pool)


def test_two_dicts_fifth_are_still_sample_kwargs():
    past_the_argument_checks(
        lambda: make_graphed_callables(
            (lambda a, b=None: a, lambda a, b=None: a), ((x(),), (x(),)), 3, False, ({}, {})
        )
    )


# ---- pools users have ----------------------------------------------------------------------
class _HasGraphPool:
    """What a CudaGraphPool looks like to as_graph_pool (it needs CUDA to build)."""

    def __init__(self):
        self.graph_pool = GraphMemoryPool(handle=(7, 8))


def test_pool_accepts_handles_graph_pools_and_program_pools():
    gp = GraphMemoryPool(handle=(1, 2))
    assert as_graph_pool(gp) is gp
    assert as_graph_pool((3, 4)).handle == (3, 4)
    owner = _HasGraphPool()
    assert as_graph_pool(owner) is owner.graph_pool
    assert isinstance(as_graph_pool(None), GraphMemoryPool)


@pytest.mark.parametrize("bad", [3, "pool", (1, 2, 3), (1.0, 2.0), [1, 2]])
def test_pool_of_another_kind_is_a_type_error(bad):
    with pytest.raises(CudaGraphsTypeError, match="pool must be a cudagraphs.GraphMemoryPool"):
        as_graph_pool(bad)


def test_pool_is_checked_before_any_gpu_work():
    with pytest.raises(CudaGraphsTypeError, match="pool must be"):
        make_graphed_callables(lin(), (x(),), pool="shared")


def test_a_mem_pool_is_kept_alive_with_its_handle():
    mem_pool_cls = getattr(torch.cuda, "MemPool", None)
    if not isinstance(mem_pool_cls, type):
        pytest.skip("this torch has no torch.cuda.MemPool")
    try:
        mem_pool = mem_pool_cls()
    except Exception as exc:  # a CPU build cannot make one
        pytest.skip(f"torch.cuda.MemPool() is not available here: {exc}")
    wrapped = as_graph_pool(mem_pool)
    assert wrapped.handle == tuple(mem_pool.id) and wrapped._owner is mem_pool


# ---- the capturing state -------------------------------------------------------------------
def test_capture_scope_nests_and_restores():
    assert not is_graph_capturing()
    with capture_scope():
        assert is_graph_capturing()
        with capture_scope():
            assert is_graph_capturing()
        assert is_graph_capturing()
    assert not is_graph_capturing()


def test_a_failing_scope_never_leaves_capturing_set():
    with pytest.raises(RuntimeError, match="boom"), capture_scope():
        raise RuntimeError("boom")
    assert not is_graph_capturing()


def test_capturing_is_per_thread():
    seen = []
    with capture_scope():
        thread = threading.Thread(target=lambda: seen.append(is_graph_capturing()))
        thread.start()
        thread.join()
    assert seen == [False]


@pytest.fixture
def fake_te(monkeypatch):
    te = FakeTE()
    monkeypatch.setitem(sys.modules, TE_GRAPH_MODULE, te)
    return te


def test_transformer_engine_flag_is_set_around_the_outermost_scope(fake_te):
    with capture_scope():
        assert fake_te.is_graph_capturing()
        with capture_scope():
            assert fake_te.calls == ["start"]
        assert fake_te.is_graph_capturing()  # the inner scope leaves TE's flag alone
    assert fake_te.calls == ["start", "end"] and not fake_te.is_graph_capturing()


def test_transformer_engine_flag_is_restored_when_the_scope_fails(fake_te):
    with pytest.raises(ValueError, match="capture failed"), capture_scope():
        raise ValueError("capture failed")
    assert fake_te.calls == ["start", "end"] and not fake_te.is_graph_capturing()


def test_a_transformer_engine_capture_in_progress_keeps_its_flag(monkeypatch):
    te = FakeTE(capturing=True)  # inside TE's own make_graphed_callables
    monkeypatch.setitem(sys.modules, TE_GRAPH_MODULE, te)
    with capture_scope():
        assert is_graph_capturing()
    assert te.calls == [] and te.flag


def test_a_transformer_engine_without_the_functions_is_left_alone(monkeypatch):
    module = types.ModuleType(TE_GRAPH_MODULE)
    monkeypatch.setitem(sys.modules, TE_GRAPH_MODULE, module)
    with capture_scope():
        assert is_graph_capturing()


def test_the_runner_capture_is_a_capturing_scope_and_its_runs_are_not(fake_te, monkeypatch):
    # GraphRunner on the CPU with an eager stand-in capture: its warmup and capture see
    # the state (ours and TE's), its runs do not.
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    states = []

    def forward(x):
        states.append((is_graph_capturing(), fake_te.is_graph_capturing()))
        return x * 2

    def backend(run, pool, what):
        out = run()

        class Replay:
            def replay(self):
                out.copy_(run())

            def reset(self):
                pass

        return Replay(), out

    runner = GraphRunner(
        forward,
        [InputSpec("x", (4, 3), torch.float32)],
        BucketConfig(batch_sizes=(2, 4)),
        device="cpu",
        capture_backend=backend,
    )
    runner.capture(lambda b: {"x": torch.zeros(b.rows, 3)}, warmup=1)
    assert states and all(s == (True, True) for s in states)
    assert fake_te.calls == ["start", "end"]
    states.clear()
    runner.run({"x": torch.ones(3, 3)})
    assert states == [(False, False)]


def test_is_graph_capturing_is_exported():
    assert cudagraphs.is_graph_capturing is is_graph_capturing
