"""capture_time_hooks canonicalization and invocation (CPU only)."""

import pytest
import torch

from cudagraphs import CaptureTimeHookError
from cudagraphs.core.hooks import HOOK_GROUPS, CaptureTimeHooks, canonicalize_capture_time_hooks


def test_none_gives_empty_groups_per_callable():
    hooks = canonicalize_capture_time_hooks(None, 3)
    assert len(hooks) == 3
    for i, h in enumerate(hooks):
        assert h.callable_index == i
        assert all(getattr(h, g) == () for g in HOOK_GROUPS)


def test_missing_groups_are_filled_and_order_is_kept():
    def a(m):
        return None

    def b(m):
        return None

    hooks = canonicalize_capture_time_hooks([None, {"forward_hooks": {"x": a, "y": b}}], 2)
    assert hooks[0] == CaptureTimeHooks()
    assert hooks[1].forward_hooks == (("x", a), ("y", b))
    assert hooks[1].forward_pre_hooks == ()
    assert hooks[1].backward_hooks == ()


def test_group_may_be_none():
    hooks = canonicalize_capture_time_hooks([{"backward_hooks": None}], 1)
    assert hooks[0].backward_hooks == ()


@pytest.mark.parametrize("value, n", [([], 1), ([None], 2), ([None, None, None], 2)])
def test_wrong_length_is_value_error(value, n):
    with pytest.raises(ValueError, match=f"has {len(value)} entries but there are {n} callables"):
        canonicalize_capture_time_hooks(value, n)


def test_unknown_key_is_value_error_naming_entry_and_key():
    with pytest.raises(
        ValueError, match=r"capture_time_hooks\[1\] has unknown key\(s\) \['forward_pre'\]"
    ):
        canonicalize_capture_time_hooks([None, {"forward_pre": {}}], 2)
    # the upstream discussion's *_with_kwargs variants are not part of the contract
    with pytest.raises(ValueError, match="forward_hooks_with_kwargs"):
        canonicalize_capture_time_hooks([{"forward_hooks_with_kwargs": {}}], 1)


@pytest.mark.parametrize(
    "value, match",
    [
        # each message names the type it received
        ({"forward_hooks": {}}, "must be a list.*, got dict"),
        ("forward_hooks", "must be a list.*, got str"),
        (5, "must be a list.*, got int"),
        ([5], r"capture_time_hooks\[0\] must be None or a dict, got int"),
        ([{"forward_hooks": [print]}], r"\['forward_hooks'\] must be a dict .*, got list"),
        (
            [{"backward_hooks": {"h": 3}}],
            r"\['backward_hooks'\]\['h'\] is not callable \(got int\)",
        ),
    ],
)
def test_wrong_types_are_type_errors(value, match):
    with pytest.raises(TypeError, match=match):
        canonicalize_capture_time_hooks(value, 1)


def test_run_calls_hooks_in_order_with_the_module():
    seen = []
    module = torch.nn.Linear(2, 2)
    hooks = canonicalize_capture_time_hooks(
        [
            {
                "forward_pre_hooks": {
                    1: lambda m: seen.append(("first", m)),
                    0: lambda m: seen.append(("second", m)),
                }
            }
        ],
        1,
    )[0]
    hooks.run("forward_pre_hooks", module)
    hooks.run("forward_hooks", module)  # empty: no-op
    assert [s[0] for s in seen] == ["first", "second"]
    assert all(s[1] is module for s in seen)


def test_hook_returning_a_value_is_runtime_error_naming_it():
    hooks = canonicalize_capture_time_hooks(
        [None, {"backward_pre_hooks": {"unshard": lambda m: m}}], 2
    )[1]
    with pytest.raises(
        CaptureTimeHookError,
        match=r"capture_time_hooks\[1\]\['backward_pre_hooks'\]\['unshard'\] returned Linear",
    ):
        hooks.run("backward_pre_hooks", torch.nn.Linear(1, 1))
    assert issubclass(CaptureTimeHookError, RuntimeError)


@pytest.mark.parametrize(
    ("value", "named"),
    [(False, "bool"), (0, "int"), ([], "list"), ("", "str"), (torch.zeros(2), "Tensor")],
    ids=["False", "0", "empty_list", "empty_str", "tensor"],
)
def test_any_value_but_none_is_refused_falsy_and_tensors_included(value, named):
    # Checked with `is not None`: a falsy value is still a value, and a tensor has no
    # truth value to ask.
    hooks = canonicalize_capture_time_hooks([{"forward_hooks": {"h": lambda m: value}}], 1)[0]
    with pytest.raises(CaptureTimeHookError, match=rf"\['h'\] returned {named}"):
        hooks.run("forward_hooks", torch.nn.Linear(1, 1))
    ok = canonicalize_capture_time_hooks([{"forward_hooks": {"h": lambda m: None}}], 1)[0]
    ok.run("forward_hooks", torch.nn.Linear(1, 1))


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"forward_hooks": [print]}, r"capture_time_hooks\[1\]\['forward_hooks'\] must be a dict"),
        ({"backward_hooks": {"h": 3}}, r"capture_time_hooks\[1\]\['backward_hooks'\]\['h'\]"),
    ],
)
def test_group_type_errors_name_the_entry_they_are_in(entry, match):
    # Entry 0 is fine; the message must point at entry 1, not at the first entry.
    with pytest.raises(TypeError, match=match):
        canonicalize_capture_time_hooks([None, entry], 2)


@pytest.mark.parametrize("group", [[], (), 0, "", False, set()], ids=repr)
def test_a_falsy_group_that_is_not_a_dict_is_refused_not_taken_as_none(group):
    # Only None means "no hooks here"; an empty list is the wrong type, like a full one.
    with pytest.raises(
        TypeError, match=r"capture_time_hooks\[0\]\['forward_hooks'\] must be a dict"
    ):
        canonicalize_capture_time_hooks([{"forward_hooks": group}], 1)
    assert canonicalize_capture_time_hooks([{"forward_hooks": {}}], 1)[0].forward_hooks == ()
