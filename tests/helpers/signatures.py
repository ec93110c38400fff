"""Helpers of the signature CPU tests (tests/program/test_program_signature*.py): a
signature with the test leaf types, the mismatches a validation reports, the bytes a
tensor's view spans, a leaf class nobody registers, and a hypothesis strategy that
changes one node of a tree."""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

from cudagraphs.program import (
    Mismatch,
    SignatureMismatchError,
    ValueTreeSignature,
)
from helpers.program_trees import (
    LEAF_TYPES,
    node_mutations,
    path_of,
    replace,
    trees,
    walk,
)


def signature(value) -> ValueTreeSignature:
    return ValueTreeSignature.from_value(value, leaf_types=LEAF_TYPES)


def mismatches_of(sig: ValueTreeSignature, value) -> list[Mismatch]:
    with pytest.raises(SignatureMismatchError) as info:
        sig.validate(value)
    return info.value.mismatches


def span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


@dataclass
class Unregistered:
    data: torch.Tensor


@st.composite
def one_mutation(draw):
    """(original, mutated, expected path, expected field) with one node changed."""
    value = draw(trees())
    nodes = list(walk(value))
    loc, node = draw(st.sampled_from(nodes))
    options = node_mutations(node)
    name = draw(st.sampled_from(sorted(options)))
    new_node, suffix, field = options[name]
    return value, replace(value, loc, new_node), path_of(loc) + suffix, field
