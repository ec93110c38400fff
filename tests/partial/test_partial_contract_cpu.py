"""Call contracts of partial graphs (CPU): what a recording accepts, one reason per kind of
change, same_control, and tensors passed twice."""

import math

import pytest
import torch
from torch import nn

from cudagraphs.errors import Mismatch
from cudagraphs.partial import ContractSet
from cudagraphs.partial.contract import REASONS, same_control
from helpers.contracts import (
    STRUCTURE_CHANGES,
    ArrayLike,
    Unequal,
    reason,
    record,
    t,
)

# --- recording and a matching call ----------------------------------------------------


def test_identical_call_matches_and_returns_tensors_in_order():
    h, mask, cos, sin = t(2, 4), t(4, 4), t(4, 2), t(4, 2)
    args = (h, 3)
    kwargs = {"attention_mask": mask, "rope": (cos, sin), "scale": 0.5, "impl": "sdpa"}
    c = record(args, kwargs)
    assert c.tensor_meta[0] == (torch.Tensor, (2, 4), (4, 1), torch.float32, h.device, False)
    assert c.grad_enabled is True and c.training is True

    h2, mask2, cos2, sin2 = t(2, 4), t(4, 4), t(4, 2), t(4, 2)
    kwargs2 = {"attention_mask": mask2, "rope": (cos2, sin2), "scale": 0.5, "impl": "sdpa"}
    got, tensors = c.match((h2, 3), kwargs2, training=True)
    assert got is None
    # Positional args first, then kwargs by name: attention_mask, rope.
    assert [id(x) for x in tensors] == [id(h2), id(mask2), id(cos2), id(sin2)]


def test_kwargs_order_does_not_matter():
    a, b = t(2), t(3)
    c = record((), {"a": a, "b": b, "flag": True})
    got, tensors = c.match((), {"flag": True, "b": b, "a": a}, training=True)
    assert got is None and [id(x) for x in tensors] == [id(a), id(b)]


def test_reasons_are_the_documented_set():
    assert REASONS == (
        "structure",
        "tensor_type",
        "device",
        "dtype",
        "shape",
        "stride",
        "requires_grad",
        "alias",
        "control",
        "grad_mode",
        "autocast",
        "training",
    )


# --- one reason per kind of change --------------------------------------------------


@pytest.mark.parametrize("change", sorted(STRUCTURE_CHANGES))
def test_structure(change):
    rec_args, rec_kwargs, args, kwargs = STRUCTURE_CHANGES[change]
    assert reason(record(rec_args, rec_kwargs), args, kwargs) == "structure"


def test_tensor_type():
    c = record((t(2, 2),))
    assert reason(c, (nn.Parameter(t(2, 2), requires_grad=False),)) == "tensor_type"
    c = record((nn.Parameter(t(2, 2), requires_grad=False),))
    assert reason(c, (t(2, 2),)) == "tensor_type"


@pytest.mark.parametrize(
    "recorded, call, want",
    [
        (lambda: t(2, 3), lambda: t(3, 2), "shape"),
        (lambda: t(2, 3), lambda: t(2, 3, 1), "shape"),
        (lambda: t(4, 4), lambda: t(4, 4).t(), "stride"),
        (lambda: t(2, 3), lambda: t(2, 6)[:, ::2], "stride"),
        (lambda: t(2, 3), lambda: t(2, 3, dtype=torch.float64), "dtype"),
        (lambda: t(2, 3), lambda: torch.empty(2, 3, device="meta"), "device"),
        (lambda: t(2, 3), lambda: t(2, 3, requires_grad=True), "requires_grad"),
        (lambda: t(2, 3, requires_grad=True), lambda: t(2, 3), "requires_grad"),
    ],
    ids=["shape", "rank", "transposed", "sliced", "dtype", "device", "rg_on", "rg_off"],
)
def test_tensor_metadata(recorded, call, want):
    rec, new = recorded(), call()
    if want == "stride":
        assert rec.shape == new.shape and not new.is_contiguous()
    assert reason(record((rec,)), (new,)) == want


