"""Replay contracts of partial graphs: what a recorded call fixes, why a later call falls
back, bounded variants and the fallback counters (CPU only)."""

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError, Mismatch
from cudagraphs.partial import CallContract, ContractSet, FallbackCounter
from cudagraphs.partial.contract import REASONS, same_control


def t(*shape, **kw):
    return torch.randn(*shape, **kw)


def record(args, kwargs=None, training=True):
    return CallContract.from_call(args, kwargs or {}, training=training)


def reason(contract, args, kwargs=None, training=True):
    got, tensors = contract.match(args, kwargs or {}, training=training)
    if got is not None:
        assert tensors == [], "a refused call must not hand out tensors"
    return got


class ArrayLike:
    """Equality that returns an element-wise result, like numpy arrays and tensors."""

    def __eq__(self, other):
        return [True, True]

    __hash__ = object.__hash__


class Unequal:
    def __eq__(self, other):
        raise RuntimeError("ambiguous comparison")

    __hash__ = object.__hash__


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

STRUCTURE_CHANGES = {
    "extra kwarg": ((t(2),), {}, (t(2),), {"extra": 1}),
    "missing kwarg": ((t(2),), {"mask": t(2)}, (t(2),), {}),
    "renamed kwarg": ((t(2),), {"mask": t(2)}, (t(2),), {"maskk": t(2)}),
    "extra positional": ((t(2),), {}, (t(2), t(2)), {}),
    "nesting": (((t(2), t(2)),), {}, (t(2), t(2)), {}),
    "tuple vs list": (((t(2), t(2)),), {}, ([t(2), t(2)],), {}),
    "tensor replaced by int": ((t(2), 1), {}, (1, 1), {}),
    "int replaced by tensor": ((t(2), 1), {}, (t(2), t(2)), {}),
    "None replaced by tensor": ((t(2),), {"mask": None}, (t(2),), {"mask": t(2)}),
}


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
    from cudagraphs.partial.contract import _autocast_text

    both = (("cuda", torch.bfloat16), ("cpu", torch.float16))
    assert _autocast_text(both) == "cuda: bfloat16, cpu: float16"
    assert _autocast_text(()) == "off"


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


# --- ContractSet -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1])
def test_contract_set_max_variants_validation(bad):
    with pytest.raises(CudaGraphsValueError, match="max_variants must be an int >= 1"):
        ContractSet(max_variants=bad)


@pytest.mark.parametrize("bad", [1.5, "2", None, True])
def test_contract_set_max_variants_type(bad):
    # Not a count at all (True included): a type error, still naming the argument.
    with pytest.raises(CudaGraphsTypeError, match="max_variants must be an int"):
        ContractSet(max_variants=bad)


def test_contract_set_bounded_add():
    s = ContractSet(max_variants=2)
    assert s.max_variants == 2
    assert s.add(record((t(1, 8),))) == 0
    assert s.add(record((t(1, 12),))) == 1
    assert s.add(record((t(1, 8),))) == 0, "an identical contract reuses its index"
    assert s.add(record((t(1, 16),))) is None, "full"
    assert s.add(record((t(1, 12),))) == 1, "known variants are still found when full"
    assert len(s.variants) == 2
    assert ContractSet().max_variants == 4


def test_contract_set_match_picks_the_variant():
    s = ContractSet(max_variants=3)
    s.add(record((t(1, 8),), {"mask": None}))
    s.add(record((t(1, 12),), {"mask": None}))
    x12 = t(1, 12)
    idx, why, tensors = s.match((x12,), {"mask": None}, training=True)
    assert (idx, why) == (1, "") and tensors[0] is x12
    idx, why, _ = s.match((t(1, 8),), {"mask": None}, training=True)
    assert (idx, why) == (0, "")


def test_contract_set_reports_the_first_variants_reason():
    s = ContractSet()
    s.add(record((t(1, 8),), {"mask": None}))  # variant 0 would say "shape"
    s.add(record((t(1, 16),), {"mask": 1}))  # variant 1 would say "control"
    assert s.match((t(1, 12),), {"mask": None}, training=True) == (None, "shape", [])
    # Variant 0 differs in shape and control: "shape" comes first in REASONS order.
    assert s.match((t(1, 16),), {"mask": 2}, training=True) == (None, "shape", [])


