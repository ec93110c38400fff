"""An inductor post-grad pass: one GEMM per projection group, forward and backward.

Why: the GEMMs of a small model are latency-bound (a Llama layer's q, k and v
projections take 18.1 µs on an H100 as three decode GEMMs and 7.8 µs as one,
``benchmarks/probes/decode_gemms.py``), and in a graph each kernel is also a node the
device waits about 0.45 µs after. Inductor's own concatenation of linears runs only
with ``freezing`` (weights become constants: no training, and in-place updates no
longer reach the compiled code) and only for weights of equal shape (not GQA's q
beside its k and v).

The pass reads the graph alone. A projection group is a set of weights that are
adjacent rows of one storage (:func:`~cudagraphs.stacking.stack_projections` lays
them so), seen either as row slices of one buffer (the decode step reads its groups
so) or as graph inputs whose fake tensors share one storage (a compiled training step,
where the parameters themselves are the inputs). Three rewrites, each keeping every
result:

* **forward**: ``x @ W_i.T`` for adjacent ``W_i`` and one ``x`` is one GEMM over
  their rows; each projection gets a contiguous copy of its columns (inductor fuses
  the copy into the pointwise work reading it; a view would make the compile guard the
  batch, see :func:`_merge_forward`). ``addmm`` with the biases likewise. Under
  autocast each ``W_i`` is first cast (float32 parameters, bfloat16 GEMMs): the group
  is then cast once, and each member's cast becomes its rows of that one.
* **input gradient**: ``G_i @ W_i`` summed over the group (the gradient of ``x``) is
  one GEMM ``cat(G_i) @ W``: the last of them becomes it, the others zeros that the
  sum's kernel absorbs. Merged only where the graph sums them and nothing else reads
  them (:func:`_summed_runs`).
* **weight gradient**: ``G_i.T @ x`` for one ``x`` is one GEMM ``cat(G_i).T @ x``,
  each weight's gradient its rows (contiguous views). It needs no weight, so it holds
  where the input gradient could not merge too: under autocast the backward reads its
  own saved casts of the weights, which are no group's rows.

Graph inputs are viewed beyond their own extent with ``as_strided`` from the group's
input at storage offset 0, the only base whose offsets inductor reads the same way in
every torch this package supports (torch before pytorch/pytorch#180581 added an
input's own offset to ``as_strided``'s; after it, not); a group without such an input
is left as it is. The pass trusts the layout it saw at compile time: a compiled model
must keep its parameters where :func:`~cudagraphs.stacking.stack_projections` put
them (:class:`~cudagraphs.stacking.StackedCompiled` checks that at every call).
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..torch_private import custom_graph_pass_class, files_hash, mode_options, storage_key

__all__ = [
    "can_add_pass",
    "stack_graph",
    "stacked_projections_pass",
    "with_stacked_projections",
]

logger = logging.getLogger(__name__)
_VIEWS = ("reshape", "view")


# ---- what a weight operand is -------------------------------------------------------
@dataclass(frozen=True)
class _Rows:
    """Rows ``[start, stop)`` of a 2-D row-major region (or parts of a 1-D one: a
    bias) that a group's members share; ``base`` is the node to view the union from."""

    key: Any
    base: fx.Node
    start: int
    stop: int
    width: int  # elements a row (0: a 1-D region, a bias)
    sliced: bool  # base is a buffer the graph slices (else an input at offset 0)


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _size_key(size: Any) -> Any:
    """A size as a dict key: itself, or a symbolic size's expression (a ``SymInt``
    hashes to nothing; dynamic shapes give the token count one)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _sliced_rows(node: fx.Node) -> _Rows | None:
    """``aten.slice(buffer, 0, start, stop)`` with plain ints (or none: the ends) and
    step 1, ``stop`` clamped as Python's slicing does (torch writes an open end as the
    largest int64)."""
    buffer, dim, start, stop, *step = (*node.args, *([None] * (4 - len(node.args))))
    val = _val(buffer)
    if dim != 0 or step not in ([], [1]) or node.kwargs or val is None:
        return None
    size = val.shape[0]
    start = 0 if start is None else start
    stop = size if stop is None else stop
    if not all(isinstance(v, int) for v in (start, stop, size)):
        return None
    stop = min(stop, size)
    if not 0 <= start < stop:
        return None
    width = val.shape[1] if val.dim() == 2 else 0
    return _Rows(buffer, buffer, start, stop, width, sliced=True)


def _input_rows(node: fx.Node, bases: Mapping[Any, fx.Node]) -> _Rows | None:
    """A graph input that is contiguous rows of a storage some input starts at."""
    val = _val(node)
    if not isinstance(val, torch.Tensor) or val.dim() not in (1, 2) or not val.is_contiguous():
        return None
    key = storage_key(val)
    width = val.shape[1] if val.dim() == 2 else 0
    unit = max(width, 1)
    if key not in bases or val.numel() == 0 or val.storage_offset() % unit:
        return None
    if _val(bases[key]).dtype != val.dtype:  # offsets count the base's elements
        return None
    start = val.storage_offset() // unit
    return _Rows((key, width), bases[key], start, start + val.shape[0], width, sliced=False)


def _rows(node: Any, bases: Mapping[Any, fx.Node]) -> _Rows | None:
    if not isinstance(node, fx.Node):
        return None
    if node.target is torch.ops.aten.slice.Tensor:
        return _sliced_rows(node)
    if node.op == "placeholder":
        return _input_rows(node, bases)
    return None


def _strip_transposes(node: Any) -> tuple[Any, bool]:
    """``node`` under its ``permute(.., [1, 0])`` (or ``t``) chain, and whether an odd
    number of them was taken off."""
    odd = False
    aten = torch.ops.aten
    while isinstance(node, fx.Node) and (
        (node.target is aten.permute.default and list(node.args[1]) == [1, 0])
        or node.target is aten.t.default
    ):
        node, odd = node.args[0], not odd
    return node, odd


def _bases(graph: fx.Graph) -> dict[Any, fx.Node]:
    """Per storage, the graph input that starts at its offset 0."""
    out: dict[Any, fx.Node] = {}
    for node in graph.find_nodes(op="placeholder"):
        val = _val(node)
        if isinstance(val, torch.Tensor) and val.storage_offset() == 0 and val.dim() >= 1:
            out.setdefault(storage_key(val), node)
    return out


def _union(rows: list[_Rows], call: Any) -> fx.Node:
    """A node viewing the rows of ``rows`` (adjacent, in order) as one tensor."""
    first, start, stop = rows[0], rows[0].start, rows[-1].stop
    if first.sliced:
        return call(torch.ops.aten.slice.Tensor, first.base, 0, start, stop)
    if first.width == 0:
        return call(torch.ops.aten.as_strided.default, first.base, [stop - start], [1], start)
    width = first.width
    return call(
        torch.ops.aten.as_strided.default,
        first.base,
        [stop - start, width],
        [width, 1],
        start * width,
    )


def _runs(items: list[Any]) -> list[list[Any]]:
    """Runs of two or more items (each with ``.rows``) over adjacent rows."""
    items = sorted(items, key=lambda g: g.rows.start)
    runs, run = [], items[:1]
    for g in items[1:]:
        if g.rows.start == run[-1].rows.stop:
            run.append(g)
            continue
        runs.append(run)
        run = [g]
    runs.append(run)
    return [r for r in runs if len(r) > 1]


def _caller(graph: fx.Graph) -> Any:
    def call(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = target(*(_val_or_list(a) for a in args), **kwargs)
        return node

    return call


def _val_or_list(arg: Any) -> Any:
    if isinstance(arg, (list, tuple)):
        return type(arg)(_val_or_list(a) for a in arg)
    return _val(arg)


def _input_key(x: fx.Node) -> Any:
    """The same key for the same input reshaped again: each linear reshapes its 3-D
    input itself, and the reshapes are separate nodes."""
    if getattr(x, "target", None) in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
        return (x.args[0], tuple(x.args[1]))
    return x


# ---- forward: x @ W_i.T -------------------------------------------------------------
@dataclass(frozen=True)
class _Operand:
    """A weight (or bias) operand: its rows, and the cast to ``dtype`` it goes through
    first (autocast's copy of a float32 parameter), if any."""

    rows: _Rows
    cast: fx.Node | None = None

    @property
    def key(self) -> Any:
        return (self.rows.key, None if self.cast is None else self.cast.args[1])


def _operand(node: Any, bases: Mapping[Any, fx.Node]) -> _Operand | None:
    cast = None
    if (
        isinstance(node, fx.Node)
        and node.target is torch.ops.prims.convert_element_type.default
        and not node.kwargs
    ):
        cast, node = node, node.args[0]
    rows = _rows(node, bases)
    return None if rows is None else _Operand(rows, cast)


@dataclass(frozen=True)
class _Forward:
    node: fx.Node
    x: fx.Node
    weight: _Operand
    bias: _Operand | None

    @property
    def rows(self) -> _Rows:
        return self.weight.rows


def _forward(node: fx.Node, bases: Mapping[Any, fx.Node]) -> _Forward | None:
    aten = torch.ops.aten
    if node.target is aten.mm.default and not node.kwargs:
        x, w, bias = node.args[0], node.args[1], None
    elif node.target is aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        bias, x, w = node.args
    else:
        return None
    w, odd = _strip_transposes(w)
    weight = _operand(w, bases) if odd else None
    if weight is None or not isinstance(x, fx.Node):
        return None
    bias_operand = None
    if bias is not None:
        bias_operand = _operand(bias, bases)
        if bias_operand is None or (bias_operand.rows.start, bias_operand.rows.stop) != (
            weight.rows.start,
            weight.rows.stop,
        ):
            return None
    return _Forward(node, x, weight, bias_operand)


def _union_cast(graph: fx.Graph, operands: list[_Operand], call: Any) -> fx.Node:
    """The union of ``operands``' rows, cast as they are; each member's own cast (of
    the parameter itself) becomes its rows of the one cast, so that autocast's copies
    of a group's parameters are one kernel rather than one each. Inserted where it
    is called from (before every member's cast)."""
    union = _union([o.rows for o in operands], call)
    cast = operands[0].cast
    if cast is None:
        return union
    union = call(torch.ops.prims.convert_element_type.default, union, cast.args[1])
    start = operands[0].rows.start
    for o in operands:
        if o.cast is not None and o.cast.args[0].op == "placeholder":
            part = call(
                torch.ops.aten.slice.Tensor, union, 0, o.rows.start - start, o.rows.stop - start
            )
            o.cast.replace_all_uses_with(part)
    return union


def _merge_forward(graph: fx.Graph, run: list[_Forward]) -> None:
    """One GEMM for ``run``, each projection's result a contiguous copy of its columns.

    Why copies: a projection's result is viewed next (a linear unfolds its 2-D result,
    HF's attention splits heads), and a view of a column slice has strides that
    depend on whether the batch is 1: the compile then guards ``batch >= 2`` and
    compiles the one-row bucket apart (a second compile at capture). A copy is a
    pointwise node, which inductor fuses into the pointwise work that reads it
    (rotary embedding, the cache write, SiLU-and-multiply)."""
    aten = torch.ops.aten
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(run, key=lambda g: order[g.node])
    casts = [o.cast for g in run for o in (g.weight, g.bias) if o is not None and o.cast]
    start = run[0].rows.start
    call = _caller(graph)
    # Before every member's cast: those casts become rows of the union's.
    with graph.inserting_before(min([first.node, *casts], key=order.__getitem__)):
        weights = _union_cast(graph, [g.weight for g in run], call)
        biases = None
        if first.bias is not None:
            biases = _union_cast(graph, [g.bias for g in run], call)
    with graph.inserting_before(first.node):
        transposed = call(aten.permute.default, weights, [1, 0])
        if biases is None:
            out = call(aten.mm.default, first.x, transposed)
        else:
            out = call(aten.addmm.default, biases, first.x, transposed)
        for g in run:
            part = call(aten.slice.Tensor, out, 1, g.rows.start - start, g.rows.stop - start)
            copy = call(aten.clone.default, part, memory_format=torch.contiguous_format)
            g.node.replace_all_uses_with(copy)
    for g in run:
        graph.erase_node(g.node)


# ---- backward: G_i @ W_i and G_i.T @ x -----------------------------------------------
@dataclass(frozen=True)
class _InputGrad:
    node: fx.Node
    grad: fx.Node
    rows: _Rows


def _input_grad(node: fx.Node, bases: Mapping[Any, fx.Node]) -> _InputGrad | None:
    if node.target is not torch.ops.aten.mm.default or node.kwargs:
        return None
    grad, w = node.args
    w, odd = _strip_transposes(w)
    rows = None if odd else _rows(w, bases)
    if rows is None or not isinstance(grad, fx.Node):
        return None
    return _InputGrad(node, grad, rows)


def _sum_root(node: fx.Node) -> tuple[fx.Node, tuple[Any, ...]] | None:
    """Where ``node``'s result goes: up its only users through reshapes (their shapes
    recorded) and into adds, to the last add whose only user is not an add. None
    where it meets anything else, or a node with other users."""
    aten = torch.ops.aten
    shapes: list[Any] = []
    while len(node.users) == 1:
        user = next(iter(node.users))
        name = getattr(user.target, "__name__", "").split(".")[0]
        if user.op == "call_function" and name in _VIEWS and user.args[0] is node:
            shapes.append(tuple(user.args[1]))
            node = user
            continue
        break
    if len(node.users) != 1:
        return None
    add = next(iter(node.users))
    if add.target is not aten.add.Tensor or add.kwargs:
        return None
    while len(add.users) == 1:
        user = next(iter(add.users))
        if user.target is not aten.add.Tensor or user.kwargs:
            break
        add = user
    return add, tuple(shapes)


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen


def _summed_runs(run: list[_InputGrad]) -> list[list[_InputGrad]]:
    """The parts of ``run`` (adjacent rows) of two or more members whose results the
    graph only ever adds into one sum (through the same reshapes), where no member's
    ``G_i`` is computed from another's result: each sum can take its part as one GEMM.
    (q, k, v and o may lie in one group; o's input gradient is another sum.)"""
    parts: list[list[_InputGrad]] = []
    roots: list[Any] = []
    for g in run:
        root = _sum_root(g.node)
        if root is not None and parts and roots[-1] == root:
            parts[-1].append(g)
            continue
        parts.append([g])
        roots.append(root)
    out = []
    for part in parts:
        results = {g.node for g in part}
        if len(part) > 1 and not results & _ancestors([g.grad for g in part]):
            out.append(part)
    return out


def _weight_grads(graph: fx.Graph, grads: list[fx.Node]) -> list[fx.Node] | None:
    """Per grad, the GEMM ``grad.T @ x`` with one ``x`` for all; None if any is not
    there."""
    aten = torch.ops.aten
    found = []
    for grad in grads:
        users = [
            u
            for t in grad.users
            if t.target is aten.permute.default and list(t.args[1]) == [1, 0]
            for u in t.users
            if u.target is aten.mm.default and u.args[0] is t and not u.kwargs
        ]
        if len(users) != 1:
            return None
        found.append(users[0])
    xs = {_input_key(mm.args[1]) for mm in found}
    return found if len(xs) == 1 else None


def _merge_backward(graph: fx.Graph, run: list[_InputGrad]) -> int:
    """The input gradient of ``run`` as one GEMM, and its weight gradients too where
    the graph computes them from the same ``G_i`` and one ``x``; GEMMs removed."""
    aten = torch.ops.aten
    order = {node: i for i, node in enumerate(graph.nodes)}
    call = _caller(graph)
    grads = [g.grad for g in run]
    with graph.inserting_after(max(grads, key=order.__getitem__)):
        cat = call(aten.cat.default, grads, 1)
    last = max(run, key=lambda g: order[g.node])
    with graph.inserting_before(last.node):
        weights = _union([g.rows for g in run], call)
        merged = call(aten.mm.default, cat, weights)
    for g in run:
        if g is last:
            continue
        val = _val(g.node)
        with graph.inserting_before(g.node):
            # ``G_i @ W_i`` has ``G_i``'s rows, the token count: under dynamic shapes a
            # symbol, which the graph holds as a node (a SymInt is no argument).
            rows = val.shape[0]
            if isinstance(rows, torch.SymInt):
                rows = call(aten.sym_size.int, g.grad, 0)
            zeros = graph.call_function(
                aten.full.default,
                ([rows, *val.shape[1:]], 0),
                {"dtype": val.dtype, "layout": torch.strided, "device": val.device},
            )
        # Made from the fake result itself: ``full`` has no tensor input to carry the
        # trace's fake mode, so calling it would allocate a real tensor.
        zeros.meta["val"] = val.new_zeros(val.shape)
        g.node.replace_all_uses_with(zeros)
    last.node.replace_all_uses_with(merged)
    for g in run:
        graph.erase_node(g.node)
    weight_grads = _weight_grads(graph, grads)
    if weight_grads is None:
        return len(run) - 1
    return len(run) - 1 + _merge_weight_grads(graph, weight_grads, cat)


def _weight_grad(node: fx.Node) -> fx.Node | None:
    """``G`` of a GEMM ``G.T @ x`` (a linear's weight gradient), else None."""
    aten = torch.ops.aten
    if node.target is not aten.mm.default or node.kwargs:
        return None
    t, x = node.args
    if not (
        isinstance(t, fx.Node)
        and isinstance(x, fx.Node)
        and t.target is aten.permute.default
        and list(t.args[1]) == [1, 0]
        and isinstance(t.args[0], fx.Node)
        and _val(t.args[0]) is not None
        and _val(t.args[0]).dim() == 2
    ):
        return None
    return t.args[0]


def _merge_weight_grads(graph: fx.Graph, mms: list[fx.Node], cat: fx.Node | None = None) -> int:
    """``G_i.T @ x`` for one ``x`` as one GEMM ``cat(G_i).T @ x``, each result its rows
    (``cat``: that of the ``G_i`` in this order, where made already); GEMMs removed.
    Left alone where a ``G_i`` is computed from a result.

    The GEMM goes after the last ``G_i``; readers of a result that came before it
    (autocast casts each weight gradient to float32 as soon as it is made) move after
    it, the graph's order otherwise kept (:func:`_sort`)."""
    aten = torch.ops.aten
    grads = [mm.args[0].args[0] for mm in mms]
    x = mms[0].args[1]
    if set(mms) & _ancestors(grads):
        return 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    call = _caller(graph)
    if cat is None:
        with graph.inserting_after(max(grads, key=order.__getitem__)):
            cat = call(aten.cat.default, grads, 1)
        order = {node: i for i, node in enumerate(graph.nodes)}
    # inserting_before the next node: inserting_after puts each new node first.
    with graph.inserting_before(max([cat, x], key=order.__getitem__).next):
        merged = call(aten.mm.default, call(aten.permute.default, cat, [1, 0]), x)
        parts = []
        start = 0
        for mm in mms:
            stop = start + _val(mm).shape[0]
            parts.append(call(aten.slice.Tensor, merged, 0, start, stop))
            start = stop
    for mm, part in zip(mms, parts):
        mm.replace_all_uses_with(part)
        graph.erase_node(mm)
    order = {node: i for i, node in enumerate(graph.nodes)}
    if any(order[u] < order[part] for part in parts for u in part.users):
        _sort(graph)
    return len(mms) - 1


def _sort(graph: fx.Graph) -> None:
    """Order ``graph`` so that every node comes after its inputs, keeping the order it
    had wherever that allows (Kahn's algorithm, the earliest ready node first)."""
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    waiting = {node: len(set(node.all_input_nodes)) for node in nodes}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        ordered.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, index[user])
    for before, after in zip(ordered, ordered[1:]):
        before.append(after)