def test_alias_pattern():
    x, y = t(2), t(2)
    distinct = record((x, y))
    assert distinct.alias == (0, 1)
    assert reason(distinct, (x, x)) == "alias"

    same = record((x, x))
    assert same.alias == (0, 0)
    assert reason(same, (x, y)) == "alias"
    got, tensors = same.match((y, y), {}, training=True)
    assert got is None and [id(v) for v in tensors] == [id(y), id(y)]


def test_alias_is_object_identity_not_storage():
    # Two views of one storage are distinct objects; the pattern is about objects.
    base = t(4)
    c = record((base[:2], base[2:]))
    assert c.alias == (0, 1)
    assert reason(c, (t(2), t(2))) is None


@pytest.mark.parametrize(
    "recorded, call",
    [
        (1, 2),
        (1, 1.0),
        (1, True),
        (1.0, True),
        (0, False),
        (None, 0),
        (0, None),
        ("causal", "full"),
        ((1, 2), (1, 3)),
        (torch.float32, torch.float16),
    ],
    ids=repr,
)
def test_control(recorded, call):
    x = t(2)
    c = record((x,), {"ctl": recorded})
    assert reason(c, (x,), {"ctl": call}) == "control"
    assert reason(c, (x,), {"ctl": recorded}) is None


def test_equal_controls_that_are_distinct_objects_match():
    x = t(2)
    c = record((x,), {"impl": "".join(["sd", "pa"]), "big": 10**30, "nan": float("nan")})
    assert reason(c, (x,), {"impl": "sdpa", "big": 10**30 + 0, "nan": float("nan")}) is None


def test_array_like_controls_are_compared_by_identity():
    x, obj = t(2), ArrayLike()
    c = record((x, obj))
    assert reason(c, (x, obj)) is None
    assert reason(c, (x, ArrayLike())) == "control"


def test_control_whose_eq_raises_is_a_mismatch_not_an_error():
    x, obj = t(2), Unequal()
    c = record((x, obj))
    assert reason(c, (x, obj)) is None
    assert reason(c, (x, Unequal())) == "control"


def test_grad_mode():
    x = t(2)
    c = record((x,))
    with torch.no_grad():
        assert reason(c, (x,)) == "grad_mode"
        c_ng = record((x,))
    assert c_ng.grad_enabled is False
    assert reason(c_ng, (x,)) == "grad_mode"
    with torch.inference_mode():
        assert reason(c, (x,)) == "grad_mode"