def test_empty_contract_set_reports_structure():
    assert ContractSet().match((t(2),), {}, training=True) == (None, "structure", [])


def test_contract_set_keeps_controls_that_differ_by_type():
    x = t(2)
    s = ContractSet()
    assert [s.add(record((x,), {"ctl": v})) for v in (1, 1.0, True)] == [0, 1, 2]
    assert s.match((x,), {"ctl": True}, training=True)[0] == 2


def test_contract_set_keeps_eval_and_training_variants_apart():
    # An eval-mode call (dropout off) recorded into the training variant would replay
    # the wrong graph: the mode is part of a variant's identity.
    x = t(2)
    s = ContractSet()
    assert s.add(record((x,), training=True)) == 0
    assert s.add(record((x,), training=False)) == 1
    assert s.add(record((x,), training=False)) == 1
    assert s.match((x,), {}, training=False)[:2] == (1, "")
    assert s.match((x,), {}, training=True)[:2] == (0, "")
    assert not record((x,), training=True).same_as(record((x,), training=False))


def test_contract_set_keeps_grad_mode_variants_apart():
    x = t(2)
    s = ContractSet()
    assert s.add(record((x,))) == 0
    with torch.no_grad():
        assert s.add(record((x,))) == 1
        assert s.match((x,), {}, training=True)[:2] == (1, "")
    assert s.match((x,), {}, training=True)[:2] == (0, "")


SHARED = t(2)


@pytest.mark.parametrize(
    "a, b",
    [
        (((t(2),), {}), ((t(2),), {"k": None})),  # structure
        (((t(2), 1), {}), ((1, t(2)), {})),  # tensor positions
        (((t(2),), {}), ((t(3),), {})),  # tensor metadata
        (((SHARED, SHARED), {}), ((t(2), t(2)), {})),  # alias pattern
        (((t(2), 1), {}), ((t(2), 2), {})),  # control value
    ],
    ids=["structure", "positions", "meta", "alias", "control"],
)
def test_same_as_tells_every_recorded_difference(a, b):
    ca, cb = record(*a), record(*b)
    assert ca.same_as(ca) and cb.same_as(cb)
    assert not ca.same_as(cb) and not cb.same_as(ca)
    s = ContractSet()
    assert (s.add(ca), s.add(cb)) == (0, 1)


def test_contract_set_keeps_array_like_controls_apart():
    x = t(2)
    s = ContractSet()
    assert s.add(record((x, ArrayLike()))) == 0
    assert s.add(record((x, ArrayLike()))) == 1


def test_contract_set_add_survives_raising_eq():
    x = t(2)
    s = ContractSet()
    assert s.add(record((x, Unequal()))) == 0
    assert s.add(record((x, Unequal()))) == 1


def test_contract_set_nan_control_is_one_variant():
    x = t(2)
    s = ContractSet()
    assert s.add(record((x,), {"eps": float("nan")})) == 0
    assert s.add(record((x,), {"eps": float("nan")})) == 0


# --- FallbackCounter -------------------------------------------------------------------


def test_fallback_counter():
    c = FallbackCounter()
    assert c.as_dict() == {"replayed": 0, "fallbacks": 0}
    c.replay()
    c.replay()
    for r in ("shape", "control", "shape", "alias"):
        c.fallback(r)
    assert c.as_dict() == {
        "replayed": 2,
        "fallbacks": 4,
        "fallback_alias": 1,
        "fallback_control": 1,
        "fallback_shape": 2,
    }
    assert list(c.as_dict()) == [
        "replayed",
        "fallbacks",
        "fallback_alias",
        "fallback_control",
        "fallback_shape",
    ]


