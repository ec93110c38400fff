"""The order between launches that read shared memory and the writers that follow them
on other streams: one event, recorded only once some stream needs it.

A program's input buffer, and a pool's scratch, are read by every launch. A writer on
the stream of the last launch (a copy into the buffer, another program's launch) is
ordered after it by the stream itself. A writer on another stream must wait for that
launch. Recording an event at every launch would cost a host call per launch, and most
callers never leave one stream, so:

* until a cross-stream wait is needed, no event is recorded;
* the first such wait records the event late, on the last launch's stream, where it
  follows that launch and whatever was queued after it (conservative, and correct);
* from then on, when the owner asks for it (a pool: at the first cross-stream launch;
  a program: once it prefetches inputs), every launch records the event, so that a
  later wait refers to the latest launch.

Used by :class:`~cudagraphs.program.pool.CudaGraphPool` (launches sharing scratch) and
:class:`~cudagraphs.program.program.CudaGraphProgram` (writers of its input buffer).
"""

from __future__ import annotations

import torch

__all__ = ["LaunchOrder"]


class LaunchOrder:
    """The last launch's stream, and one event to wait on it from other streams."""

    __slots__ = ("event", "last_stream", "recording")

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        #: Every launch records :attr:`event` (set by :meth:`wait` or by the owner).
        self.recording = False
        self.last_stream: torch.cuda.Stream | None = None

    def wait(self, stream: torch.cuda.Stream, *, record_from_now: bool) -> None:
        """Make ``stream`` wait for the last launch when that ran on another stream.

        ``record_from_now``: after a late record, record at every launch from now on.
        """
        last = self.last_stream
        if last is None or stream is last:
            return
        if not self.recording:
            self.event.record(last)  # late: see the module docstring
            self.recording = record_from_now
        stream.wait_event(self.event)

    def launched(self, stream: torch.cuda.Stream) -> None:
        """Note a launch on ``stream`` (call right after it was queued)."""
        if self.recording:
            self.event.record(stream)
        self.last_stream = stream

    def forget(self) -> None:
        """Drop the reference to the last launch's stream (the owner is closing)."""
        self.last_stream = None
