"""CPU tests of the train layer's gradient all-reduce: buckets (plan_buckets), the
bucketed all-reduce on two gloo ranks, the reducer's packing in process, and the
group and bucket-size arguments."""

import pytest
import torch

from cudagraphs import (
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
)
from cudagraphs.train import (
    DEFAULT_BUCKET_MB,
    all_reduce_gradients,
    plan_buckets,
    plan_optimizer,
)
from cudagraphs.train.optimizers import HyperparameterGuard
from helpers.asserts import assert_bitwise_equal
from helpers.spawn import run_ranks
from helpers.train_cpu import (
    _param,
)

WORLD_SIZE = 2


# ---- plan_buckets --------------------------------------------------------------------
def _grads(*specs):
    return [torch.zeros(n, dtype=dtype) for n, dtype in specs]


def _layout(buckets, grads):
    index = {id(g): i for i, g in enumerate(grads)}
    return [[index[id(g)] for g in b.grads] for b in buckets]


F32, F64 = torch.float32, torch.float64
CAP_104_BYTES = 104 / 2**20  # bucket_mb whose cap is exactly 104 bytes


def test_buckets_split_on_a_dtype_change_and_keep_order():
    grads = _grads((3, F32), (4, F32), (2, F64), (5, F32), (1, F32))
    buckets = plan_buckets(grads)
    assert _layout(buckets, grads) == [[0, 1], [2], [3, 4]]
    assert [b.numels for b in buckets] == [(3, 4), (2,), (5, 1)]
    assert [b.nbytes for b in buckets] == [28, 16, 24]
    assert all(b.grads[0] is grads[i] for b, i in zip(buckets, [0, 2, 3]))


def test_buckets_split_on_a_device_change():
    grads = [torch.zeros(3), torch.zeros(3, device="meta"), torch.zeros(3, device="meta")]
    assert _layout(plan_buckets(grads), grads) == [[0], [1, 2]]


def test_buckets_respect_the_size_cap_with_the_cap_itself_allowed():
    # 13 float32 = 52 bytes: two fill the 104-byte cap exactly, a third starts a bucket.
    grads = _grads((13, F32), (13, F32), (13, F32), (1, F32), (12, F32), (1, F32))
    buckets = plan_buckets(grads, bucket_mb=CAP_104_BYTES)
    assert _layout(buckets, grads) == [[0, 1], [2, 3, 4], [5]]
    assert [b.nbytes for b in buckets] == [104, 104, 4]


def test_buckets_cap_with_a_small_float_bucket_mb():
    grads = _grads((10, F32), (10, F32), (10, F32), (10, F32), (10, F32))
    # 1e-4 MiB = 104 bytes: two 40-byte gradients fit, a third does not.
    assert _layout(plan_buckets(grads, bucket_mb=1e-4), grads) == [[0, 1], [2, 3], [4]]


def test_an_oversized_gradient_sits_alone_in_its_bucket():
    grads = _grads((2, F32), (40, F32), (2, F32), (3, F32))
    buckets = plan_buckets(grads, bucket_mb=CAP_104_BYTES)
    assert _layout(buckets, grads) == [[0], [1], [2, 3]]
    assert buckets[1].nbytes == 160


def test_buckets_with_the_default_cap_hold_everything_of_one_dtype():
    grads = _grads((1000, F32), (2000, F32), (3000, F32))
    assert DEFAULT_BUCKET_MB == 25.0
    assert _layout(plan_buckets(grads), grads) == [[0, 1, 2]]
    assert plan_buckets([]) == []


def test_an_infinite_bucket_size_makes_one_bucket_per_device_and_dtype():
    grads = _grads((1000, F32), (2000, F32), (5, torch.bfloat16), (3000, F32))
    assert _layout(plan_buckets(grads, bucket_mb=float("inf")), grads) == [[0, 1], [2], [3]]


@pytest.mark.parametrize("bucket_mb", [0, 0.0, -1.0, float("nan")])
def test_buckets_refuse_a_non_positive_size(bucket_mb):
    with pytest.raises(CudaGraphsValueError, match="bucket_mb must be positive"):
        plan_buckets(_grads((3, F32)), bucket_mb=bucket_mb)


def test_buckets_refuse_a_size_that_is_not_a_number():
    with pytest.raises(CudaGraphsTypeError, match="bucket_mb must be a number"):
        plan_buckets(_grads((3, F32)), bucket_mb="25")


# ---- all_reduce_gradients on two gloo ranks ------------------------------------------
# (shape, dtype, has a gradient): mixed dtypes, so several buckets; one without grad.
_REDUCE_PARAMS = [
    ((3, 4), "float32", True),
    ((5,), "float32", True),
    ((2, 2), "float64", True),
    ((7,), "float32", False),
    ((6,), "float64", True),
    ((4,), "float32", True),
]


def _rank_grads(rank):
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        torch.randn(shape, generator=g, dtype=getattr(torch, dtype)) * (rank + 1)
        if has_grad
        else None
        for shape, dtype, has_grad in _REDUCE_PARAMS
    ]


def _reduce_params(rank):
    params = []
    for (shape, dtype, _), grad in zip(_REDUCE_PARAMS, _rank_grads(rank)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)))
        p.grad = grad
        params.append(p)
    return params