def test_autocast_state():
    x = t(2)
    c = record((x,))
    assert c.autocast == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert reason(c, (x,)) == "autocast"
        c_bf16 = record((x,))
    assert c_bf16.autocast == (("cpu", torch.bfloat16),)
    assert reason(c_bf16, (x,)) == "autocast"
    with torch.autocast("cpu", dtype=torch.float16):
        assert reason(c_bf16, (x,)) == "autocast", "another dtype is another state"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert reason(c_bf16, (x,)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert reason(c_bf16, (x,)) == "autocast", "a disabled region is no autocast"


def test_autocast_variants_are_kept_apart():
    x = t(2)
    variants = ContractSet(4)
    assert variants.add(record((x,))) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert variants.add(record((x,))) == 1
        assert variants.match((x,), {}, training=True)[0] == 1
    assert variants.match((x,), {}, training=True)[0] == 0


def test_mismatches_show_the_autocast_states():
    c = record((t(2),))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert c.mismatches((t(2),), {}, training=True) == [
            Mismatch("torch.autocast", "autocast", "off", "cpu: bfloat16")
        ]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c_bf16 = record((t(2),))
    assert c_bf16.mismatches((t(2),), {}, training=True) == [
        Mismatch("torch.autocast", "autocast", "cpu: bfloat16", "off")
    ]


def test_autocast_states_of_several_devices_read_as_one_list():
    from cudagraphs.partial.contract import autocast_text

    both = (("cuda", torch.bfloat16), ("cpu", torch.float16))
    assert autocast_text(both) == "cuda: bfloat16, cpu: float16"
    assert autocast_text(()) == "off"


def test_training_flag():
    x = t(2)
    c = record((x,), training=True)
    assert reason(c, (x,), training=False) == "training"
    assert reason(record((x,), training=False), (x,), training=True) == "training"


@pytest.mark.parametrize(
    "recorded, call, want",
    [
        ((t(2), 1), (t(3), "x", "extra"), "structure"),
        ((nn.Parameter(t(2), requires_grad=False),), (t(3),), "tensor_type"),
        ((t(2, 3),), (t(2, 3).t(),), "shape"),
        ((t(2), t(2)), (t(3),) * 2, "shape"),
        pytest.param(
            (t(2),),
            (t(3, dtype=torch.float64),),
            "dtype",
        ),
        pytest.param(
            (t(2),),
            (torch.empty(3, device="meta"),),
            "device",
        ),
        pytest.param(
            (t(2), 1),
            (t(3), 2),
            "shape",
        ),
    ],
    ids=["structure", "type>shape", "shape>stride", "shape>alias", "dtype>shape",
         "device>shape", "shape>control"],
)  # fmt: skip
def test_first_reason_in_reasons_order_is_reported(recorded, call, want):
    """CallContract.match documents "the first reason from REASONS that applies"."""
    assert reason(record(recorded), call) == want


def test_grad_mode_and_training_are_reported_after_structure():
    c = record((t(2),))
    with torch.no_grad():
        assert reason(c, (t(2), 1)) == "structure"
    assert reason(c, (t(3),), training=False) == "shape"


# --- same_control -------------------------------------------------------------------


def test_same_control_values():
    assert same_control(1, 1) and same_control("a", "a") and same_control(None, None)
    assert same_control(float("nan"), float("nan"))
    assert not same_control(float("nan"), 1.0)
    assert not same_control(1, 1.0) and not same_control(1, True) and not same_control(0.0, False)
    assert not same_control(None, 0)
    assert same_control((1, "a"), (1, "a")) and not same_control((1,), [1])
    assert same_control(math.inf, math.inf) and not same_control(math.inf, -math.inf)


def test_same_control_array_like_by_identity():
    a = ArrayLike()
    assert same_control(a, a)
    assert not same_control(a, ArrayLike())


def test_same_control_exception_in_eq_is_false():
    a = Unequal()
    assert same_control(a, a)
    assert not same_control(a, Unequal())


def test_same_control_never_asks_tensor_equality():
    # A tensor compared here would raise "Boolean value of Tensor ... is ambiguous"
    # or compare values; neither may happen.
    x = t(3)
    assert same_control(x, x)
    assert not same_control(x, x.clone())


# --- unique tensor indices -------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, want_alias, want_unique",
    [
        ("abc", (0, 1, 2), (0, 1, 2)),
        ("aba", (0, 1, 0), (0, 1)),
        ("aab", (0, 0, 2), (0, 2)),
        ("abab", (0, 1, 0, 1), (0, 1)),
        ("aaa", (0, 0, 0), (0,)),
    ],
)
def test_unique_tensor_indices(pattern, want_alias, want_unique):
    objs = {k: t(2) for k in set(pattern)}
    c = record(tuple(objs[k] for k in pattern))
    assert c.alias == want_alias
    assert c.unique_tensor_indices() == want_unique


def test_unique_tensor_indices_across_args_and_kwargs():
    x, y = t(2), t(2)
    c = record((x, 5), {"k": x, "m": (y, x)})
    assert c.alias == (0, 0, 2, 0)
    assert c.unique_tensor_indices() == (0, 2)
    assert record((), {}).unique_tensor_indices() == ()