def _distinct_grads(mms: list[fx.Node]) -> list[fx.Node]:
    """``mms`` with one GEMM per ``G`` (the first)."""
    seen: dict[fx.Node, fx.Node] = {}
    for mm in mms:
        seen.setdefault(mm.args[0].args[0], mm)
    return list(seen.values())


def _weight_grad_groups(graph: fx.Graph) -> list[list[fx.Node]]:
    """The weight-gradient GEMMs left, by their ``x`` (the same reshape counted once),
    dtype and rows, in graph order: each group of two or more can be one GEMM."""
    groups: dict[Any, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        grad = _weight_grad(node) if node.op == "call_function" else None
        if grad is not None:
            val = _val(grad)
            groups[(_input_key(node.args[1]), val.dtype, _size_key(val.shape[0]))].append(node)
    return [mms for mms in groups.values() if len({m.args[0].args[0] for m in mms}) > 1]


# ---- the pass ------------------------------------------------------------------------
def stack_graph(graph: fx.Graph) -> int:
    """Make each run of GEMMs over one projection group's adjacent rows one GEMM (the
    three rewrites of this module's docstring); how many GEMMs were removed."""
    bases = _bases(graph)
    forwards: dict[Any, list[_Forward]] = defaultdict(list)
    input_grads: dict[Any, list[_InputGrad]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        fwd = _forward(node, bases)
        if fwd is not None:
            bias_key = None if fwd.bias is None else fwd.bias.key
            forwards[(_input_key(fwd.x), fwd.weight.key, bias_key)].append(fwd)
            continue
        grad = _input_grad(node, bases)
        if grad is not None:
            tokens = _size_key(_val(grad.grad).shape[0])
            input_grads[(grad.rows.key, tokens)].append(grad)
    removed = 0
    for items in forwards.values():
        for run in _runs(items):
            _merge_forward(graph, run)
            removed += len(run) - 1
    for items in input_grads.values():
        for run in _runs(items):
            for part in _summed_runs(run):
                removed += _merge_backward(graph, part)
    # Weight gradients whose input gradients did not merge (autocast's backward reads
    # its own saved copies of the weights, no group's rows) still share their ``x``.
    for mms in _weight_grad_groups(graph):
        removed += _merge_weight_grads(graph, _distinct_grads(mms))
    if removed:
        graph.eliminate_dead_code()
    return removed


def stacked_projections_pass(layout: Hashable = ()) -> Any:
    """A new inductor post-grad pass running :func:`stack_graph`, whose ``uuid`` keys
    inductor's FX graph cache on this file and ``layout`` (a warm start reuses its
    results). Made here rather than at import: torch's pass base class loads dynamo
    and inductor.

    ``layout`` names which parameters lie back to back (a module's projection groups,
    by their names in it), and two passes are equal exactly when their layouts are.
    Why: dynamo keeps one cache per code object and reuses an entry for an equal
    backend, which ``torch.compile``'s inductor wrapper decides by comparing its
    options, and its guards do not see which inputs are adjacent rows of one storage.
    Layers of one class laid out alike (``compile_stacked`` of each decoder layer)
    then share one compile, where a pass equal only to itself would make each a new
    backend and the ninth would hit dynamo's recompile limit and run eagerly; and a
    layer laid out otherwise (a group that could not form) compiles its own code
    rather than reading the other layout's rows."""
    uuid = (files_hash(__file__), layout)

    class StackedProjections(custom_graph_pass_class()):  # type: ignore[misc]
        def __call__(self, graph: fx.Graph) -> None:
            removed = stack_graph(graph)
            if removed:
                logger.debug("cudagraphs: projection groups took %d GEMMs fewer", removed)

        def uuid(self) -> Any:
            return uuid

        def __eq__(self, other: object) -> bool:
            return type(other).__qualname__ == type(self).__qualname__ and (
                other.uuid() == uuid  # type: ignore[attr-defined]
            )

        def __hash__(self) -> int:
            return hash(uuid)

    return StackedProjections()


def can_add_pass(options: Mapping[str, Any]) -> bool:
    """Whether ``torch.compile`` keywords ``options`` compile through inductor and leave
    its ``post_grad_custom_pre_pass`` free for :func:`stacked_projections_pass`."""
    if options.get("backend", "inductor") != "inductor":
        return False
    return (options.get("options") or {}).get("post_grad_custom_pre_pass") is None


def with_stacked_projections(options: Mapping[str, Any], layout: Hashable = ()) -> dict[str, Any]:
    """``torch.compile`` keywords with :func:`stacked_projections_pass` (of ``layout``)
    set in their inductor options; a ``mode`` becomes the options it stands for (torch
    takes one or the other). ``options`` must pass :func:`can_add_pass`."""
    out = dict(options)
    inductor = dict(out.get("options") or {})
    mode = out.pop("mode", None)
    if mode is not None:
        inductor = {**mode_options(mode, out.get("dynamic")), **inductor}
    inductor["post_grad_custom_pre_pass"] = stacked_projections_pass(layout)
    out["options"] = inductor
    return out
