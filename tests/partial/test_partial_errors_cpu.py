"""The partial-graph layer's argument and life-cycle errors (CPU only): each is typed
(CudaGraphsError and the builtin a caller expects) and names the argument or target
and the fix. tests/test_contract_cpu.py checks that no module raises anything else."""

import logging

import pytest
import torch

from cudagraphs.errors import (
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    TargetSelectionError,
)
from cudagraphs.partial import ContractSet, PartialCudaGraphManager, select_targets
from helpers.toy_models import Toy

# Attention and router targets (the scopes these tests are about; the default is
# every scope, which graphs these small blocks whole).
NARROW = ("attention", "moe_router")


def eager_backend(callables, sample_args, sample_kwargs):
    return list(callables)


def build(model=None, **kwargs):
    kwargs.setdefault("capture_backend", eager_backend)
    return PartialCudaGraphManager.from_model_parts(model or Toy(), **kwargs, scopes=NARROW)


def recorded_manager(model=None):
    model = model or Toy()
    mgr = build(model)
    mgr.start_recording()
    model(torch.randn(2, 8))
    return model, mgr


# --- wrong argument types and values name the argument ---------------------------------


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        (dict(max_variants=True), CudaGraphsTypeError, "max_variants must be an int, got bool"),
        (dict(max_variants=2.0), CudaGraphsTypeError, "max_variants must be an int, got float"),
        (dict(max_variants=0), CudaGraphsValueError, "max_variants must be an int >= 1, got 0"),
        (dict(capture_backend="core"), CudaGraphsTypeError, "capture_backend must be callable"),
        (
            dict(activation_checkpointing="yes"),
            CudaGraphsTypeError,
            "activation_checkpointing must be a bool, got str",
        ),
        (
            dict(activation_checkpointing=1),
            CudaGraphsTypeError,
            "activation_checkpointing must be a bool, got int",
        ),
        (dict(attention=None), CudaGraphsTypeError, "got attention=None; .* are retired"),
        (dict(router="no"), CudaGraphsTypeError, "got router='no'; .* are retired"),
        (dict(include=3), CudaGraphsTypeError, "include must be a glob pattern"),
        (dict(include=["*.q", None]), CudaGraphsTypeError, r"include\[1\] must be a glob"),
    ],
    # Plain ids: a backslash from a match pattern in a test id stops pytest (and the
    # mutation runs that select tests by id) from finding the test again.
    ids=lambda v: (
        "-".join(map(str, v)) if isinstance(v, dict) else getattr(v, "__name__", "message")
    ),
)
def test_from_model_parts_argument_errors(kwargs, error, named):
    with pytest.raises(error, match=named):
        build(**kwargs)


@pytest.mark.parametrize(
    "parts, named",
    [
        ("model", "model_parts must be an nn.Module or a sequence of them"),
        (5, "model_parts must be an nn.Module or a sequence of them .*got int"),
        ([Toy(), "stage1"], r"model_parts\[1\] must be an nn.Module, got str"),
        ((Toy(), None), r"model_parts\[1\] must be an nn.Module, got NoneType"),
    ],
    ids=["str", "int", "list with a str", "tuple with None"],
)
def test_model_parts_that_are_not_modules(parts, named):
    with pytest.raises(CudaGraphsTypeError, match=named):
        PartialCudaGraphManager.from_model_parts(
            parts, capture_backend=eager_backend, scopes=NARROW
        )


def test_arguments_are_checked_even_when_nothing_is_found():
    with pytest.raises(CudaGraphsTypeError, match="include must be"):
        PartialCudaGraphManager.from_model_parts([], include=7, scopes=NARROW)


def test_constructor_argument_errors():
    dispatcher = build().dispatchers[0]
    with pytest.raises(CudaGraphsTypeError, match=r"dispatchers\[1\] must be a TargetDispatcher"):
        PartialCudaGraphManager([dispatcher, "attn"])
    with pytest.raises(CudaGraphsTypeError, match="capture_backend must be callable"):
        PartialCudaGraphManager([dispatcher], capture_backend=3)
    with pytest.raises(CudaGraphsTypeError, match="activation_checkpointing must be a bool"):
        PartialCudaGraphManager([dispatcher], activation_checkpointing=None)


@pytest.mark.parametrize(
    "bad, error",
    [(True, CudaGraphsTypeError), ("4", CudaGraphsTypeError), (0, CudaGraphsValueError)],
)
def test_contract_set_max_variants(bad, error):
    with pytest.raises(error, match="max_variants"):
        ContractSet(bad)


def test_select_targets_argument_errors():
    with pytest.raises(CudaGraphsTypeError, match="model must be an nn.Module"):
        select_targets("model")
    with pytest.raises(CudaGraphsTypeError, match="select_targets got attention='yes'; "):
        select_targets(Toy(), attention="yes")


# --- life-cycle errors ----------------------------------------------------------------


def test_capture_with_nothing_recorded_is_a_state_error():
    mgr = build()
    with pytest.raises(CudaGraphsStateError, match="nothing was recorded.*start_recording"):
        mgr.capture()
    mgr.start_recording()
    with pytest.raises(CudaGraphsStateError, match="nothing was recorded"):
        mgr.capture()  # recording without a forward records nothing either


@pytest.mark.parametrize("method", ["start_recording", "capture"])
def test_use_after_close_is_a_state_error(method):
    _, mgr = recorded_manager()
    mgr.capture()
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(CudaGraphsStateError, match="was closed.*build a new one"):
        getattr(mgr, method)()


def test_a_target_called_twice_names_it_and_the_fix():
    model = Toy(twice=True)
    mgr = build(model)
    mgr.start_recording()
    model(torch.randn(2, 8))
    with pytest.raises(
        TargetSelectionError, match=r"layers\.0\.self_attn.*more than once.*Fix: leave"
    ):
        mgr.capture()


def test_a_module_shared_by_two_parts_names_both():
    first, second = Toy(), Toy()
    second.layers[1].self_attn = first.layers[0].self_attn
    with pytest.raises(
        TargetSelectionError, match=r"layers\.1\.self_attn is the same module as layers\.0"
    ):
        build([first, second])


def test_meta_parameters_name_the_parameter_and_the_fix():
    with torch.device("meta"):
        model = Toy()
    with pytest.raises(
        CudaGraphsValueError, match=r"layers\.0\.self_attn\.q\.weight is on the meta.*to_empty"
    ):
        build(model)


def test_a_backend_returning_the_wrong_count_is_named():
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=lambda callables, args, kwargs: list(callables)[:1], scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    with pytest.raises(CudaGraphsValueError, match="capture_backend returned 1 callable"):
        mgr.capture()


def test_a_bad_disable_flag_names_the_variable(monkeypatch):
    _, mgr = recorded_manager()
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "maybe")
    with pytest.raises(CudaGraphsValueError, match="CUDAGRAPHS_DISABLE='maybe'"):
        mgr.capture()


def test_a_disable_flag_flipped_after_the_first_capture(monkeypatch, caplog):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    model, mgr = recorded_manager()
    with caplog.at_level(logging.WARNING, logger="cudagraphs.partial.manager"):
        mgr.capture()
    assert mgr.stats()["disabled"] == 1 and mgr.stats()["captured"] == 0
    monkeypatch.delenv("CUDAGRAPHS_DISABLE")
    mgr.start_recording()
    model(torch.randn(3, 8))
    with pytest.raises(CudaGraphsStateError, match="graphs were disabled then, enabled now.*close"):
        mgr.capture()
