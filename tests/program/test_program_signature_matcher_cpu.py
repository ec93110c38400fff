"""The replay path's signature checks (CPU): the generated fast path (matcher.py) and
the validator (generated structure checks plus torch's tensor guard)."""

import pytest
import torch
from hypothesis import given, settings

from cudagraphs.program import (
    SignatureMismatchError,
    ValueTreeSignature,
)
from helpers.program_trees import (
    LEAF_TYPES,
    QuantizedTensor,
    leaf_tensors,
    map_tensors,
    shifted,
    trees,
)
from helpers.signatures import (
    one_mutation,
    signature,
)

SETTINGS = settings(max_examples=50, deadline=None)


# ---- the generated fast path (matcher.py) ---------------------------------------------


@settings(max_examples=50, deadline=None)
@given(tree=trees())
def test_fast_path_and_extract_agree_with_the_full_walk(tree):
    sig = ValueTreeSignature.from_value(tree, leaf_types=LEAF_TYPES)
    slow: list = []
    problems: list = []
    sig._collect(tree, "value", problems, slow)
    assert problems == []
    fast = sig.flatten(tree)
    assert len(fast) == len(slow) and all(a is b for a, b in zip(fast, slow))
    extracted = sig.extract(tree)
    assert len(extracted) == len(slow) and all(a is b for a, b in zip(extracted, slow))


def test_fast_path_exists_only_without_registered_leaves():
    plain = ValueTreeSignature.from_value({"a": [torch.zeros(2), (torch.ones(3),)]})
    assert plain._matcher() is not None and plain._matcher(checks=False) is not None
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 32)
    with_leaf = ValueTreeSignature.from_value({"q": q}, leaf_types=LEAF_TYPES)
    assert with_leaf._matcher() is None
    assert len(with_leaf.extract({"q": q})) == 2  # falls back to the full walk


def test_flatten_of_a_match_takes_the_generated_path_compiled_once(monkeypatch):
    # The replay path: no tree walk for a matching value, one generated function per
    # signature and mode, kept on the signature.
    from cudagraphs.program import signature as signature_module

    compiled, compile_matcher = [], signature_module.compile_matcher

    def counting(*args, **kwargs):
        compiled.append(1)
        return compile_matcher(*args, **kwargs)

    monkeypatch.setattr(signature_module, "compile_matcher", counting)
    value = _plain_tree()
    sig = signature(value)

    def refuse(*args, **kwargs):
        raise AssertionError("the full walk ran for a matching value")

    monkeypatch.setattr(ValueTreeSignature, "_collect", refuse)
    for _ in range(3):
        assert len(sig.flatten(value)) == 5
        assert len(sig.extract(value)) == 5
    assert len(compiled) == 2  # one checking matcher, one extractor


def test_extract_trusts_the_value_and_flatten_still_checks():
    # extract() skips the metadata checks (replay(validate=False)); flatten() on the
    # same signature must not pick up that trusting function, in either order.
    good, other_shape = [torch.zeros(2, 3)], [torch.zeros(4)]
    for first in ("flatten", "extract"):
        sig = signature(good)
        getattr(sig, first)(good)
        for _ in range(2):
            assert sig.extract(other_shape)[0] is other_shape[0]
            with pytest.raises(SignatureMismatchError, match=r"value\[0\]: shape"):
                sig.flatten(other_shape)


def test_fast_path_rejections_fall_back_to_the_full_report():
    sig = ValueTreeSignature.from_value((torch.zeros(2, 3), {"k": torch.zeros(4)}))
    sparse = torch.zeros(2, 3).to_sparse()  # stride() raises inside the matcher
    with pytest.raises(SignatureMismatchError) as info:
        sig.flatten((sparse, {"k": torch.zeros(5)}))
    fields = {(m.path, m.field) for m in info.value.mismatches}
    assert ("value[0]", "layout") in fields
    assert ("value[1]['k']", "shape") in fields


