"""Where a call's structure parts from the captured call's: the walk over two pytree
specs behind the "call structure differs" error of :class:`~.runtime.EntryGraphs`.
It runs only for a call that has already failed the spec check.
"""

from __future__ import annotations

from torch.utils import _pytree as pytree

from ..errors import Mismatch

__all__ = ["structure_mismatches"]


def structure_mismatches(captured: pytree.TreeSpec, received: pytree.TreeSpec) -> list[Mismatch]:
    """Where two call structures part, walking both specs from the root
    ``(args, kwargs)``: one record per differing node."""
    out: list[Mismatch] = []
    want_args, want_kwargs = _spec_children(captured)
    got_args, got_kwargs = _spec_children(received)
    _spec_diff(want_args, got_args, "args", out)
    _spec_diff(want_kwargs, got_kwargs, "kwargs", out)
    return out


def _spec_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    # torch 2.13 deprecates the children_specs attribute for a children() method that
    # older versions do not have.
    children = getattr(type(spec), "children", None)
    return list(spec.children()) if callable(children) else list(spec.children_specs)


def _spec_name(spec: pytree.TreeSpec) -> str:
    return "a leaf (tensor or constant)" if spec.is_leaf() else spec.type.__name__


def _spec_diff(want: pytree.TreeSpec, got: pytree.TreeSpec, path: str, out: list) -> None:
    if want.is_leaf() or got.is_leaf() or want.type is not got.type:
        if want.is_leaf() != got.is_leaf() or want.type is not got.type:
            out.append(Mismatch(path, "type", _spec_name(want), _spec_name(got)))
        return
    if want.type is dict:
        if want.context != got.context:
            out.append(Mismatch(path, "keys", list(want.context), list(got.context)))
            return
        keys = [f"[{k!r}]" for k in want.context]
    elif want.num_children != got.num_children:
        out.append(Mismatch(path, "length", want.num_children, got.num_children))
        return
    elif want.context != got.context:
        out.append(Mismatch(path, "context", want.context, got.context))
        return
    else:
        keys = [f"[{i}]" for i in range(want.num_children)]
    for key, w, g in zip(keys, _spec_children(want), _spec_children(got)):
        _spec_diff(w, g, path + key, out)
