"""The generated signature matcher and the replay validator's guard bookkeeping (CPU)."""

from collections import namedtuple

import pytest
import torch

from cudagraphs.program import SignatureMismatchError, ValueTreeSignature, matcher
from cudagraphs.program.matcher import InputValidator, compile_matcher
from helpers.program_trees import LEAF_TYPES, QuantizedTensor
from helpers.signatures import signature

Pair = namedtuple("Pair", ["x", "y"])


class CountingList(list):
    """A list that counts item subscripts (unpacking it reads no item this way)."""

    subscripts = 0

    def __getitem__(self, i):
        type(self).subscripts += 1
        return super().__getitem__(i)


def _tensors():
    return [torch.zeros(2, 3), torch.ones(4)]


# ---- compile_matcher ------------------------------------------------------------------


def test_the_generated_function_names_its_source_in_tracebacks():
    match = compile_matcher(ValueTreeSignature.from_value({"a": torch.zeros(2)}))
    assert match.__code__.co_filename == "<cudagraphs signature matcher>"
    assert match.__code__.co_name == "match"


def test_structure_only_matcher_leaves_tensor_metadata_alone():
    sig = ValueTreeSignature.from_value({"a": torch.zeros(2, 3), "b": (torch.zeros(4),)})
    structure = compile_matcher(sig, tensor_checks=False)
    odd = {"a": torch.zeros(5, dtype=torch.float64), "b": ("not a tensor",)}
    assert structure(odd) == [odd["a"], "not a tensor"]
    assert structure({"a": odd["a"], "b": []}) is None  # the structure is still checked
    assert compile_matcher(sig)(odd) is None  # the full fast path checks the leaves


def test_structure_only_matcher_checks_types_and_lengths_of_tensor_lists():
    sig = ValueTreeSignature.from_value(_tensors())
    structure = compile_matcher(sig, tensor_checks=False)
    a, b = torch.zeros(7), torch.zeros(1)
    assert structure([a, b]) == [a, b]
    assert structure((a, b)) is None
    assert structure([a]) is None


@pytest.mark.parametrize("tensor_checks", [True, False])
def test_extractor_unpacks_a_tensor_list_without_subscripts(tensor_checks):
    # checks=False trusts the structure: a sequence of tensors is unpacked in one step.
    sig = ValueTreeSignature.from_value(_tensors())
    extract = compile_matcher(sig, checks=False, tensor_checks=tensor_checks)
    value = CountingList(_tensors())
    CountingList.subscripts = 0
    out = extract(value)
    assert len(out) == 2 and all(o is v for o, v in zip(out, list.__iter__(value)))
    assert CountingList.subscripts == 0


def test_extractor_subscripts_lists_holding_containers():
    sig = ValueTreeSignature.from_value([torch.zeros(2), [torch.zeros(3)]])
    extract = compile_matcher(sig, checks=False)
    inner = torch.ones(3)
    value = CountingList([torch.ones(2), [inner]])
    CountingList.subscripts = 0
    assert extract(value)[1] is inner
    assert CountingList.subscripts == 2


def test_checking_matcher_subscripts_each_tensor_of_a_list():
    sig = ValueTreeSignature.from_value(_tensors())
    value = _tensors()
    assert compile_matcher(sig)(value) == value
    assert compile_matcher(sig)([value[0], torch.zeros(5)]) is None


def test_namedtuple_of_another_length_is_not_a_match():
    sig = ValueTreeSignature.from_value(Pair(torch.zeros(2), torch.zeros(3)))
    match = compile_matcher(sig)
    good = Pair(torch.ones(2), torch.ones(3))
    assert match(good) == [good.x, good.y]
    longer = tuple.__new__(Pair, (torch.ones(2), torch.ones(3), torch.ones(4)))
    assert match(longer) is None
    assert compile_matcher(sig, tensor_checks=False)(longer) is None


# ---- InputValidator -------------------------------------------------------------------


def test_validator_structure_check_leaves_tensor_metadata_to_the_guard():
    value = {"a": _tensors()}
    validator = InputValidator(signature(value))
    other = {"a": [torch.zeros(9, dtype=torch.int64), torch.zeros(1)]}
    assert validator._structure(other) == other["a"]
    assert validator._structure({"a": other["a"][:1]}) is None


def test_validator_reports_mismatches_under_the_callers_path():
    validator = InputValidator(signature({"a": torch.zeros(2)}))
    with pytest.raises(SignatureMismatchError, match=r"inputs\['a'\]: shape") as info:
        validator({"a": torch.zeros(3)}, "inputs")
    assert [m.path for m in info.value.mismatches] == ["inputs['a']"]


def test_validator_explains_a_structure_check_that_raises_after_learning():
    value = {"a": torch.zeros(2), "b": torch.zeros(3)}
    validator = InputValidator(signature(value))
    validator(value, "value")
    assert validator._guard is not None
    # Same length, another key: the generated structure check raises KeyError.
    with pytest.raises(SignatureMismatchError) as info:
        validator({"a": torch.zeros(2), "c": torch.zeros(3)}, "value")
    assert {m.path for m in info.value.mismatches} == {"value"}


def test_validator_without_a_fast_path_builds_no_guard(monkeypatch):
    built = []
    monkeypatch.setattr(matcher, "_tensor_guard", lambda tensors: built.append(tensors))
    q = QuantizedTensor(torch.zeros(4, dtype=torch.int8), torch.ones(1), 32)
    sig = ValueTreeSignature.from_value({"q": q}, leaf_types=LEAF_TYPES)
    validator = InputValidator(sig)
    assert validator._structure is None
    for _ in range(3):
        assert len(validator({"q": q}, "value")) == 2
    assert built == [] and validator._rebuilds == 0


def test_validator_rebuilds_its_guard_exactly_the_maximum_number_of_times(monkeypatch):
    built = []
    real = matcher._tensor_guard

    def counting(tensors):
        built.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(matcher, "_tensor_guard", counting)
    value = [torch.zeros(2)]
    validator = InputValidator(signature(value))
    # Two sources that pass the signature but differ in dispatch keys (an inference
    # tensor lacks the autograd keys): each call misses the guard learned from the other.
    with torch.inference_mode():
        inference = [torch.zeros(2)]
    for _ in range(3 * matcher._MAX_GUARD_REBUILDS):
        assert validator(value, "value") == value
        assert validator(inference, "value") == inference
    assert built == [1] * matcher._MAX_GUARD_REBUILDS
    assert validator._rebuilds == matcher._MAX_GUARD_REBUILDS


def test_tensor_guard_checks_sizes_and_strides():
    a, b = torch.zeros(2, 3), torch.zeros(4)
    guard = matcher._tensor_guard([a, b])
    if guard is None:
        pytest.skip("this torch has no TensorGuards")
    assert guard.check(torch.ones(2, 3), torch.ones(4))
    assert not guard.check(torch.ones(3, 2), torch.ones(4))
    assert not guard.check(torch.ones(3, 2).t(), torch.ones(4))
    assert not guard.check(torch.ones(2, 3), torch.ones(5))
