"""CudaGraphProgram: a fixed function captured once and replayed on reusable
fixed-address inputs (its pool of shared scratch is :mod:`.pool`).

Threading contract: one host thread drives a program (and a pool) at a time. Programs
are cheap to capture again: give each concurrent worker its own program (and pool).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Generic, TypeVar

import torch

from ..capture_state import capture_scope
from ..checks import require_cuda
from ..errors import CudaGraphCaptureError, CudaGraphInputError, CudaGraphsTypeError
from ..settings import graphs_disabled
from ..torch_private import current_stream_key
from .graph_capture import (
    CapturedProgram,
    capture_program,
    check_capture_arguments,
    check_capture_options,
    first_replay_mismatch,
)
from .launch_order import LaunchOrder
from .leaves import LeafTypes
from .matcher import InputValidator
from .pool import CopyHandle, CudaGraphCaptureStats, CudaGraphPool, ProgramClosedError
from .signature import ValueTreeSignature

__all__ = [
    "CopyHandle",
    "CudaGraphCaptureStats",
    "CudaGraphPool",
    "CudaGraphProgram",
    "ProgramClosedError",
]

OutputT = TypeVar("OutputT")


class CudaGraphProgram(Generic[OutputT]):
    """A function captured once, replayed on inputs copied into fixed buffers.

    Build with :meth:`capture`. Replays return the *borrowed* output tree (overwritten
    by the next replay) unless ``copy_output=True``. The original function stays
    usable eagerly; anything it closes over is static program state.
    """

    def __init__(self, captured: CapturedProgram | None = None) -> None:
        """A program over what :func:`~.graph_capture.capture_program` captured; use
        :meth:`capture`, which also checks the first replay.

        Raises:
            CudaGraphsTypeError: ``captured`` is not a ``CapturedProgram``.
        """
        if not isinstance(captured, CapturedProgram):
            raise CudaGraphsTypeError(
                "CudaGraphProgram is built from a capture, not directly: build one with "
                "CudaGraphProgram.capture(function, example_inputs=(...))"
            )
        self._function, self._name = captured.function, captured.name
        self._device, self._signature = captured.device, captured.signature
        self._validate = InputValidator(captured.signature)
        self._pool, self._leaf_types = captured.pool, captured.leaf_types
        # Kept alive with the program (None in a shared pool: the pool holds it).
        self._graph_pool = captured.graph_pool
        self._buffer = captured.buffer
        graph = captured.captured
        self._graph, self._output = graph.graph, graph.output
        self._out_sig, self._staging = graph.out_sig, graph.staging
        self._stats = captured.stats()
        # A fresh object per program: unlike id(self), never reused by another program.
        self._generation, self._token = 0, object()
        # Writers of the input buffer on another stream than the last replay wait for
        # it (LaunchOrder). On the plain replay() path everything runs on one stream and
        # no event is recorded; once the program prefetches (copy_inputs_from), every
        # launch records one.
        self._order = LaunchOrder()
        self._last_copy: torch.cuda.Event | None = None
        self._stream_key: object = None
        self._get_stream_key = current_stream_key()  # (id, device, type)
        self._device_index = captured.device.index
        self._stream: torch.cuda.Stream | None = None
        self._closed = False
        if self._pool is not None:
            self._pool.add_member(self)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def capture(
        cls,
        function: Callable[..., OutputT] | None = None,
        *,
        example_inputs: Sequence[Any],
        warmup: int = 3,
        check_input_liveness: bool = False,
        pool: CudaGraphPool | None = None,
        leaf_types: LeafTypes | None = None,
        check_first_replay: bool = True,
        staging: str = "auto",
    ) -> Any:
        """Warm up and capture ``function(*example_inputs)``.

        Args:
            function: the evaluator; omit it to use ``capture`` as a decorator.
            example_inputs: positional prototypes on one CUDA device: tensors and
                registered leaves (``leaf_types``) nested in lists, tuples, dicts.
                Their structure and metadata specialize the program.
            warmup: fresh-buffer evaluations on a side stream before capture, so lazy
                initialization, autotuning and workspaces happen outside it.
            check_input_liveness: forwarded to torch where supported: a debug aid that
                records tracebacks of tensors read from outside the pool (seconds of
                capture time) and checks them on every replay, so it is off by default
                (the reference API's default is on).
            pool: a :class:`CudaGraphPool` to share scratch with; needs ``warmup >= 1``
                (the last warmup output sizes the retained output buffers).
            leaf_types: registered leaf types accepted in inputs and outputs.
            check_first_replay: compare the first (synchronized) replay with the last
                warmup output; turn off for functions that draw random numbers.
            staging: how :meth:`replay` gets inputs into the graph. ``"copy"``: one
                fused copy into the fixed buffer per call. ``"graph"``: the graph
                itself copies each contiguous input from the caller's tensor, whose
                address is updated per call only when it changes (cheaper than a
                copy launch: ``docs/program.md``).
                ``"auto"`` (default): ``"graph"`` for programs of at most
                ``AUTO_GRAPH_STAGING_MAX_TENSORS`` input tensors when the CUDA runtime
                can be reached, else ``"copy"``. See :attr:`staging`.

        Returns:
            The program, or with ``function=None`` a decorator that returns it.

        With ``CUDAGRAPHS_DISABLE=1`` nothing is warmed up or captured: the program
        checks and copies inputs as usual and runs ``function`` eagerly on its buffer
        at each replay, copying the result into the same borrowed output tree.

        Raises:
            NoCudaDeviceError: torch finds no usable CUDA device.
            CudaGraphsTypeError: ``function`` or a leaf is unsupported, ``warmup`` is
                not an int.
            CudaGraphsValueError: bad ``warmup`` or ``staging``, examples without
                tensors, on several devices, sharing storage, or a pool on another
                device / without warmup.
            CudaGraphCaptureError: warmup, capture or the first replay failed (cause
                chained); the pool stays usable.
        """
        if function is None:
            options = dict(warmup=warmup, check_input_liveness=check_input_liveness, pool=pool)
            options.update(leaf_types=leaf_types, check_first_replay=check_first_replay)
            return functools.partial(
                cls.capture, example_inputs=example_inputs, staging=staging, **options
            )
        # Arguments first, as every entry point: the real mistake before a missing GPU.
        check_capture_options(function, example_inputs, warmup, staging)
        require_cuda("CudaGraphProgram.capture")
        inputs, signature, device = check_capture_arguments(
            function, example_inputs, warmup, pool, leaf_types, staging
        )
        disabled = graphs_disabled()
        with torch.cuda.device(device), nullcontext() if disabled else capture_scope():
            captured = capture_program(
                function,
                inputs,
                signature,
                device,
                warmup=warmup,
                pool=pool,
                leaf_types=leaf_types,
                check_input_liveness=check_input_liveness,
                staging=staging,
                disabled=disabled,
            )
            program = cls(captured)
            t0 = time.perf_counter()
            program._first_replay(captured.last if check_first_replay else None)
            program._stats = captured.stats(first_replay_seconds=time.perf_counter() - t0)
        return program

    def _first_replay(self, last: Any) -> None:
        try:
            self._launch(torch.cuda.current_stream(self._device))
            torch.cuda.synchronize(self._device)
        except Exception as exc:
            self.close()
            raise CudaGraphCaptureError(
                f"first replay of program {self._name} failed: {exc}"
            ) from exc
        if last is None:
            return
        try:
            problem = first_replay_mismatch(
                self._out_sig, self._output, last, self._leaf_types, self._name
            )
        except CudaGraphInputError as exc:
            # The warmup's output has another structure or metadata than the capture's:
            # the function is no fixed schedule; not a problem of the caller's inputs.
            self.close()
            raise CudaGraphCaptureError(
                f"program {self._name}: the last warmup's output and the captured output "
                f"differ in structure or metadata ({exc}). The function is not a fixed "
                "schedule (host-side control flow?): make its outputs depend on its "
                "inputs' shapes alone"
            ) from exc
        if problem is not None:
            self.close()
            raise CudaGraphCaptureError(problem)

    # ---- properties -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def input_signature(self) -> ValueTreeSignature:
        return self._signature

    @property
    def input_nbytes(self) -> int:
        return self._signature.nbytes

    @property
    def stats(self) -> CudaGraphCaptureStats:
        return self._stats

    @property
    def output(self) -> OutputT:
        """The borrowed output tree; overwritten by every replay."""
        self._check_open()
        return self._output

    @property
    def cuda_graph(self) -> torch.cuda.CUDAGraph:
        """The torch graph. Replaying it directly skips validation, copies, event waits
        and overwrite protection, and reuses the payload the buffer holds. With
        ``CUDAGRAPHS_DISABLE=1``: a :class:`~cudagraphs.capture.EagerGraph` stand-in."""
        self._check_open()
        return self._graph

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def staging(self) -> str:
        """``"graph"`` when the graph copies at least one input from the caller's
        tensor itself (see ``capture(staging=...)``), else ``"copy"``.

        Under ``"graph"``, :meth:`replay` reads those inputs in place, in stream order
        as a copy would, and keeps a reference to them until the next replay or
        :meth:`copy_inputs_from`: :meth:`replay_prepared` without a newer copy reads
        them again, with whatever they hold by then.
        """
        return "copy" if self._staging is None else "graph"

    # ---- replay -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ProgramClosedError(
                f"program {self._name} was closed; its graph, buffers and borrowed output "
                "are gone. Capture a new program."
            )

    def _launch(self, stream: torch.cuda.Stream) -> None:
        pool = self._pool
        if pool is not None:
            # Scratch is shared: a launch on another stream than the pool's last waits.
            pool.launch_order.wait(stream, record_from_now=True)
        self._graph.replay()
        # LaunchOrder.launched, inline: this is the per-replay path, where a method
        # call costs about as much as the rest of these lines.
        order = self._order
        if order.recording:
            order.event.record(stream)
        order.last_stream = stream
        # The launch waited for the latest copy, so later buffer writers, which wait
        # for this launch, are ordered after that copy too.
        self._last_copy = None
        if pool is not None:
            pool.launch_order.launched(stream)

    def _current_stream(self) -> torch.cuda.Stream:
        # torch.cuda.current_stream() builds a new Stream object per call; on the replay
        # path we reuse the last one while the current stream stays the same.
        key = self._get_stream_key(self._device_index)
        if key != self._stream_key:
            self._stream_key = key
            self._stream = torch.cuda.current_stream(self._device)
        return self._stream

    def _order_buffer_write(self, stream: torch.cuda.Stream) -> None:
        """Before ``stream`` writes the input buffer: wait for the last launched replay
        (it may still read the inputs) and the last prefetch copy (so buffer writes land
        in the order they were issued), whatever streams those ran on."""
        self._order.wait(stream, record_from_now=False)
        if self._last_copy is not None:
            stream.wait_event(self._last_copy)

    def _result(self, copy_output: bool, synchronize: bool) -> Any:
        out = self._output
        if copy_output:
            tensors = self._out_sig.flatten(out, path="output")
            out = self._out_sig.rebuild([t.detach().clone() for t in tensors])
        if synchronize:
            torch.cuda.synchronize(self._device)
        return out

    def replay(
        self,
        *inputs: Any,
        copy_output: bool = False,
        synchronize: bool = False,
        validate: bool = True,
    ) -> OutputT:
        """Validate ``inputs`` (all of them, before any copy), copy them into the fixed
        buffer on the current stream, replay, and return the output.

        ``validate=False`` skips the per-leaf checks for callers that guarantee the
        captured structure and metadata (a mismatch then fails inside the copy, or
        broadcasts silently); it saves about 0.1 us per input tensor (6.1 to 6.7 us
        for 64 on an H200 host, ``docs/program.md``).

        Raises:
            SignatureMismatchError (a CudaGraphInputError): naming every path that
                differs; nothing was copied.
            ProgramClosedError: after ``close()``.
        """
        # The per-call path of many-input programs: every helper call and attribute
        # lookup here costs tens of nanoseconds, so common cases are tested inline.
        if self._closed:
            self._check_open()
        if validate:
            sources = self._validate(inputs, "inputs")
        else:
            sources = self._signature.extract(inputs, path="inputs")
        staging = self._staging
        if staging is not None:
            # None: the graph reads every input in place, nothing to copy. Otherwise
            # the bound inputs come back as the buffers, which the copy skips.
            sources = staging.bind(sources)
        stream = self._current_stream()
        # Also when nothing is copied: the launch below is what later buffer writers
        # wait for, so it must come after any copy still pending into the buffer.
        last = self._order.last_stream
        if self._last_copy is not None or (last is not stream and last is not None):
            self._order_buffer_write(stream)
        if sources is not None:
            # Callers never see the buffers, so only bound inputs can be the buffers.
            self._buffer.copy_tensors(sources, may_alias=staging is not None)
        self._generation += 1  # any earlier CopyHandle is stale now
        self._launch(stream)
        if copy_output or synchronize:
            return self._result(copy_output, synchronize)
        return self._output

    def copy_inputs_from(
        self,
        *inputs: Any,
        stream: torch.cuda.Stream | None = None,
        non_blocking: bool = True,
        wait_for: torch.cuda.Event | Sequence[torch.cuda.Event] | None = None,
    ) -> CopyHandle:
        """Validate and copy ``inputs`` into the fixed buffer on ``stream`` (default: the
        current stream) without replaying. The copy first waits for the last launched
        replay, so it never overwrites inputs a replay still reads, and for
        ``wait_for``. Pinned CPU sources overlap with compute.

        Returns:
            A :class:`CopyHandle` for :meth:`replay_prepared`.
        """
        self._check_open()
        events = _events(wait_for)
        sources = self._validate(inputs, "inputs")
        stream = torch.cuda.current_stream(self._device) if stream is None else stream
        self._order_buffer_write(stream)
        self._order.recording = True  # a prefetching program: see __init__
        if self._staging is not None:
            self._staging.unbind()  # the graph reads the buffer this copy fills
        done = self._buffer.copy_on(stream, sources, non_blocking=non_blocking, wait_for=events)
        self._generation += 1
        self._last_copy = done
        return CopyHandle(self._token, self._generation, done, tuple(sources))

    def replay_prepared(
        self,
        *,
        copy_handle: CopyHandle | None = None,
        copy_output: bool = False,
        synchronize: bool = False,
    ) -> OutputT:
        """Replay on the payload the buffer holds. The current stream first waits (on
        the device, not the host) for ``copy_handle``'s copy, or without a handle for
        the latest :meth:`copy_inputs_from`.

        Raises:
            CudaGraphInputError: the handle belongs to another program, or a newer copy
                or replay has replaced its payload.
        """
        self._check_open()
        stream = self._current_stream()
        if copy_handle is not None:
            if not isinstance(copy_handle, CopyHandle):
                raise CudaGraphsTypeError(
                    f"copy_handle must be the CopyHandle copy_inputs_from returned, got "
                    f"{type(copy_handle).__name__}"
                )
            copy_handle.check(self._token, self._generation, self._name)
            stream.wait_event(copy_handle.event)
        elif self._last_copy is not None:
            # Without a handle, still never read a payload that is half copied.
            stream.wait_event(self._last_copy)
        self._launch(stream)
        return self._result(copy_output, synchronize)

    def close(self) -> None:
        """Wait for outstanding work and release the graph, buffers and output.
        Idempotent; any later use raises :class:`ProgramClosedError`."""
        if getattr(self, "_closed", True):
            return
        torch.cuda.synchronize(self._device)
        self._closed = True
        if getattr(self, "_graph", None) is not None:
            self._graph.reset()
        self._graph = self._buffer = self._output = self._staging = None
        self._order.forget()
        self._last_copy = None
        self._graph_pool = None
        if self._pool is not None:
            self._pool.discard_member(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.input_nbytes} input bytes"
        return f"CudaGraphProgram({self._name}, {state})"


def _events(wait_for: Any) -> list[torch.cuda.Event]:
    """``copy_inputs_from``'s ``wait_for`` as a list of events, checked before anything
    is copied."""
    if wait_for is None:
        return []
    if isinstance(wait_for, torch.cuda.Event):
        return [wait_for]
    items = list(wait_for) if isinstance(wait_for, (list, tuple)) else [wait_for]
    bad = [type(e).__name__ for e in items if not isinstance(e, torch.cuda.Event)]
    if bad:
        raise CudaGraphsTypeError(
            f"wait_for must be a torch.cuda.Event or a list or tuple of them, got {bad}; "
            "pass the events the sources' producers recorded"
        )
    return items