def test_counter_with_contract_set_loop():
    """What a manager does per call: replay on a match, else count the reason."""
    s, counter = ContractSet(max_variants=1), FallbackCounter()
    s.add(record((t(1, 8),)))
    for x in (t(1, 8), t(1, 12), t(1, 8).double(), t(1, 8)):
        idx, why, _ = s.match((x,), {}, training=True)
        if idx is None:
            counter.fallback(why)
        else:
            counter.replay()
    assert counter.as_dict() == {
        "replayed": 2,
        "fallbacks": 2,
        "fallback_dtype": 1,
        "fallback_shape": 1,
    }


# --- a real HF forward ------------------------------------------------------------------


def test_contracts_recorded_from_a_real_llama_forward():
    pytest.importorskip("transformers")
    from _hf_models import tiny
    from cudagraphs.partial import select_targets

    model = tiny("llama")
    targets = select_targets(model)
    assert [x.kind for x in targets] == ["attention", "attention"]
    calls = []

    def hook(module, args, kwargs):
        calls.append((module, args, kwargs, module.training))

    handles = [x.module.register_forward_pre_hook(hook, with_kwargs=True) for x in targets]
    try:
        # use_cache=False: a KV cache object is a per-forward control (new object each
        # forward, compared by identity), so every call would fall back on "control".
        def forward(seq):
            calls.clear()
            model(torch.randint(0, 128, (1, seq)), use_cache=False)
            assert [c[0] for c in calls] == [x.module for x in targets]
            return list(calls)

        contracts = [CallContract.from_call(a, k, training=tr) for _, a, k, tr in forward(8)]
        assert all(c.tensor_positions for c in contracts)

        for c, (_, a, k, tr) in zip(contracts, forward(8)):
            got, tensors = c.match(a, k, training=tr)
            assert got is None
            assert tensors[0] is k["hidden_states"]
        reasons = [
            c.match(a, k, training=tr)[0] for c, (_, a, k, tr) in zip(contracts, forward(12))
        ]
        assert reasons == ["shape", "shape"]

        model.eval()
        reasons = [c.match(a, k, training=tr)[0] for c, (_, a, k, tr) in zip(contracts, forward(8))]
        assert reasons == ["training", "training"]
    finally:
        for h in handles:
            h.remove()
    assert all(not x.module._forward_pre_hooks for x in targets)


# --- mismatch records ------------------------------------------------------------------


def _cases():
    """(recorded args, kwargs, training; call args, kwargs, training; grad on) across
    every kind of difference, for the mismatches / differences agreement."""
    x, y = t(2), t(2)
    cases = {
        f"structure: {k}": (ra, rk, True, ca, ck, True, True)
        for k, (ra, rk, ca, ck) in STRUCTURE_CHANGES.items()
    }
    cases.update(
        {
            "same": ((t(2, 3),), {"m": 1}, True, (t(2, 3),), {"m": 1}, True, True),
            "shape": ((t(2, 3),), {}, True, (t(3, 2),), {}, True, True),
            "stride": ((t(4, 4),), {}, True, (t(4, 4).t(),), {}, True, True),
            "dtype": ((t(2),), {}, True, (t(2, dtype=torch.float64),), {}, True, True),
            "device": ((t(2),), {}, True, (torch.empty(2, device="meta"),), {}, True, True),
            "requires_grad": ((t(2),), {}, True, (t(2, requires_grad=True),), {}, True, True),
            "tensor_type": ((t(2),), {}, True, (nn.Parameter(t(2)),), {}, True, True),
            "alias": ((x, y), {}, True, (x, x), {}, True, True),
            "control": ((x,), {"c": 1}, True, (x,), {"c": 1.0}, True, True),
            "grad_mode": ((x,), {}, True, (x,), {}, True, False),
            "training": ((x,), {}, True, (x,), {}, False, True),
            "many": ((t(2, 3), 1), {}, True, (t(3, 3, dtype=torch.float64), 2), {}, False, False),
            "structure and modes": ((t(2),), {}, True, (t(2), 1), {}, False, False),
        }
    )
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatches_say_what_differences_say(case):
    rec_args, rec_kwargs, rec_training, args, kwargs, training, grad = CASES[case]
    c = record(rec_args, rec_kwargs, training=rec_training)
    with torch.set_grad_enabled(grad):
        found = c.mismatches(args, kwargs, training=training)
        assert {m.field for m in found} == c.differences(args, kwargs, training=training)
        assert (found == []) == (c.match(args, kwargs, training=training)[0] is None)
    assert all(isinstance(m, Mismatch) for m in found)


