"""The generator's one-step-late end flag (serving/hf/per_token.py) on a CUDA device,
with fakes for what a CPU build of torch lacks: the flag lives in pinned host memory,
the device value is copied in without blocking, an event on the value's device's
current stream marks the copy, and a read waits on that event and nothing else. These
are what make the decode loop free of a sync per token; on the CPU the same class
copies and reads directly (no pinned memory, no event)."""

import pytest
import torch

from cudagraphs.serving.hf import per_token
from cudagraphs.serving.hf.per_token import EndFlag

CUDA = torch.device("cuda", 1)


class FakeHost:
    """The pinned host scalar: remembers each copy into it."""

    def __init__(self):
        self.copies = []
        self.value = False

    def copy_(self, value, non_blocking=False):
        self.copies.append((value, non_blocking))
        self.value = bool(value)
        return self

    def __bool__(self):
        return self.value


class FakeEvent:
    def __init__(self, log):
        self.log = log
        log.append(("event",))

    def record(self, stream):
        self.log.append(("record", stream))

    def synchronize(self):
        self.log.append(("synchronize",))


@pytest.fixture
def fake_cuda(monkeypatch):
    log, made = [], []

    def zeros(*shape, **kw):
        made.append((shape, kw))
        return FakeHost()

    monkeypatch.setattr(per_token.torch, "zeros", zeros)
    monkeypatch.setattr(per_token.torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(
        per_token.torch.cuda, "current_stream", lambda device=None: ("stream of", device)
    )
    return log, made


def test_on_cuda_the_flag_is_pinned_host_memory_with_an_event(fake_cuda):
    log, made = fake_cuda
    flag = EndFlag(CUDA)
    assert made == [(((),), {"dtype": torch.bool, "pin_memory": True})]
    assert log == [("event",)] and flag.pending is False


def test_a_record_copies_without_blocking_and_marks_the_values_device_stream(fake_cuda):
    log, _ = fake_cuda
    flag = EndFlag(torch.device("cuda", 0))  # the current device need not be the value's
    value = _OnDevice(torch.tensor(True), CUDA)
    flag.record(value)
    assert flag.host.copies == [(value, True)]
    assert log[-1] == ("record", ("stream of", CUDA))
    assert flag.pending is True


def test_a_read_waits_on_the_event_once_then_answers_false_until_the_next_record(fake_cuda):
    log, _ = fake_cuda
    flag = EndFlag(CUDA)
    flag.record(_OnDevice(torch.tensor(True), CUDA))
    assert flag.read() is True
    assert log[-1] == ("synchronize",) and log.count(("synchronize",)) == 1
    assert flag.read() is False  # nothing pending: no wait, no read of stale memory
    assert log.count(("synchronize",)) == 1


def test_on_the_cpu_there_is_no_pinned_memory_and_no_event(monkeypatch):
    made = []
    real = torch.zeros

    def zeros(*shape, **kw):
        made.append(kw)
        return real(*shape, **kw)

    monkeypatch.setattr(per_token.torch, "zeros", zeros)
    monkeypatch.setattr(per_token.torch.cuda, "Event", _no_event)
    flag = EndFlag(torch.device("cpu"))
    assert made == [{"dtype": torch.bool, "pin_memory": False}] and flag.event is None
    flag.record(torch.tensor(True))
    assert flag.read() is True and flag.read() is False


def _no_event():
    raise AssertionError("no CUDA event off CUDA")


class _OnDevice:
    """A value that says it lives on ``device`` (what record() asks of it) and copies
    as the tensor it wraps."""

    def __init__(self, tensor, device):
        self.tensor, self.device = tensor, device

    def __bool__(self):
        return bool(self.tensor)
