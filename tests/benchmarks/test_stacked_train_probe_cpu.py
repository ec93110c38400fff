"""CPU tests of ``benchmarks/probes/stacked_train_families_cpu.py``'s measure of how far
two models' gradients lie apart."""

import pytest
import torch
from torch import nn

from helpers.train_bench import load_probe


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("transformers")  # the probe builds HF models
    return load_probe("stacked_train_families_cpu")


def _pair(grads, other):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    for p, g in zip(a.parameters(), grads):
        p.grad = torch.tensor(g)
    for p, g in zip(b.parameters(), other):
        p.grad = torch.tensor(g)
    return b, a  # (compiled_stacked, plain): the second is the reference


def test_a_difference_is_relative_to_its_own_gradients_largest_value(probe):
    model, plain = _pair(
        [[[1.0, 2.0], [3.0, 4.0]], [1.0, 1.0]], [[[1.0, 2.0], [3.0, 4.4]], [1.0, 1.0]]
    )
    assert probe._gradient_difference(model, plain) == pytest.approx(0.1)


def test_a_gradient_that_is_rounding_alone_is_measured_against_the_largest_anywhere(probe):
    # The bias gradient is 1e-9 in one and 2e-9 in the other (zero in exact arithmetic):
    # 100% apart relative to itself, 1e-6 against a thousandth of the largest (1.0).
    model, plain = _pair(
        [[[1.0, 0.0], [0.0, 0.0]], [1e-9, 0.0]], [[[1.0, 0.0], [0.0, 0.0]], [2e-9, 0.0]]
    )
    assert probe._gradient_difference(model, plain) == pytest.approx(1e-6)