def test_mismatches_name_paths_and_values():
    h, mask, cos, sin = t(2, 4), t(4, 4), t(4, 2), t(4, 2)
    c = record((h,), {"attention_mask": mask, "rope": (cos, sin), "impl": "sdpa"})
    found = c.mismatches(
        (h,),
        {"attention_mask": t(4, 5), "rope": (cos, sin.double()), "impl": "eager"},
        training=True,
    )
    assert found == [
        Mismatch("kwargs['attention_mask']", "shape", (4, 4), (4, 5)),
        Mismatch("kwargs['attention_mask']", "stride", (4, 1), (5, 1)),
        Mismatch("kwargs['impl']", "control", "sdpa", "eager"),
        Mismatch("kwargs['rope'][1]", "dtype", torch.float32, torch.float64),
    ], "every difference at once, in call order (kwargs sorted by name)"


def test_mismatches_show_types_and_devices_readably():
    c = record((t(2), t(2)))
    found = c.mismatches((nn.Parameter(t(2)), torch.empty(2, device="meta")), {}, training=True)
    assert found == [
        Mismatch("args[0]", "tensor_type", "Tensor", "Parameter"),
        Mismatch("args[0]", "requires_grad", False, True),
        Mismatch("args[1]", "device", "cpu", "meta"),
    ]


def test_mismatches_alias_names_the_other_argument():
    x, y = t(2), t(2)
    assert record((x, y)).mismatches((x, x), {}, training=True) == [
        Mismatch("args[1]", "alias", "its own tensor", "the same tensor as args[0]")
    ]
    assert record((), {"a": x, "b": x}).mismatches((), {"a": x, "b": y}, training=True) == [
        Mismatch("kwargs['b']", "alias", "the same tensor as kwargs['a']", "its own tensor")
    ]


def test_mismatches_modes():
    c = record((t(2),))
    with torch.no_grad():
        assert c.mismatches((t(2),), {}, training=False) == [
            Mismatch("torch.is_grad_enabled()", "grad_mode", True, False),
            Mismatch("module.training", "training", True, False),
        ]


@pytest.mark.parametrize(
    "change, want",
    [
        ("extra kwarg", [Mismatch("kwargs['extra']", "structure", "absent", "int")]),
        ("missing kwarg", [Mismatch("kwargs['mask']", "structure", "Tensor", "absent")]),
        (
            "renamed kwarg",
            [
                Mismatch("kwargs['mask']", "structure", "Tensor", "absent"),
                Mismatch("kwargs['maskk']", "structure", "absent", "Tensor"),
            ],
        ),
        ("None replaced by tensor", [Mismatch("kwargs['mask']", "structure", "None", "Tensor")]),
        ("tensor replaced by int", [Mismatch("args[0]", "structure", "Tensor", "int")]),
        ("int replaced by tensor", [Mismatch("args[1]", "structure", "int", "Tensor")]),
        (
            "tuple vs list",
            [
                Mismatch(
                    "(args, kwargs)",
                    "structure",
                    "(((Tensor, Tensor),), {})",
                    "(([Tensor, Tensor],), {})",
                )
            ],
        ),
    ],
)
def test_structure_mismatches_locate_the_change(change, want):
    rec_args, rec_kwargs, args, kwargs = STRUCTURE_CHANGES[change]
    assert record(rec_args, rec_kwargs).mismatches(args, kwargs, training=True) == want


def test_structure_mismatches_report_a_changed_role_at_a_path_both_calls_have():
    # An extra argument changes the structure; at the paths both calls share, a leaf
    # that changed between tensor, None and a control value is reported, while a
    # control replaced by a control of another type (1 -> "b") is not a structure
    # difference.
    x = t(2)
    c = record((x, None, 1, "a", x, None))
    assert c.mismatches((None, x, "b", 2, 3, 4, x), {}, training=True) == [
        Mismatch("args[0]", "structure", "Tensor", "None"),
        Mismatch("args[1]", "structure", "None", "Tensor"),
        Mismatch("args[4]", "structure", "Tensor", "int"),
        Mismatch("args[5]", "structure", "None", "int"),
        Mismatch("args[6]", "structure", "absent", "Tensor"),
    ]


