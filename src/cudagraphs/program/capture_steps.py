"""Capture-time steps of a program: checking the examples, warming up on fresh
buffers, and describing outputs. None of these run on the replay path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..capture import side_stream
from ..checks import check_callable, check_int
from ..errors import CudaGraphCaptureError, CudaGraphsTypeError, CudaGraphsValueError
from .buffer import ReusableValueBuffer
from .leaves import LeafTypes
from .signature import ValueTreeSignature
from .staging import check_staging_mode

__all__ = [
    "first_replay_mismatch",
    "check_capture_arguments",
    "check_capture_options",
    "check_examples",
    "check_output_device",
    "detached",
    "output_signature",
    "warm_up",
]


def check_capture_options(
    function: object, example_inputs: object, warmup: object, staging: object
) -> None:
    """The checks of :func:`check_capture_arguments` that need no device: run before
    asking for CUDA, so that a wrong argument is named before a missing GPU."""
    check_callable("function", function)
    check_int("warmup", warmup, minimum=0)
    if isinstance(example_inputs, (str, bytes)) or not isinstance(example_inputs, Sequence):
        raise CudaGraphsTypeError("example_inputs must be a sequence of positional arguments")
    check_staging_mode(staging)


def check_capture_arguments(
    function: object,
    example_inputs: object,
    warmup: object,
    pool: Any,
    leaf_types: LeafTypes | None,
    staging: object,
) -> tuple[tuple, ValueTreeSignature, torch.device]:
    """Check the arguments of ``CudaGraphProgram.capture``; return the inputs as a
    tuple, their signature and their device. Nothing is captured or allocated."""
    check_capture_options(function, example_inputs, warmup, staging)
    inputs = tuple(example_inputs)
    signature = ValueTreeSignature.from_value(inputs, leaf_types=leaf_types, path="inputs")
    device = check_examples(signature, signature.flatten(inputs, path="inputs"))
    if pool is not None:
        pool._check_open()
        if warmup < 1:
            raise CudaGraphsValueError("capture into a CudaGraphPool needs warmup >= 1")
        if pool.device != device:
            raise CudaGraphsValueError(f"pool is on {pool.device} but example_inputs on {device}")
    return inputs, signature, device


def check_examples(signature: ValueTreeSignature, tensors: list[torch.Tensor]) -> torch.device:
    if not tensors:
        raise CudaGraphsValueError(
            "example_inputs hold no tensor; a program needs at least one tensor input "
            "(bind constants in the function instead)"
        )
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise CudaGraphsValueError(
            f"example_inputs must all sit on one CUDA device, found {sorted(map(str, devices))}"
        )
    expanded = [i for i, t in enumerate(signature.tensor_signatures()) if t.self_overlapping]
    if expanded:
        raise CudaGraphsValueError(
            f"example input tensors {expanded} (in flatten order) are expanded views (stride "
            "0); each input needs storage of its own (pass .contiguous() copies)"
        )
    storages: dict[int, int] = {}
    for i, t in enumerate(tensors):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            raise CudaGraphsValueError(
                f"example input tensors {storages[ptr]} and {i} (in flatten order) share "
                "storage; every input leaf needs its own storage, since each gets its own "
                "fixed buffer (pass clones)"
            )
        storages[ptr] = i
    return next(iter(devices))


def output_signature(output: Any, leaf_types: LeafTypes | None) -> ValueTreeSignature:
    try:
        return ValueTreeSignature.from_value(
            output, leaf_types=leaf_types, path="output", allow_none=True
        )
    except TypeError as exc:
        raise CudaGraphsTypeError(
            f"{exc}. A program's output must be CUDA tensors, registered leaves or None, "
            "nested in lists, tuples and dicts."
        ) from None


def check_output_device(tensors: list[torch.Tensor], device: torch.device) -> None:
    elsewhere = sorted({str(t.device) for t in tensors if t.device != device})
    if elsewhere:
        raise CudaGraphsTypeError(
            f"the function returned tensors on {elsewhere}; a program's outputs must be "
            f"tensors on its device {device} (a graph replay never writes other devices)"
        )


def detached(tree: Any, leaf_types: LeafTypes | None) -> Any:
    """``tree`` with every tensor replaced by a detached view (no copies, no kernels)."""
    sig = output_signature(tree, leaf_types)
    return sig.rebuild([t.detach() for t in sig.flatten(tree, path="output")])


def warm_up(
    function: Callable[..., Any],
    signature: ValueTreeSignature,
    inputs: tuple,
    device: torch.device,
    warmup: int,
    stream: torch.cuda.Stream,
    name: str,
) -> Any:
    """Run ``function`` ``warmup`` times on fresh buffers on ``stream``; return the
    last output (``None`` without warmup)."""
    last = None
    try:
        with side_stream(stream):
            for _ in range(warmup):
                fresh = ReusableValueBuffer(signature, device)
                fresh.copy_from(inputs, path="inputs")
                last = function(*fresh.value)
        torch.cuda.synchronize(device)
    except Exception as exc:
        raise CudaGraphCaptureError(f"warmup of program {name} failed: {exc}") from exc
    return last


def first_replay_mismatch(
    out_sig: ValueTreeSignature, output: Any, last: Any, leaf_types: LeafTypes | None, name: str
) -> str | None:
    """Why the first replay's ``output`` is not the last warmup's ``last``, or ``None``."""
    got = out_sig.flatten(output, path="output")
    want = out_sig.flatten(detached(last, leaf_types), path="output")
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    if not bad:
        return None
    return (
        f"program {name}: the first replay's output differs from the last "
        f"warmup output at output tensors {bad} (in flatten order). The function is "
        "not a fixed schedule (host-side control flow, random numbers, reading "
        "state outside its inputs?). For functions that draw random numbers pass "
        "check_first_replay=False."
    )
