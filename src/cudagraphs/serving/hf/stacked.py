"""One GEMM per projection group in the compiled decode step.

Why: at decode, a projection's GEMM reads one row of activations against its whole
weight, and on an H100 every such GEMM costs about 6 µs whatever its size (a k or v
projection of 512 x 2048 reads at 352 GB/s: the kernel's fixed cost, not the
bandwidth). A Llama layer's q, k and v projections take 18.1 µs as three GEMMs and
7.8 µs as one; its gate and up projections 21.1 µs as two and 18.2 µs as one
(``benchmarks/probes/decode_gemms.py``): about 0.21 ms a token over 16 layers, 14% of
the compiled step. Inductor's own concatenation of linears runs only with
``freezing`` (the weights become constants, so updating them in place no longer
reaches the compiled code) and only for weights of equal shape (not GQA's q beside
its k and v).

So three parts, all set up at capture:

* :func:`stack_projections` lays the weights of sibling ``nn.Linear`` modules (same
  parent, same input width, dtype, device and bias or none: q/k/v, gate/up) back to
  back in one buffer per group, the biases in another. Each ``Parameter`` stays the
  same object, its ``.data`` re-pointed at its rows, so the memory is not doubled and
  in-place updates, ``state_dict``, optimizers and the generator's weight check keep
  working; :meth:`StackedGroups.unstack` gives every weight its own memory back (the
  generator's ``close``).
* :meth:`StackedGroups.reading`: while a decode step is traced, each grouped module's
  ``forward`` is ``linear(x, buffer[start:stop])``: the traced code reads the group's
  buffer, never the parameters. It must not read both: a nested compile region
  refuses inputs that alias each other (dynamo's "Higher order ops do not support
  aliasing"), and the decoder layers are such regions (:mod:`.regions`).
* :func:`stacked_projections_pass`, an inductor post-grad pass set only on the
  generator's own compile (``compile_options``' inductor options, never torch's global
  config): the GEMMs of one input over adjacent row slices of one buffer become one
  GEMM over their union, whose output the graph slices per projection (views, no
  copies). It reads the graph alone, so it holds for every layer of a shared region
  body and for any buffer the traced code slices so.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ...errors import CudaGraphsTypeError, CudaGraphsValueError
from ...torch_private import custom_graph_pass_class, files_hash, mode_options
from .regions import forwards_set

__all__ = [
    "ProjectionGroup",
    "StackedGroups",
    "check_stack_projections",
    "stack_graph",
    "stack_projections",
    "stacked_projections_pass",
    "with_stacked_projections",
]

logger = logging.getLogger(__name__)


# ---- stacking the weights ------------------------------------------------------------
def _sliced_linear(
    weights: torch.Tensor,
    biases: torch.Tensor | None,
    start: int,
    stop: int,
    x: torch.Tensor,
) -> torch.Tensor:
    bias = None if biases is None else biases[start:stop]
    return F.linear(x, weights[start:stop], bias)


@dataclass
class ProjectionGroup:
    """Sibling linears whose weights lie back to back in :attr:`weights` (their biases
    in :attr:`biases`).

    Attributes:
        names: the modules' names in the model, in buffer order.
        modules: the modules.
        weights: the buffer their weights are the rows of.
        biases: the buffer their biases are the parts of (``None``: unbiased).
        forwards: per module, its ``forward`` while a decode step is traced (made once:
            a compiled step's guards see the same objects at every call).
    """

    names: tuple[str, ...]
    modules: tuple[nn.Linear, ...]
    weights: torch.Tensor
    biases: torch.Tensor | None
    forwards: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = field(repr=False)

    @classmethod
    def stack(cls, names: tuple[str, ...], modules: tuple[nn.Linear, ...]) -> ProjectionGroup:
        """Move the modules' weights (and biases) into one buffer each."""
        weights = _stack_rows([m.weight for m in modules])
        biased = modules[0].bias is not None
        biases = _stack_rows([m.bias for m in modules]) if biased else None
        forwards, start = [], 0
        for module in modules:
            stop = start + module.weight.shape[0]
            forwards.append(partial(_sliced_linear, weights, biases, start, stop))
            start = stop
        return cls(names, modules, weights, biases, tuple(forwards))

    def unstack(self) -> None:
        """Give each module's weight (and bias) memory of its own again."""
        for module in self.modules:
            for p in (module.weight, module.bias):
                if p is not None:
                    p.data = p.data.clone()


def _back_to_back(params: list[nn.Parameter]) -> bool:
    """Whether ``params`` are already one storage's consecutive rows (a generator
    stacked them before)."""
    first = params[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in params:
        if p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def _stack_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """The buffer whose rows ``params`` are: made, and each re-pointed at its rows;
    or, where they already are one storage's consecutive rows, a view of those (so
    that the graphs of another generator that stacked them keep reading them)."""
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    if _back_to_back(params):
        return first.data.as_strided((rows, *first.shape[1:]), first.stride())
    buffer = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = buffer[start : start + p.shape[0]]
        start += p.shape[0]
    return buffer


@dataclass
class StackedGroups:
    """The projection groups :func:`stack_projections` laid back to back.

    Attributes:
        groups: the groups, in module order.
        modules, forwards: every grouped module and its ``forward`` while a decode
            step is traced, flattened once (entered at every decode step run in
            Python).
    """

    groups: tuple[ProjectionGroup, ...] = ()
    modules: tuple[nn.Linear, ...] = field(init=False, repr=False)
    forwards: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.modules = tuple(m for g in self.groups for m in g.modules)
        self.forwards = tuple(f for g in self.groups for f in g.forwards)

    @property
    def names(self) -> list[tuple[str, ...]]:
        """Per group, the modules' names in buffer order."""
        return [g.names for g in self.groups]

    def reading(self) -> AbstractContextManager[None]:
        """Each grouped module's ``forward`` its slice of the group's buffers inside
        the block (:func:`~.regions.forwards_set`)."""
        return forwards_set(self.modules, self.forwards)

    def unstack(self) -> None:
        """Give every moved weight memory of its own again (idempotent)."""
        with torch.no_grad():
            for group in self.groups:
                group.unstack()
        self.groups, self.modules, self.forwards = (), (), ()


def _tied(model: nn.Module) -> set[int]:
    """The data pointers at which more than one of the model's parameters and buffers
    start, or one under two names: tied weights, never moved. (Weights a generator
    laid back to back share a storage, not a start.)"""
    uses: dict[int, int] = defaultdict(int)
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for _, t in named:
        uses[t.data_ptr()] += 1
    return {ptr for ptr, n in uses.items() if n > 1}


def _movable(module: Any, tied: set[int]) -> bool:
    if not isinstance(module, nn.Linear) or "forward" in module.__dict__:
        return False
    tensors = [module.weight] + ([] if module.bias is None else [module.bias])
    return all(
        type(t) is nn.Parameter
        and type(t.data) is torch.Tensor
        and t.is_contiguous()
        and t.data_ptr() not in tied
        for t in tensors
    )


def _group_key(linear: nn.Linear) -> tuple[Any, ...]:
    weight = linear.weight
    return (weight.shape[1], weight.dtype, weight.device, linear.bias is not None)


def stack_projections(model: nn.Module) -> StackedGroups:
    """Lay the weights of each run of sibling ``nn.Linear`` modules (children of one
    module, next to each other in its order, with one input width, dtype, device and
    bias or none) back to back in one buffer, their biases in another; each
    ``Parameter`` keeps its object and is re-pointed at its rows. Runs already back to
    back (stacked by another generator) stay where they are, so that its graphs still
    read them. Tied weights (memory another parameter or buffer starts at),
    tensor subclasses, non-contiguous weights and modules whose ``forward`` was
    replaced on the instance are left as they are. Returns the groups."""
    tied = _tied(model)
    groups: list[ProjectionGroup] = []
    with torch.no_grad():
        for parent_name, parent in model.named_modules():
            prefix = f"{parent_name}." if parent_name else ""
            run: list[tuple[str, nn.Linear]] = []
            for name, child in [*parent.named_children(), ("", None)]:
                movable = _movable(child, tied)
                if movable and run and _group_key(child) == _group_key(run[0][1]):
                    run.append((name, child))
                    continue
                if len(run) > 1:
                    names = tuple(prefix + n for n, _ in run)
                    groups.append(ProjectionGroup.stack(names, tuple(m for _, m in run)))
                run = [(name, child)] if movable else []
    if groups:
        logger.info(
            "GraphedGenerator: %d projection groups laid back to back (the first: %s)",
            len(groups),
            ", ".join(groups[0].names),
        )
    return StackedGroups(tuple(groups))


# ---- the inductor pass ---------------------------------------------------------------
@dataclass(frozen=True)
class _Gemm:
    """A post-grad ``mm(x, permute(buffer[start:stop]))`` or the ``addmm`` with
    ``biases[start:stop]``."""

    node: fx.Node
    x: fx.Node
    weights: fx.Node
    biases: fx.Node | None
    start: int
    stop: int


def _row_slice(node: Any) -> tuple[fx.Node, int, int] | None:
    """``(buffer, start, stop)`` of ``aten.slice(buffer, 0, start, stop)`` with plain
    ints (or none: the ends) and step 1, ``stop`` clamped to the rows as Python's
    slicing does (torch writes an open end as the largest int64); else None."""
    if not (isinstance(node, fx.Node) and node.target is torch.ops.aten.slice.Tensor):
        return None
    buffer, dim, start, stop, *step = (*node.args, *([None] * (4 - len(node.args))))
    if dim != 0 or step not in ([], [1]) or node.kwargs:
        return None
    size = buffer.meta["val"].shape[0] if "val" in getattr(buffer, "meta", {}) else None
    start = 0 if start is None else start
    stop = size if stop is None else stop
    if not all(isinstance(v, int) for v in (start, stop, size)):
        return None
    stop = min(stop, size)
    if not 0 <= start < stop:
        return None
    return buffer, start, stop


def _gemm(node: fx.Node) -> _Gemm | None:
    aten = torch.ops.aten
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.mm.default:
        x, transposed, bias = node.args[0], node.args[1], None
    elif node.target is aten.addmm.default and len(node.args) == 3:
        bias, x, transposed = node.args
    else:
        return None
    if not (
        isinstance(transposed, fx.Node)
        and transposed.target is aten.permute.default
        and list(transposed.args[1]) == [1, 0]
    ):
        return None
    rows = _row_slice(transposed.args[0])
    if rows is None or not isinstance(x, fx.Node):
        return None
    weights, start, stop = rows
    biases = None
    if bias is not None:
        parts = _row_slice(bias)
        if parts is None or parts[1:] != (start, stop):
            return None
        biases = parts[0]
    return _Gemm(node, x, weights, biases, start, stop)


def _input_key(x: fx.Node) -> Any:
    """The same key for the same input reshaped again: each linear reshapes its 3-D
    input itself, and the reshapes are separate nodes."""
    if x.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
        return (x.args[0], tuple(x.args[1]))
    return x


def _runs(gemms: list[_Gemm]) -> list[list[_Gemm]]:
    """Runs of two or more GEMMs (one input, one buffer) over adjacent slices."""
    gemms = sorted(gemms, key=lambda g: g.start)
    runs, run = [], gemms[:1]
    for g in gemms[1:]:
        if g.start == run[-1].stop:
            run.append(g)
            continue
        runs.append(run)
        run = [g]
    runs.append(run)
    return [r for r in runs if len(r) > 1]


def stack_graph(graph: fx.Graph) -> int:
    """Make each run of GEMMs of one input over adjacent row slices of one buffer one
    GEMM over their union, sliced per projection; how many runs were made one."""
    groups: dict[Any, list[_Gemm]] = defaultdict(list)
    for node in graph.nodes:
        gemm = _gemm(node)
        if gemm is not None:
            groups[(_input_key(gemm.x), gemm.weights, gemm.biases)].append(gemm)
    made = 0
    for gemms in groups.values():
        for run in _runs(gemms):
            _merge(graph, run)
            made += 1
    if made:
        graph.eliminate_dead_code()
    return made


def _merge(graph: fx.Graph, run: list[_Gemm]) -> None:
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
    start, stop = run[0].start, run[-1].stop

    def call(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = target(*(_val(a) for a in args), **kwargs)
        return node

    with graph.inserting_before(first.node):
        weights = call(aten.slice.Tensor, first.weights, 0, start, stop)
        transposed = call(aten.permute.default, weights, [1, 0])
        if first.biases is None:
            out = call(aten.mm.default, first.x, transposed)
        else:
            biases = call(aten.slice.Tensor, first.biases, 0, start, stop)
            out = call(aten.addmm.default, biases, first.x, transposed)
        for g in run:
            part = call(aten.slice.Tensor, out, 1, g.start - start, g.stop - start)
            copy = call(aten.clone.default, part, memory_format=torch.contiguous_format)
            g.node.replace_all_uses_with(copy)
    for g in run:
        graph.erase_node(g.node)


def _val(arg: Any) -> Any:
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


def stacked_projections_pass() -> Any:
    """A new inductor post-grad pass running :func:`stack_graph`, whose ``uuid`` keys
    inductor's FX graph cache on this file (a warm start reuses its results). Made
    here rather than at import: torch's pass base class loads dynamo and inductor."""

    class StackedProjections(custom_graph_pass_class()):  # type: ignore[misc]
        def __call__(self, graph: fx.Graph) -> None:
            made = stack_graph(graph)
            if made:
                logger.debug("cudagraphs: %d projection groups made one GEMM each", made)

        def uuid(self) -> Any:
            return files_hash(__file__)

    return StackedProjections()


def _can_add_pass(options: Mapping[str, Any]) -> bool:
    if options.get("backend", "inductor") != "inductor":
        return False
    return (options.get("options") or {}).get("post_grad_custom_pre_pass") is None


def with_stacked_projections(options: Mapping[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keywords with :func:`stacked_projections_pass` set in their
    inductor options; a ``mode`` becomes the options it stands for (torch takes one or
    the other). ``options`` must compile through inductor without a
    ``post_grad_custom_pre_pass`` of their own (:func:`check_stack_projections`)."""
    out = dict(options)
    inductor = dict(out.get("options") or {})
    mode = out.pop("mode", None)
    if mode is not None:
        inductor = {**mode_options(mode, out.get("dynamic")), **inductor}
    inductor["post_grad_custom_pre_pass"] = stacked_projections_pass()
    out["options"] = inductor
    return out


def check_stack_projections(value: Any, compile_options: Mapping[str, Any] | None) -> bool:
    """Whether a generator stacks its projections: ``None`` (the default) when it
    compiles through inductor with no post-grad pass of the caller's own; ``True``
    requires that; ``False`` never.

    Raises:
        CudaGraphsTypeError: ``value`` not a bool or ``None``.
        CudaGraphsValueError: ``True`` without ``compile_options`` that compile through
            inductor and leave its ``post_grad_custom_pre_pass`` free.
    """
    if value is not None and not isinstance(value, bool):
        raise CudaGraphsTypeError(
            f"stack_projections must be True, False or None, got {type(value).__name__}: "
            "pass None (the default: on when compiling through inductor) or False"
        )
    possible = compile_options is not None and _can_add_pass(compile_options)
    if value is True and not possible:
        raise CudaGraphsValueError(
            "stack_projections=True needs compile_options that compile through inductor "
            "(its default backend) without a post_grad_custom_pre_pass of their own, got "
            f"compile_options={None if compile_options is None else dict(compile_options)!r}"
            ": an inductor pass makes each group one GEMM. Fix: pass such compile_options "
            "(e.g. {'fullgraph': True}) or leave stack_projections at None"
        )
    return possible and value is not False
