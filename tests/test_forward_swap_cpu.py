"""swap_forward: the one way the core and the partial graphs replace a module's
forward and give it back."""

import functools

import torch
from torch import nn

from cudagraphs.forward_swap import swap_forward


def test_a_class_forward_shows_through_again_after_restore():
    lin = nn.Linear(2, 2)
    swap = swap_forward(lin, lambda x: "replaced")
    assert lin(torch.ones(2)) == "replaced"
    assert swap.original.__func__ is nn.Linear.forward and not swap.had_instance_forward
    swap.restore()
    assert "forward" not in lin.__dict__ and isinstance(lin(torch.ones(2)), torch.Tensor)
    swap.restore()  # idempotent
    assert "forward" not in lin.__dict__


def test_an_instance_forward_of_its_own_is_put_back():
    lin = nn.Linear(2, 2)
    own = functools.partial(nn.Linear.forward, lin)
    lin.forward = own
    swap = swap_forward(lin, lambda x: "replaced")
    assert swap.had_instance_forward and swap.original is own
    swap.restore()
    assert lin.__dict__["forward"] is own


def test_hooks_still_run_around_the_replacement():
    lin = nn.Linear(2, 2)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append("pre"))
    swap = swap_forward(lin, lambda x: seen.append("replacement") or x)
    lin(torch.ones(2))
    assert seen == ["pre", "replacement"]
    swap.restore()


def test_restore_marks_itself_done_and_leaves_a_later_forward_alone():
    lin = nn.Linear(2, 2)
    own = functools.partial(nn.Linear.forward, lin)
    lin.forward = own
    swap = swap_forward(lin, lambda x: "replaced")
    swap.restore()
    assert swap.restored is True
    later = functools.partial(nn.Linear.forward, lin)
    lin.forward = later  # set by someone else after the restore
    swap.restore()  # a second restore does nothing: the later forward stays
    assert lin.__dict__["forward"] is later


def test_restore_tolerates_a_replacement_removed_meanwhile():
    lin = nn.Linear(2, 2)
    swap = swap_forward(lin, lambda x: "replaced")
    del lin.forward  # the instance attribute is gone already
    swap.restore()
    assert swap.restored is True and "forward" not in lin.__dict__
