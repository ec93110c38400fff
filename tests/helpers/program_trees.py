"""Input trees for the graph-program signature and buffer tests (CPU only).

Two registered leaf types, hypothesis strategies for random nested trees of small
CPU tensors and leaf instances, and helpers that address, rewrite and mutate one
node of a tree by its location (the tuple of indices/keys from the root).
"""

from __future__ import annotations

import collections

import torch
from hypothesis import strategies as st

from helpers.leaf_types import LEAF_TYPES, LEAVES, PackedTensor, QuantizedTensor, make_leaf_types  # noqa: F401

DTYPES = (torch.float32, torch.float16, torch.int64, torch.bool)


# ---- tensors ------------------------------------------------------------------------
def filled(shape, stride, dtype, seed, requires_grad=False) -> torch.Tensor:
    """A new tensor with exactly this topology and small exact values."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, tuple(shape), generator=gen)
    out = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
    out.copy_(values > 0 if dtype == torch.bool else values.to(dtype))
    return out.requires_grad_(requires_grad)


def like(t: torch.Tensor, *, shape=None, stride=None, dtype=None, requires_grad=None, seed=0):
    """A fresh tensor with t's topology except for the fields given."""
    shape = tuple(t.shape) if shape is None else tuple(shape)
    if stride is None:
        stride = t.stride() if shape == tuple(t.shape) else torch.empty(shape).stride()
    dtype = t.dtype if dtype is None else dtype
    requires_grad = t.requires_grad if requires_grad is None else requires_grad
    return filled(shape, stride, dtype, seed, requires_grad)


def shifted(t: torch.Tensor) -> torch.Tensor:
    """Same topology, every element different (so a copy of it is always visible)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    src = t.detach()
    out.copy_(~src if t.dtype == torch.bool else src + 1)
    return out.requires_grad_(t.requires_grad)


@st.composite
def tensors(draw, dtypes=DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))
    transposed = draw(st.integers(0, 3)) == 0
    if transposed:
        shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    else:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    if transposed:
        # A transposed view: non-contiguous unless a size-1 dim makes it degenerate.
        base = filled(shape[::-1], torch.empty(shape[::-1]).stride(), dtype, seed)
        t = base.t()
    else:
        t = filled(shape, torch.empty(shape).stride(), dtype, seed)
    if dtype.is_floating_point and draw(st.booleans()):
        t.requires_grad_(True)
    return t


@st.composite
def quantized(draw) -> QuantizedTensor:
    data = draw(tensors(dtypes=(torch.int8,)))
    scale = filled((1,), (1,), torch.float32, draw(st.integers(0, 99)))
    zero_point = filled((1,), (1,), torch.int8, 3) if draw(st.booleans()) else None
    return QuantizedTensor(data, scale, draw(st.integers(1, 4)), zero_point)


KEYS = st.text(alphabet="abxyz", min_size=1, max_size=2)


def trees(depth: int = 3):
    """Nested lists, tuples and str-keyed dicts (containers nested <= depth) of
    tensors and QuantizedTensor leaves."""
    leaf = st.one_of(tensors(), tensors(), quantized())
    if depth == 0:
        return leaf
    sub = trees(depth - 1)
    return st.one_of(
        leaf,
        st.lists(sub, max_size=3),
        st.lists(sub, max_size=3).map(tuple),
        st.dictionaries(KEYS, sub, max_size=3),
    )


# ---- addressing ---------------------------------------------------------------------
def path_of(loc) -> str:
    return "value" + "".join(f"[{k!r}]" for k in loc)


def walk(tree, loc=()):
    """(location, node) for every node, root first."""
    yield loc, tree
    if type(tree) in (list, tuple):
        for i, child in enumerate(tree):
            yield from walk(child, (*loc, i))
    elif type(tree) is dict:
        for k, child in tree.items():
            yield from walk(child, (*loc, k))


def replace(tree, loc, new):
    """A copy of tree (containers rebuilt along loc, dict order kept) with new at loc."""
    if not loc:
        return new
    head, rest = loc[0], loc[1:]
    if type(tree) is dict:
        out = dict(tree)
        out[head] = replace(tree[head], rest, new)
        return out
    items = list(tree)
    items[head] = replace(tree[head], rest, new)
    return items if type(tree) is list else tuple(items)


def map_tensors(tree, fn):
    """Same structure (dict insertion order kept), every tensor replaced by fn(tensor)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, QuantizedTensor):
        zp = None if tree.zero_point is None else fn(tree.zero_point)
        return QuantizedTensor(fn(tree.data), fn(tree.scale), tree.block, zp)
    if isinstance(tree, PackedTensor):
        return PackedTensor(fn(tree.data), fn(tree.scale), tree.block)
    if type(tree) is dict:
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if type(tree) not in (list, tuple):
        return tree  # a non-tensor put in by a mutation
    items = [map_tensors(v, fn) for v in tree]
    return items if type(tree) is list else tuple(items)


