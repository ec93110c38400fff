"""``WeightAddresses.check``: its one-pass fast path (``TensorSlots``) against the
reference it stands in for, the named walk over parameters and buffers compared with
capture's (hypothesis, over random sequences of what users do to a model)."""

from itertools import chain

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudagraphs.errors import CudaGraphsStateError
from cudagraphs.serving.hf.support import TensorSlots, WeightAddresses


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4, bias=False)  # a None entry in _parameters
        self.register_buffer("table", torch.arange(4.0), persistent=False)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied, as many LMs are


def reference(model):
    named = list(chain(model.named_parameters(), model.named_buffers()))
    return [n for n, _ in named], [t.data_ptr() for _, t in named]


def _block(model, i):
    return model.blocks[i % 2]


# What a user may do between requests; each takes the model and an index.
def in_place(model, i):
    with torch.no_grad():
        _block(model, i).proj.weight.mul_(1.0)


def rewrap(model, i):  # a new Parameter over the same memory: the graphs still read it
    block = _block(model, i)
    block.proj.weight = nn.Parameter(block.proj.weight.data)


def replace(model, i):
    block = _block(model, i)
    block.proj.weight = nn.Parameter(block.proj.weight.detach().clone())


def swap_data(model, i):
    out = _block(model, i).out
    out.weight.data = out.weight.data.clone()


def new_buffer(model, i):
    block = _block(model, i)
    block.register_buffer("table", block.table.clone(), persistent=False)


def add_buffer(model, i):
    _block(model, i).register_buffer(f"extra{i}", torch.zeros(1))


def drop_bias(model, i):
    _block(model, i).proj.bias = None


def new_block(model, i):
    model.blocks[i % 2] = Block()


def copied_dict(model, i):  # the same entries in a new dict: nothing the graphs read moved
    proj = _block(model, i).proj
    proj._parameters = dict(proj._parameters)


def retie(model, i):
    model.head.weight = model.embed.weight


MUTATIONS = [
    in_place,
    rewrap,
    replace,
    swap_data,
    new_buffer,
    add_buffer,
    drop_bias,
    new_block,
    copied_dict,
    retie,
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 3)), max_size=6))
def test_check_raises_exactly_where_the_named_walk_differs_from_capture(steps):
    torch.manual_seed(0)
    model = Toy()
    addresses = WeightAddresses.of(model)
    captured = reference(model)
    addresses.check(model)
    for mutate, i in steps:
        mutate(model, i)
        if reference(model) == captured:
            addresses.check(model)
        else:
            with pytest.raises(CudaGraphsStateError, match="replaced since capture"):
                addresses.check(model)


def test_an_unchanged_model_is_checked_without_the_named_walk(monkeypatch):
    model = Toy()
    addresses = WeightAddresses.of(model)
    walks = []
    real = WeightAddresses.of.__func__

    def counting(cls, m):
        walks.append(m)
        return real(cls, m)

    monkeypatch.setattr(WeightAddresses, "of", classmethod(counting))
    in_place(model, 0)
    addresses.check(model)
    assert walks == []


def test_a_changed_slot_that_kept_every_address_passes_and_is_fast_again(monkeypatch):
    model = Toy()
    addresses = WeightAddresses.of(model)
    rewrap(model, 0)
    assert not addresses.slots.same()
    addresses.check(model)  # the named walk: same names, same addresses
    assert addresses.slots.same()  # the snapshot taken again
    walks = []
    real = WeightAddresses.of.__func__
    monkeypatch.setattr(
        WeightAddresses, "of", classmethod(lambda cls, m: walks.append(m) or real(cls, m))
    )
    addresses.check(model)
    assert walks == []


def test_the_error_names_what_changed_after_the_fast_path_saw_it():
    model = Toy()
    addresses = WeightAddresses.of(model)
    replace(model, 1)
    with pytest.raises(CudaGraphsStateError, match=r"\(blocks\.1\.proj\.weight\)"):
        addresses.check(model)
    with pytest.raises(CudaGraphsStateError):  # still refused: nothing taken again
        addresses.check(model)


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__)
def test_slots_see_every_change_the_reference_sees(mutate):
    model = Toy()
    slots = TensorSlots.of(model)
    captured = reference(model)
    mutate(model, 0)
    if reference(model) != captured:
        assert not slots.same()


def test_equal_addresses_compare_without_the_snapshot():
    model = Toy()
    assert WeightAddresses.of(model) == WeightAddresses.of(model)