def _all_reduce_worker(rank):
    out = {}
    for name, kwargs in [("default", {}), ("small_buckets", {"bucket_mb": 1e-5})]:
        params = _reduce_params(rank)
        grads = [p.grad for p in params]
        all_reduce_gradients(params, **kwargs)
        out[name] = [
            None
            if p.grad is None
            else {
                "same_tensor": p.grad is g,
                "dtype": str(p.grad.dtype),
                "values": p.grad.flatten().tolist(),
            }
            for p, g in zip(params, grads)
        ]
    return out


@pytest.mark.spawns
def test_all_reduce_gradients_averages_over_two_gloo_ranks(tmp_path):
    results = run_ranks(_all_reduce_worker, WORLD_SIZE, tmp_path)
    per_rank = [_rank_grads(r) for r in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        for name in ("default", "small_buckets"):
            got = result[name]
            assert len(got) == len(_REDUCE_PARAMS)
            for i, (_shape, dtype, has_grad) in enumerate(_REDUCE_PARAMS):
                if not has_grad:
                    assert got[i] is None, f"rank {rank} {name}: param {i} got a gradient"
                    continue
                assert got[i]["same_tensor"], "the gradient was replaced, not written"
                assert got[i]["dtype"] == f"torch.{dtype}"
                expected = (per_rank[0][i] + per_rank[1][i]) / WORLD_SIZE
                actual = torch.tensor(got[i]["values"], dtype=expected.dtype)
                assert_bitwise_equal(
                    actual, expected.flatten(), f"rank {rank} {name}: mean gradient {i}"
                )
    assert results[0] == results[1]


# ---- the reducer's packing, in process (a stand-in all_reduce plays the other ranks) --
def test_the_reducer_packs_reduces_divides_and_unpacks_every_gradient(monkeypatch):
    import torch.distributed as dist

    from cudagraphs.train.gradients import GradientReducer

    grads = [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.full((4,), 2.0, dtype=torch.float32),
        torch.arange(3, dtype=torch.float64),
        torch.ones(2, 2, dtype=torch.float32).t(),  # non-contiguous
    ]
    originals = [g.clone() for g in grads]
    # Two other "ranks" contribute 10x and 100x of this rank's values.
    calls = []

    def fake_all_reduce(flat, group=None):
        calls.append((flat.dtype, flat.numel(), group))
        flat.mul_(1 + 10 + 100)

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    reducer = GradientReducer(grads, group="g", bucket_mb=1e-4)  # 104 bytes per bucket
    reducer()
    for g, o in zip(grads, originals):
        assert torch.allclose(g, o * 111 / 3), (g, o)
    # One collective per bucket, each of one dtype, all on the given group.
    assert [(d, n) for d, n, _ in calls] == [
        (b.grads[0].dtype, sum(b.numels)) for b in reducer.buckets
    ]
    assert {grp for *_, grp in calls} == {"g"} and reducer.world_size == 3
    assert len(reducer.buckets) >= 3  # the dtype change and the size cap both split


def test_all_reduce_gradients_skips_parameters_without_a_gradient(monkeypatch):
    import torch.distributed as dist

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda flat, group=None: seen.append(flat.numel()))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(5))
    a.grad = torch.full((3,), 4.0)
    all_reduce_gradients([a, b])
    assert seen == [3] and b.grad is None
    assert torch.equal(a.grad, torch.full((3,), 2.0))  # the stand-in summed nothing
    seen.clear()
    all_reduce_gradients([b])  # no gradient at all: no collective
    assert seen == []


# ---- all_reduce_gradients: group and bucket size -------------------------------------
def test_all_reduce_gradients_uses_the_given_group_and_bucket_size(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(
        dist, "all_reduce", lambda flat, group=None: calls.append((flat.numel(), group))
    )
    # The group's world size, not the default group's.
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4 if group == "g" else 2)
    params = [torch.nn.Parameter(torch.zeros(10)) for _ in range(3)]
    for p in params:
        p.grad = torch.full((10,), 8.0)
    all_reduce_gradients(params, group="g", bucket_mb=1e-4)  # 104 bytes: two 40-byte grads
    assert calls == [(20, "g"), (10, "g")]
    for p in params:
        assert torch.equal(p.grad, torch.full((10,), 2.0))  # the stand-in summed nothing


def test_guard_compares_values_without_a_boolean_equality_by_what_they_print():
    class Elementwise:  # as a numpy array: == gives something bool() refuses
        def __init__(self, values):
            self.values = list(values)

        def __eq__(self, other):
            raise ValueError("truth value of an array is ambiguous")

        __hash__ = object.__hash__

        def __repr__(self):
            return f"Elementwise({self.values})"

    opt = torch.optim.SGD([_param(3)], lr=0.1)
    opt.param_groups[0]["weights"] = Elementwise([1.0, 2.0])
    guard = HyperparameterGuard.watch(opt)
    guard.check()  # untouched: no false alarm
    opt.param_groups[0]["weights"].values[0] = 3.0
    with pytest.raises(CudaGraphsStateError, match=r"captured Elementwise\(\[1.0, 2.0\]\)"):
        guard.check()


def test_the_planned_device_lr_is_a_bool_whatever_the_flags_hold():
    opt = torch.optim.SGD([_param(3)], lr=0.1, foreach=False)
    opt.param_groups[0]["fused"] = 1  # truthy, not a bool
    (plan,) = plan_optimizer(opt, "keep", "cuda")
    assert plan.device_lr is True
