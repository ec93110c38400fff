"""Sets of call contracts and their fallbacks (CPU): ContractSet (variants, the first
match replays), FallbackCounter, a real HF forward's call, and the mismatch records."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError, Mismatch
from cudagraphs.partial import CallContract, ContractSet, FallbackCounter
from helpers.contracts import (
    STRUCTURE_CHANGES,
    ArrayLike,
    Unequal,
    record,
    t,
)
from helpers.discovery import ATTN_ROUTER

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
    from cudagraphs.partial import select_targets
    from helpers.hf_models import tiny

    model = tiny("llama")
    targets = select_targets(model, scopes=ATTN_ROUTER)
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
