"""CudaGraphProgram and CudaGraphPool: a fixed function captured once and replayed on
reusable fixed-address inputs.

Threading contract: one host thread drives a program (and a pool) at a time. Programs
are cheap to capture again: give each concurrent worker its own program (and pool).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ..capture import GraphPool, capture_into_graph, capture_with_static_outputs
from ..errors import CudaGraphCaptureError, CudaGraphInputError, GraphReleasedError
from .buffer import ReusableValueBuffer
from .leaves import LeafTypes
from .signature import ValueTreeSignature

__all__ = [
    "CopyHandle",
    "CudaGraphCaptureStats",
    "CudaGraphPool",
    "CudaGraphProgram",
    "ProgramClosedError",
]

OutputT = TypeVar("OutputT")


class ProgramClosedError(GraphReleasedError):
    """A program or pool was used after ``close()``."""


@dataclass(frozen=True)
class CudaGraphCaptureStats:
    """One-time construction costs and allocator snapshots right after capture
    (process-wide figures, not the graph's own footprint)."""

    warmup_iterations: int
    warmup_seconds: float
    capture_seconds: float
    first_replay_seconds: float
    memory_allocated_bytes: int
    memory_reserved_bytes: int


@dataclass(frozen=True)
class CopyHandle:
    """Proof of one :meth:`CudaGraphProgram.copy_inputs_from`: which program, which
    payload generation, and the event that completes when the copy has landed."""

    program_token: object
    generation: int
    event: torch.cuda.Event
    sources: tuple[torch.Tensor, ...]  # kept alive until the copy is consumed


class CudaGraphPool:
    """Shared scratch memory for programs that run one after another.

    Programs captured with one pool share the memory of their intermediates; their
    inputs and retained outputs live outside it, so the programs may replay in any
    order without overwriting each other's outputs. Launches are chained with events,
    so programs replayed from different streams still use the scratch one at a time.

    Args:
        device: the CUDA device of the scratch memory.
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a CudaGraphPool lives on a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._graph_pool = GraphPool()
        self._members: weakref.WeakSet[CudaGraphProgram] = weakref.WeakSet()
        self._last_launch: torch.cuda.Event | None = None
        self._closed = False

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ProgramClosedError("this CudaGraphPool was closed; create a new pool")

    def _before_launch(self, stream: torch.cuda.Stream) -> None:
        if self._last_launch is not None:
            stream.wait_event(self._last_launch)

    def _after_launch(self, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self._last_launch = event

    def close(self) -> None:
        """Wait for all scratch users, then close the live member programs (idempotent)."""
        if self._closed:
            return
        torch.cuda.synchronize(self._device)
        for program in list(self._members):
            program.close()
        self._closed = True
        self._graph_pool = None
        self._last_launch = None


def _check_examples(signature: ValueTreeSignature, tensors: list[torch.Tensor]) -> torch.device:
    if not tensors:
        raise ValueError(
            "example_inputs hold no tensor; a program needs at least one tensor input "
            "(bind constants in the function instead)"
        )
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(
            f"example_inputs must all sit on one CUDA device, found {sorted(map(str, devices))}"
        )
    expanded = [i for i, t in enumerate(signature.tensor_signatures()) if t.self_overlapping]
    if expanded:
        raise ValueError(
            f"example input tensors {expanded} (in flatten order) are expanded views (stride "
            "0); each input needs storage of its own (pass .contiguous() copies)"
        )
    storages: dict[int, int] = {}
    for i, t in enumerate(tensors):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            raise ValueError(
                f"example input tensors {storages[ptr]} and {i} (in flatten order) share "
                "storage; every input leaf needs its own storage, since each gets its own "
                "fixed buffer (pass clones)"
            )
        storages[ptr] = i
    return next(iter(devices))


class CudaGraphProgram(Generic[OutputT]):
    """A function captured once, replayed on inputs copied into fixed buffers.

    Build with :meth:`capture`. Replays return the *borrowed* output tree (overwritten
    by the next replay) unless ``copy_output=True``. The original function stays
    usable eagerly; anything it closes over is static program state.
    """

    def __init__(self, *, _token: object) -> None:
        if _token is not _PRIVATE:
            raise TypeError("build programs with CudaGraphProgram.capture(...)")

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

        Returns:
            The program, or with ``function=None`` a decorator that returns it.

        Raises:
            TypeError: ``function`` or a leaf is unsupported.
            ValueError: bad ``warmup``, examples without tensors, on several devices,
                sharing storage, or a pool on another device / without warmup.
            CudaGraphCaptureError: warmup, capture or the first replay failed (cause
                chained); the pool stays usable.
        """
        if function is None:
            return lambda fn: cls.capture(
                fn,
                example_inputs=example_inputs,
                warmup=warmup,
                check_input_liveness=check_input_liveness,
                pool=pool,
                leaf_types=leaf_types,
                check_first_replay=check_first_replay,
            )
        if not callable(function):
            raise TypeError(f"function must be callable, got {type(function).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if isinstance(example_inputs, (str, bytes)) or not isinstance(example_inputs, Sequence):
            raise TypeError("example_inputs must be a sequence of positional arguments")
        inputs = tuple(example_inputs)
        signature = ValueTreeSignature.from_value(inputs, leaf_types=leaf_types, path="inputs")
        device = _check_examples(signature, signature.flatten(inputs, path="inputs"))
        if pool is not None:
            pool._check_open()
            if warmup < 1:
                raise ValueError("capture into a CudaGraphPool needs warmup >= 1")
            if pool.device != device:
                raise ValueError(f"pool is on {pool.device} but example_inputs on {device}")
        program = cls(_token=_PRIVATE)
        program._build(
            function,
            inputs,
            signature,
            device,
            warmup,
            pool,
            leaf_types,
            check_input_liveness,
            check_first_replay,
        )
        return program

    def _build(
        self,
        function: Callable[..., Any],
        inputs: tuple,
        signature: ValueTreeSignature,
        device: torch.device,
        warmup: int,
        pool: CudaGraphPool | None,
        leaf_types: LeafTypes | None,
        check_input_liveness: bool,
        check_first_replay: bool,
    ) -> None:
        name = getattr(function, "__qualname__", type(function).__name__)
        self._function, self._device, self._signature = function, device, signature
        self._pool, self._leaf_types, self._name = pool, leaf_types, name
        # A fresh object per program: unlike id(self), never reused by another program.
        self._generation, self._token = 0, object()
        self._last_replay: torch.cuda.Event | None = None
        self._launched = torch.cuda.Event()
        self._last_copy: torch.cuda.Event | None = None
        self._last_replay_stream: torch.cuda.Stream | None = None
        self._stream_key: object = None
        self._stream: torch.cuda.Stream | None = None
        self._closed = False
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            t0 = time.perf_counter()
            last = _warm_up(function, signature, inputs, device, warmup, stream, name)
            t1 = time.perf_counter()
            self._buffer = ReusableValueBuffer(signature, device)
            self._buffer.copy_from(inputs, path="inputs")
            self._capture(last, stream, check_input_liveness)
            t2 = time.perf_counter()
            self._first_replay(last if check_first_replay else None)
            t3 = time.perf_counter()
            self._stats = CudaGraphCaptureStats(
                warmup_iterations=warmup,
                warmup_seconds=t1 - t0,
                capture_seconds=t2 - t1,
                first_replay_seconds=t3 - t2,
                memory_allocated_bytes=torch.cuda.memory_allocated(device),
                memory_reserved_bytes=torch.cuda.memory_reserved(device),
            )
        if pool is not None:
            pool._members.add(self)

    def _capture(self, last: Any, stream: torch.cuda.Stream, check_input_liveness: bool) -> None:
        fn, args = self._function, self._buffer.value
        what = f"program {self._name}"
        opts = {"stream": stream, "check_input_liveness": check_input_liveness, "what": what}
        if self._pool is None:
            self._graph_pool = GraphPool()
            self._graph, output = capture_into_graph(lambda: fn(*args), self._graph_pool, **opts)
            # Detached views of the graph's output memory: the captured autograd graph
            # is not kept alive through them.
            try:
                self._output = _detached(output, self._leaf_types)
                self._out_sig = _output_signature(self._output, self._leaf_types)
                _check_output_device(self._out_sig.flatten(self._output), self._device)
            except Exception:
                self._graph.reset()
                raise
            return
        # Retained outputs are copied, inside the graph, into buffers allocated outside
        # the shared scratch, so other programs' replays cannot overwrite them.
        leaf_types = self._leaf_types
        self._out_sig = _output_signature(_detached(last, leaf_types), leaf_types)
        like = self._out_sig.flatten(_detached(last, leaf_types), path="output")
        _check_output_device(like, self._device)
        self._graph, static = capture_with_static_outputs(
            lambda: self._out_sig.flatten(_detached(fn(*args), leaf_types), path="output"),
            like,
            self._pool._graph_pool,
            **opts,
        )
        self._output = self._out_sig.rebuild(static)

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
        got = self._out_sig.flatten(self._output, path="output")
        want = self._out_sig.flatten(_detached(last, self._leaf_types), path="output")
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
        if bad:
            self.close()
            raise CudaGraphCaptureError(
                f"program {self._name}: the first replay's output differs from the last "
                f"warmup output at output tensors {bad} (in flatten order). The function is "
                "not a fixed schedule (host-side control flow, random numbers, reading "
                "state outside its inputs?). For functions that draw random numbers pass "
                "check_first_replay=False."
            )

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
        and overwrite protection, and reuses the payload the buffer holds."""
        self._check_open()
        return self._graph

    @property
    def closed(self) -> bool:
        return self._closed

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
            pool._before_launch(stream)
        self._graph.replay()
        # One event, re-recorded per launch: a wait issued later always refers to the
        # latest launch, which is what overwrite protection and the pool chain need.
        self._launched.record(stream)
        self._last_replay, self._last_replay_stream = self._launched, stream
        # The launch waited for the latest copy, so later buffer writers, which wait
        # for this launch, are ordered after that copy too.
        self._last_copy = None
        if pool is not None:
            pool._last_launch = self._launched

    def _current_stream(self) -> torch.cuda.Stream:
        # torch.cuda.current_stream() builds a new Stream object per call; on the replay
        # path we reuse the last one while the current stream stays the same.
        key = torch._C._cuda_getCurrentStream(self._device.index)
        if key != self._stream_key:
            self._stream_key = key
            self._stream = torch.cuda.current_stream(self._device)
        return self._stream

    def _order_buffer_write(self, stream: torch.cuda.Stream) -> None:
        """Before ``stream`` writes the input buffer: wait for the last launched replay
        (it may still read the inputs) and the last prefetch copy (so buffer writes land
        in the order they were issued), whatever streams those ran on."""
        if self._last_replay is not None and stream is not self._last_replay_stream:
            stream.wait_event(self._last_replay)
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
        broadcasts silently); it saves about half a microsecond per input tensor.

        Raises:
            SignatureMismatchError (a CudaGraphInputError): naming every path that
                differs; nothing was copied.
            ProgramClosedError: after ``close()``.
        """
        self._check_open()
        if validate:
            sources = self._signature.flatten(inputs, path="inputs")
        else:
            sources = self._signature.extract(inputs, path="inputs")
        stream = self._current_stream()
        self._order_buffer_write(stream)
        self._buffer.copy_tensors(sources)
        self._generation += 1  # any earlier CopyHandle is stale now
        self._launch(stream)
        return self._result(copy_output, synchronize)

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
        sources = self._signature.flatten(inputs, path="inputs")
        stream = torch.cuda.current_stream(self._device) if stream is None else stream
        self._order_buffer_write(stream)
        events = [wait_for] if isinstance(wait_for, torch.cuda.Event) else list(wait_for or ())
        for event in events:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            self._buffer.copy_tensors(sources, non_blocking=non_blocking)
        for src in sources:
            if src.is_cuda:
                # The caller may drop a CUDA source at once; its memory must not be
                # reused before this stream has read it.
                src.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
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
            if copy_handle.program_token is not self._token:
                raise CudaGraphInputError(
                    f"program {self._name}: copy_handle was made by another program"
                )
            if copy_handle.generation != self._generation:
                raise CudaGraphInputError(
                    f"program {self._name}: copy_handle is stale (payload {copy_handle.generation}"
                    f", buffer now holds payload {self._generation}); use the latest handle"
                )
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
        self._graph = self._buffer = self._output = None
        self._last_replay = self._last_copy = None
        self._graph_pool = None
        if self._pool is not None:
            self._pool._members.discard(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.input_nbytes} input bytes"
        return f"CudaGraphProgram({self._name}, {state})"


_PRIVATE = object()


def _output_signature(output: Any, leaf_types: LeafTypes | None) -> ValueTreeSignature:
    try:
        return ValueTreeSignature.from_value(
            output, leaf_types=leaf_types, path="output", allow_none=True
        )
    except TypeError as exc:
        raise TypeError(
            f"{exc}. A program's output must be CUDA tensors, registered leaves or None, "
            "nested in lists, tuples and dicts."
        ) from None


def _check_output_device(tensors: list[torch.Tensor], device: torch.device) -> None:
    elsewhere = sorted({str(t.device) for t in tensors if t.device != device})
    if elsewhere:
        raise TypeError(
            f"the function returned tensors on {elsewhere}; a program's outputs must be "
            f"tensors on its device {device} (a graph replay never writes other devices)"
        )


def _detached(tree: Any, leaf_types: LeafTypes | None) -> Any:
    """``tree`` with every tensor replaced by a detached view (no copies, no kernels)."""
    sig = _output_signature(tree, leaf_types)
    return sig.rebuild([t.detach() for t in sig.flatten(tree, path="output")])


def _warm_up(
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
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fresh = ReusableValueBuffer(signature, device)
                fresh.copy_from(inputs, path="inputs")
                last = function(*fresh.value)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
    except Exception as exc:
        raise CudaGraphCaptureError(f"warmup of program {name} failed: {exc}") from exc
    return last
