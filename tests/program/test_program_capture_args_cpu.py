"""CudaGraphProgram.capture's argument checks, on the CPU (they run before anything
is allocated or captured; the GPU file checks the same cases end to end)."""

import pytest
import torch

from cudagraphs.program.graph_capture import check_capture_arguments


def _fn(x):
    return x + 1


def _check(function=_fn, example_inputs=None, warmup=3, pool=None, staging="auto"):
    if example_inputs is None:
        example_inputs = (torch.zeros(4),)
    return check_capture_arguments(function, example_inputs, warmup, pool, None, staging)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"function": 42}, TypeError, "function must be callable, got int"),
        ({"warmup": -1}, ValueError, "warmup must be an int >= 0"),
        ({"warmup": True}, TypeError, "warmup must be an int, got bool"),
        ({"warmup": 1.5}, TypeError, "warmup must be an int, got float"),
        ({"staging": "fast"}, ValueError, "staging must be one of"),
        ({"example_inputs": "abc"}, TypeError, "sequence of positional"),
        ({"example_inputs": torch.zeros(3)}, TypeError, "sequence of positional"),
        ({"example_inputs": ()}, ValueError, "no tensor"),
        ({"example_inputs": ([], {"k": ()})}, ValueError, "no tensor"),
        ({"example_inputs": (torch.zeros(3), 3)}, TypeError, r"inputs\[1\]"),
        ({"pool": "cuda"}, TypeError, "pool must be a CudaGraphPool"),
        # On a machine without a GPU every tensor is on the CPU: refused by name.
        ({}, ValueError, "one CUDA device"),
    ],
)
def test_bad_arguments_are_refused_before_any_capture(kwargs, error, match):
    with pytest.raises(error, match=match):
        _check(**kwargs)


def test_staging_is_checked_before_the_examples():
    # A typo in staging is reported even when the examples are fine otherwise.
    with pytest.raises(ValueError, match="staging"):
        _check(staging="graphs", example_inputs=(torch.zeros(2),))


@pytest.mark.parametrize("wait_for", [3, [3], "event", (None,)])
def test_a_wait_for_that_holds_no_events_is_a_type_error_before_any_copy(wait_for):
    from cudagraphs import CudaGraphsTypeError
    from cudagraphs.program.program import _events

    with pytest.raises(CudaGraphsTypeError, match="wait_for must be a torch.cuda.Event"):
        _events(wait_for)
    assert _events(None) == [] and _events(()) == []