def reorder_dicts(tree):
    """Same tree with every dict's insertion order reversed."""
    if type(tree) is dict:
        return {k: reorder_dicts(tree[k]) for k in reversed(list(tree))}
    if type(tree) in (list, tuple):
        items = [reorder_dicts(v) for v in tree]
        return items if type(tree) is list else tuple(items)
    return tree


def leaf_tensors(tree) -> list[torch.Tensor]:
    """Tensors in signature order: dict keys sorted, leaf tensors sorted by name."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, LEAVES):
        named, _ = LEAF_TYPES.get(tree).flatten(tree)
        return [named[k] for k in sorted(named)]
    if type(tree) is dict:
        return [t for k in sorted(tree) for t in leaf_tensors(tree[k])]
    return [t for v in tree for t in leaf_tensors(v)]


def same_structure(a, b) -> bool:
    """Same container types, lengths, dict key sets, leaf types and leaf metadata."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if type(a) is not type(b):
        return False
    if isinstance(a, LEAVES):
        names_a = sorted(LEAF_TYPES.get(a).flatten(a)[0])
        names_b = sorted(LEAF_TYPES.get(b).flatten(b)[0])
        return a.block == b.block and names_a == names_b
    if type(a) is dict:
        return set(a) == set(b) and all(same_structure(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b))


# ---- mutations ----------------------------------------------------------------------
def restride(t: torch.Tensor) -> torch.Tensor:
    """Same shape and dtype, another stride: contiguous() of a non-contiguous tensor,
    a transposed copy of a contiguous 2-D one, else a padded first-dim stride."""
    candidates = [t.detach().contiguous()]
    if t.dim() == 2:
        candidates.append(t.detach().t().contiguous().t())
    for c in candidates:
        if c.stride() != t.stride():
            return like(t, stride=c.stride())
    stride = (t.stride()[0] + 1, *t.stride()[1:])
    return like(t, stride=stride)


def other_dtype(t: torch.Tensor) -> torch.dtype:
    if t.requires_grad:  # only float tensors may require grad
        return torch.float16 if t.dtype == torch.float32 else torch.float32
    return next(d for d in (torch.int64, torch.float32, torch.bool) if d != t.dtype)


def tensor_mutations(t: torch.Tensor) -> dict:
    """name -> (mutated node, path suffix, mismatch field) for one tensor leaf."""
    grown = (t.shape[0] + 1, *t.shape[1:]) if t.dim() else (1,)
    out = {
        "shape": (like(t, shape=grown), "", "shape"),
        "dtype": (like(t, dtype=other_dtype(t)), "", "dtype"),
        "non_tensor": (3, "", "type"),
        "leaf_instead": (QuantizedTensor(t.detach(), t.detach(), 1), "", "type"),
    }
    if t.dim():
        out["stride"] = (restride(t), "", "stride")
    if t.dtype.is_floating_point:
        out["requires_grad"] = (like(t, requires_grad=not t.requires_grad), "", "requires_grad")
    return out


def node_mutations(node) -> dict:
    """name -> (mutated node, path suffix, mismatch field) for any node of a tree."""
    if isinstance(node, torch.Tensor):
        return tensor_mutations(node)
    if isinstance(node, QuantizedTensor):
        zp = filled((1,), (1,), torch.int8, 5) if node.zero_point is None else None
        data = like(node.data, shape=(*node.data.shape, 2))
        return {
            "metadata": (
                QuantizedTensor(node.data, node.scale, node.block + 1, node.zero_point),
                "",
                "metadata",
            ),
            "leaf_type": (PackedTensor(node.data, node.scale, node.block), "", "type"),
            "tensor_names": (
                QuantizedTensor(node.data, node.scale, node.block, zp),
                "",
                "tensor names",
            ),
            "inner_shape": (
                QuantizedTensor(data, node.scale, node.block, node.zero_point),
                ".data",
                "shape",
            ),
            "tensor_instead": (node.data, "", "type"),
        }
    if type(node) is dict:
        out = {
            "add_key": ({**node, "new_key": torch.zeros(1)}, "", "keys"),
            "to_list": (list(node.values()), "", "type"),
        }
        if node:
            dropped = dict(node)
            dropped.pop(next(iter(dropped)))
            out["remove_key"] = (dropped, "", "keys")
        return out
    swapped = tuple(node) if type(node) is list else list(node)
    out = {
        "append": (type(node)([*node, torch.zeros(1)]), "", "length"),
        "swap_list_tuple": (swapped, "", "type"),
    }
    if node:
        out["drop"] = (type(node)(node[:-1]), "", "length")
    if type(node) is tuple:
        # A namedtuple is a tuple by isinstance, and another container to pytree: the
        # signature holds the exact type.
        named = collections.namedtuple(f"Fields{len(node)}", [f"f{i}" for i in range(len(node))])
        out["to_namedtuple"] = (named(*node), "", "type")
    return out
