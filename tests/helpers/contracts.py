"""Helpers of the call-contract CPU tests (tests/partial/test_partial_contract*.py):
tensors by shape, a recorded contract, the reason a call is refused, and values that
are not plain constants."""

import torch

from cudagraphs.partial import CallContract


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
