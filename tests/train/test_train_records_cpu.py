"""TrainStepOptions (train/records.py): the bucket_mb check and when reduces() all-reduces."""

import pytest
import torch.distributed as dist

from cudagraphs import CudaGraphsTypeError, CudaGraphsValueError
from cudagraphs.train import TrainStepOptions


@pytest.mark.parametrize("size", [0.5, 1, 1e-3])
def test_any_positive_bucket_size_is_kept_even_below_one_megabyte(size):
    assert TrainStepOptions(bucket_mb=size).bucket_mb == size


@pytest.mark.parametrize("size", [0, -1.0])
def test_a_bucket_size_that_is_not_positive_is_refused_with_its_value(size):
    with pytest.raises(CudaGraphsValueError) as info:
        TrainStepOptions(bucket_mb=size)
    assert str(info.value) == f"bucket_mb must be positive, got {size!r}"


def test_a_bucket_size_that_is_not_a_number_is_refused_naming_bucket_mb():
    with pytest.raises(CudaGraphsTypeError) as info:
        TrainStepOptions(bucket_mb="25")
    assert str(info.value) == "bucket_mb must be a number (int or float), got str '25'"


def test_an_infinite_bucket_size_is_one_bucket_per_dtype():
    assert TrainStepOptions(bucket_mb=float("inf")).bucket_mb == float("inf")


def test_all_reduce_true_without_a_process_group_is_refused_with_the_fix():
    assert not dist.is_initialized()
    with pytest.raises(CudaGraphsValueError, match="all_reduce=True, but torch.distributed"):
        TrainStepOptions(all_reduce=True)
    assert TrainStepOptions(all_reduce=False).reduces() is False


def _fake_world(monkeypatch, sizes):
    """torch.distributed running, with ``sizes[group]`` ranks per process group."""
    seen = []

    def get_world_size(group=None):
        seen.append(group)
        return sizes[group]

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", get_world_size)
    return seen


@pytest.mark.parametrize("ranks, want", [(1, False), (2, True), (3, True)])
def test_reduces_when_the_default_group_has_more_than_one_rank(monkeypatch, ranks, want):
    seen = _fake_world(monkeypatch, {None: ranks})
    assert TrainStepOptions().reduces() is want
    assert seen == [None]


def test_reduces_counts_the_ranks_of_the_given_process_group(monkeypatch):
    seen = _fake_world(monkeypatch, {None: 4, "single": 1, "pair": 2})
    assert TrainStepOptions(process_group="single").reduces() is False
    assert TrainStepOptions(process_group="pair").reduces() is True
    assert seen == ["single", "pair"]


def test_reduces_as_asked_without_asking_torch_distributed(monkeypatch):
    seen = _fake_world(monkeypatch, {None: 1})
    assert TrainStepOptions(all_reduce=True).reduces() is True
    assert TrainStepOptions(all_reduce=False, process_group="single").reduces() is False
    assert seen == []


def test_reduces_nothing_when_torch_distributed_is_not_initialized(monkeypatch):
    seen = _fake_world(monkeypatch, {None: 2})
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert TrainStepOptions().reduces() is False
    assert seen == []
