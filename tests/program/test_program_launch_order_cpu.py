"""LaunchOrder's event protocol across streams, on the CPU with recording fake streams
and events: which records and waits it issues, and when."""

import pytest
import torch

from cudagraphs.program.launch_order import LaunchOrder


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("record", stream))


class _Stream:
    def __init__(self, name, log):
        self.name = name
        self.log = log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))

    def __repr__(self):
        return self.name


@pytest.fixture
def log(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(calls))
    return calls


def _streams(log):
    return _Stream("a", log), _Stream("b", log)


def test_a_new_order_owns_one_event_and_records_nothing(log):
    order = LaunchOrder()
    assert type(order.event) is _Event
    assert order.recording is False
    assert order.last_stream is None
    assert log == []


def test_waiting_before_any_launch_does_nothing(log):
    a, _ = _streams(log)
    order = LaunchOrder()
    order.wait(a, record_from_now=True)
    assert log == [] and order.recording is False


def test_launches_on_one_stream_never_record_or_wait(log):
    a, _ = _streams(log)
    order = LaunchOrder()
    order.launched(a)
    order.wait(a, record_from_now=True)
    order.launched(a)
    assert log == [] and order.last_stream is a and order.recording is False


def test_a_cross_stream_wait_records_late_on_the_last_stream(log):
    a, b = _streams(log)
    order = LaunchOrder()
    order.launched(a)
    order.wait(b, record_from_now=False)
    assert log == [("record", a), ("wait", "b", order.event)]
    assert order.recording is False
    # Without record_from_now, launches stay free and the next wait records late again.
    order.launched(b)
    order.wait(a, record_from_now=False)
    assert log[2:] == [("record", b), ("wait", "a", order.event)]


def test_record_from_now_records_at_every_later_launch(log):
    a, b = _streams(log)
    order = LaunchOrder()
    order.launched(a)
    order.wait(b, record_from_now=True)
    assert order.recording is True
    order.launched(b)
    assert log == [("record", a), ("wait", "b", order.event), ("record", b)]
    assert order.last_stream is b
    # Already recording: a wait from another stream only waits, no late record.
    order.wait(a, record_from_now=False)
    assert log[3:] == [("wait", "a", order.event)]
    assert order.recording is True


def test_forget_drops_the_last_stream(log):
    a, b = _streams(log)
    order = LaunchOrder()
    order.launched(a)
    order.forget()
    assert order.last_stream is None
    order.wait(b, record_from_now=True)
    assert log == []