# ---- the replay path's validator (generated structure checks + torch's tensor guard) --


def _learned_validator(value):
    from cudagraphs.program.matcher import InputValidator

    validator = InputValidator(signature(value))
    validator(value, "value")  # the full check passes; the guard learns these tensors
    return validator


@SETTINGS
@given(one_mutation())
def test_validator_after_learning_finds_every_mismatch(case):
    value, mutated, path, field = case
    validator = _learned_validator(value)
    assert all(t is u for t, u in zip(validator(value, "value"), leaf_tensors(value)))
    with pytest.raises(SignatureMismatchError) as info:
        validator(mutated, "value")
    assert any(m.path == path and m.field == field for m in info.value.mismatches)


@SETTINGS
@given(trees())
def test_validator_returns_what_flatten_returns(value):
    validator = _learned_validator(value)
    fresh = map_tensors(value, shifted)
    got = validator(fresh, "value")
    want = signature(value).flatten(fresh)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))


def _plain_tree(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": [torch.randn(3, generator=g) for _ in range(4)], "b": (torch.randn(2, 2),)}


@pytest.mark.parametrize(
    "edit, path, field",
    [
        (lambda v: {**v, "b": (torch.randn(2, 3),)}, "value['b'][0]", "shape"),
        (lambda v: {**v, "b": (torch.randn(2, 2).double(),)}, "value['b'][0]", "dtype"),
        (lambda v: {**v, "b": (torch.randn(2, 2).t(),)}, None, None),  # same shape, strides swap
        (
            lambda v: {**v, "b": (torch.randn(2, 2, requires_grad=True),)},
            "value['b'][0]",
            "requires_grad",
        ),
        (lambda v: {**v, "b": ("text",)}, "value['b'][0]", "type"),
        (lambda v: {**v, "b": [v["b"][0]]}, "value['b']", "type"),
        (lambda v: {"a": v["a"]}, "value", "keys"),
    ],
)
def test_validator_guard_misses_fall_back_to_the_full_check(edit, path, field):
    from cudagraphs.program.matcher import InputValidator

    value = _plain_tree()
    validator = InputValidator(signature(value))
    validator(value, "value")
    assert validator._guard is not None  # learned from the tensors that passed
    with pytest.raises(SignatureMismatchError) as info:
        validator(edit(value), "value")
    if path is not None:
        assert any(m.path == path and m.field == field for m in info.value.mismatches), (
            info.value.mismatches
        )


def test_validator_stops_relearning_after_a_few_rebuilds():
    from cudagraphs.program import matcher

    value = _plain_tree()
    validator = matcher.InputValidator(signature(value))
    as_double = map_tensors(value, lambda t: t.double().float())  # same metadata
    for _ in range(3 * matcher._MAX_GUARD_REBUILDS):
        validator(value, "value")
        validator(as_double, "value")
    assert validator._rebuilds == 1  # same metadata: learned once, then guard hits
    with_grad = map_tensors(value, lambda t: t.clone().requires_grad_())
    sig_rg = signature(with_grad)
    alternating = matcher.InputValidator(sig_rg)
    for _ in range(3 * matcher._MAX_GUARD_REBUILDS):
        alternating(with_grad, "value")
        alternating(map_tensors(with_grad, lambda t: t.detach().requires_grad_()), "value")
    assert alternating._rebuilds <= matcher._MAX_GUARD_REBUILDS


def test_validator_without_torchs_guard_is_still_correct(monkeypatch):
    from cudagraphs.program import matcher

    monkeypatch.setattr(matcher, "_tensor_guard", lambda tensors: None)
    value = _plain_tree()
    validator = matcher.InputValidator(signature(value))
    for _ in range(3):
        assert len(validator(value, "value")) == 5
    with pytest.raises(SignatureMismatchError, match=r"value\['b'\]"):
        validator({**value, "b": (torch.randn(2, 3),)}, "value")