def test_structure_mismatch_skeleton_shows_control_kinds():
    c = record(((t(2), 1, "causal"),))
    assert c.mismatches(([t(2), 1, "causal"],), {}, training=True) == [
        Mismatch(
            "(args, kwargs)",
            "structure",
            "(((Tensor, int, str),), {})",
            "(([Tensor, int, str],), {})",
        )
    ]


@dataclasses.dataclass
class StrictBox:
    """A pytree container that refuses non-tensor children (so no skeleton of it)."""

    x: object

    def __post_init__(self):
        if not isinstance(self.x, torch.Tensor):
            raise TypeError("x must be a tensor")


@dataclasses.dataclass
class LooseBox:
    x: object


pytree.register_dataclass(StrictBox)
pytree.register_dataclass(LooseBox)


def test_structure_mismatch_of_a_container_that_refuses_placeholders_shows_its_spec():
    x = t(2)
    c = record((StrictBox(x),))
    assert c.mismatches((LooseBox(x),), {}, training=True) == [
        Mismatch("(args, kwargs)", "structure", str(c.in_spec), "((LooseBox(x=Tensor),), {})")
    ]


def test_mismatch_report_renders_with_the_shared_format():
    from cudagraphs.errors import describe_mismatches

    c = record((), {"attention_mask": t(4, 4)})
    text = describe_mismatches(
        "call differs", c.mismatches((), {"attention_mask": t(4, 5)}, training=True)
    )
    assert "kwargs['attention_mask']: shape expected (4, 4), received (4, 5)" in text


def test_contract_set_mismatches_use_the_first_variant():
    s = ContractSet()
    s.add(record((t(1, 8),)))
    s.add(record((t(1, 16),)))
    assert s.mismatches((t(1, 16),), {}, training=True)[0] == Mismatch(
        "args[0]", "shape", (1, 8), (1, 16)
    ), "the variant whose reason match() reports"
    assert s.mismatches((t(1, 8),), {}, training=True) == []
    (empty,) = ContractSet().mismatches((t(2),), {}, training=True)
    assert empty.field == "structure"
    assert empty == Mismatch("(args, kwargs)", "structure", "a recorded call", "none recorded")


def test_leaf_kinds_take_no_part_in_matching_or_equality():
    import dataclasses

    c = record((t(2),), {"mask": None})
    assert c.leaf_kinds == (("args[0]", "Tensor"), ("kwargs['mask']", "None"))
    bare = dataclasses.replace(c, leaf_kinds=())
    assert bare == c and bare.same_as(c)


def test_match_and_differences_build_no_key_paths(monkeypatch):
    # The per-call path stays as cheap as before: key paths only for reports.
    from cudagraphs.partial import contract

    c = record((t(2),), {"k": 1})

    def refuse(*args, **kwargs):
        raise AssertionError("key paths built on the per-call path")

    monkeypatch.setattr(contract.pytree, "tree_flatten_with_path", refuse)
    assert c.match((t(3),), {"k": 1}, training=True)[0] == "shape"
    assert c.differences((t(3),), {"k": 2}, training=True) == {"shape", "control"}
    s = ContractSet()
    s.variants.append(c)
    assert s.match((t(3),), {"k": 1}, training=True)[:2] == (None, "shape")


@pytest.mark.parametrize("case", ["same", "many", "structure and modes", "shape"])
def test_mismatches_say_what_differences_say_under_another_autocast_state(case):
    rec_args, rec_kwargs, rec_training, args, kwargs, training, grad = CASES[case]
    c = record(rec_args, rec_kwargs, training=rec_training)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        found = c.mismatches(args, kwargs, training=training)
        assert "autocast" in {m.field for m in found}
        assert {m.field for m in found} == c.differences(args, kwargs, training=training)
        assert c.match(args, kwargs, training=training)[0] is not None
