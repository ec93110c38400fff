"""Capture: one forward graph (and in training one backward graph) per entry, in
schedule order, all in one memory pool.

Capture-time hooks run here too, always outside the capture context: pre-hooks
before ``capture_into_graph`` is entered, post-hooks after it returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..capture import GraphMemoryPool, capture_into_graph
from ..errors import CudaGraphsTypeError, CudaGraphsValueError
from .canonicalize import EntrySpec, GraphPlan
from .grad_staging import GradStaging
from .grad_targets import GradTargets
from .lent_grads import lent_grads_of
from .runtime import EntryGraphs
from .sharing import BufferSharing, chained_inputs
from .te_compat import ReplayKeywords
from .warmup import differentiable_inputs, parameter_alias

__all__ = ["BackwardCapture", "CaptureOptions", "ForwardCapture", "capture_plan"]


@dataclass(frozen=True)
class CaptureOptions:
    pool: GraphMemoryPool
    stream: torch.cuda.Stream
    allow_unused_input: bool
    retain_graph_in_backward: bool
    clone_param_grads_on_return: bool
    # Per callable: where its backward graphs add parameter gradients (in-graph
    # accumulation), or None (gradients handed to autograd). Empty: None for all.
    grad_targets: tuple[GradTargets | None, ...] = ()
    sharing: BufferSharing | None = None  # buffers shared beyond the pool (.sharing)
    # Owned mode: where backward graphs leave their parameter gradients (.grad_staging).
    staging: GradStaging | None = None
    # Per entry: the tensor outputs no backward reaches (check_unreached_outputs).
    unreached: Mapping[int, frozenset[int]] = field(default_factory=dict)
    # Owned mode: hand out the gradient buffers, copied only when kept (.deferred_grads).
    defer_owned_copies: bool = False
    # The entries whose callers own their tensor outputs (EntryGraphs.owned_outputs).
    owned_outputs: frozenset[int] = frozenset()


def _describe(plan: GraphPlan, entry_index: int) -> str:
    e = plan.entries[entry_index].entry
    name = plan.callable_of(entry_index).name
    if plan.layout.order is None:
        return name
    return (
        f"{name}, entry {e.index} (chunk {e.chunk + 1}, microbatch {e.microbatch}, layer {e.layer})"
    )


def _new_static_inputs(spec: EntrySpec, training: bool = True) -> list[torch.Tensor]:
    return [_new_static_input(t, training) for t in spec.tensors]


def _new_static_input(t: torch.Tensor, training: bool = True) -> torch.Tensor:
    # Fresh buffers rather than the user's sample tensors: the caller may reuse or free
    # the samples, and the graph must own what it reads. Parameters passed as inputs
    # (explicit-parameter adapters) are the exception: they are persistent, the graph
    # reads them in place (no copy per call), and every call must pass the same
    # parameter with the same storage (checked on the replay path); the graph gets
    # an alias of it (:func:`~.warmup.parameter_alias` says why).
    # Without a backward graph (eval mode, grad disabled) no buffer requires grad
    # whatever the sample did: a call's copy into a leaf that requires grad fails, and
    # a call whose input requires grad is then the uncaptured-gradient case it is.
    if isinstance(t, torch.nn.Parameter):
        return parameter_alias(t)
    return t.detach().clone().requires_grad_(t.requires_grad and training)


def _static_inputs(
    plan: GraphPlan, index: int, pending: dict[int, _Pending], opts: CaptureOptions
) -> tuple[list[torch.Tensor], dict[int, int]]:
    """Entry ``index``'s static inputs, chained ones included (:mod:`.sharing`), and
    its chained positions with their source entries."""

    def outputs_of(source: int) -> list[torch.Tensor] | None:
        done = pending.get(source)
        return None if done is None or done.forward is None else done.forward.tensor_outputs

    spec = plan.entries[index]
    chained = chained_inputs(opts.sharing, index, spec.tensors, outputs_of)
    static = [
        chained[p][0] if p in chained else _new_static_input(t, plan.training)
        for p, t in enumerate(spec.tensors)
    ]
    return static, {p: source for p, (_, source) in chained.items()}


def _entry_inputs(
    plan: GraphPlan,
    index: int,
    static_inputs: list[torch.Tensor],
    opts: CaptureOptions | None,
) -> dict[str, Any]:
    """The input side of one entry's :class:`EntryGraphs` (its fields by name); with
    ``opts=None`` that of an entry that validates calls like a graphed one but runs
    them eagerly (``CUDAGRAPHS_DISABLE``): no static buffers, no graphs."""
    spec = plan.entries[index]
    target = plan.callable_of(index)
    positional_only = not spec.kwargs and len(spec.leaves) == len(spec.args) == len(
        spec.tensor_positions
    )
    captures_backward = plan.training and opts is not None
    tensor_slots = set(spec.tensor_positions)
    return dict(
        name=_describe(plan, index),
        in_spec=spec.in_spec,
        # The constants of the call; not its sample tensors: held by a graph for good,
        # a sample would pin its caching-allocator segment (for partial graphs, one
        # of the eager activations' segments around it) for as long as the graph lives.
        leaves=[None if i in tensor_slots else x for i, x in enumerate(spec.leaves)],
        tensor_positions=spec.tensor_positions,
        paths=spec.paths,
        # Whether a gradient is captured for the input: only with a backward graph.
        input_meta=tuple(
            (t.shape, t.dtype, t.requires_grad and plan.training) for t in spec.tensors
        ),
        pinned=tuple(
            (i, t.data_ptr(), t)
            for i, t in enumerate(spec.tensors)
            if isinstance(t, torch.nn.Parameter)
        ),
        static_inputs=static_inputs,
        params=target.params if captures_backward else (),
        untracked_params=()
        if plan.training or opts is None
        else tuple(zip(target.param_names, target.params)),
        frozen_params=target.frozen if opts is not None else (),
        clone_param_grads=opts.clone_param_grads_on_return if opts is not None else True,
        positional_only=positional_only,
        replay_keywords=ReplayKeywords.of(
            target.fn if target.module is None else target.module.forward, list(spec.kwargs)
        ),
        eager_only=opts is None,
        lent=lent_grads_of(opts.pool) if opts is not None else None,
        defer_copies=opts.defer_owned_copies if opts is not None else False,
        owned_outputs=opts is not None and index in opts.owned_outputs,
    )


def eager_entry_graphs(plan: GraphPlan, index: int) -> EntryGraphs:
    """See :func:`_entry_inputs` with ``opts=None``."""
    return EntryGraphs(**_entry_inputs(plan, index, [], None))


@dataclass(frozen=True)
class ForwardCapture:
    """What the forward capture of one entry made: its graph and static outputs."""

    graph: torch.cuda.CUDAGraph
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]
    out_tensor_positions: tuple[int, ...]
    out_differentiable: tuple[bool, ...]  # per tensor output
    pool_bytes: int = 0  # what the device's reserved memory grew by during the capture
    seq: int = 0  # its number among the pool's captures (.deferred_grads)

    @property
    def tensor_outputs(self) -> list[torch.Tensor]:
        return [self.out_leaves[i] for i in self.out_tensor_positions]

    def detached(self) -> ForwardCapture:
        """The same capture with its static outputs cut from the captured autograd
        graph (the same buffers)."""
        leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in self.out_leaves]
        return dataclasses.replace(self, out_leaves=leaves)


@dataclass(frozen=True)
class BackwardCapture:
    """What the backward capture of one entry made (``graph`` is ``None`` when nothing
    was differentiable: no graph, no buffers)."""

    diff_input_positions: tuple[int, ...]
    graph: torch.cuda.CUDAGraph | None = None
    static_grad_outputs: list[torch.Tensor | None] = field(default_factory=list)
    static_grad_inputs: tuple[torch.Tensor | None, ...] = ()
    grad_targets: GradTargets | None = None
    pool_bytes: int = 0  # as ForwardCapture's
    new_buffer_bytes: int = 0  # incoming-gradient buffers made for it (not shared ones)
    # Differentiable tensor outputs captured as getting no gradient (no buffer).
    unreached_outputs: tuple[int, ...] = ()
    seq: int = 0  # as ForwardCapture's


@dataclass
class _Pending:
    """One entry while the schedule captures it: its input side, then its forward,
    then (in training) its backward. Becomes an :class:`EntryGraphs` once, complete."""

    inputs: dict[str, Any]
    forward: ForwardCapture | None = None
    backward: BackwardCapture | None = None

    def release(self) -> None:
        for capture in (self.forward, self.backward):
            if capture is not None and capture.graph is not None:
                capture.graph.reset()

    def build(self) -> EntryGraphs:
        fields: dict[str, Any] = dict(self.inputs)
        if self.forward is not None:
            fields.update(
                fwd_graph=self.forward.graph,
                out_spec=self.forward.out_spec,
                out_leaves=self.forward.out_leaves,
                out_tensor_positions=self.forward.out_tensor_positions,
                out_differentiable=self.forward.out_differentiable,
                pool_bytes=self.forward.pool_bytes,
                fwd_seq=self.forward.seq,
            )
        if self.backward is not None:
            fields.update(
                bwd_graph=self.backward.graph,
                diff_input_positions=self.backward.diff_input_positions,
                static_grad_outputs=self.backward.static_grad_outputs,
                static_grad_inputs=self.backward.static_grad_inputs,
                grad_targets=self.backward.grad_targets,
                unreached_outputs=self.backward.unreached_outputs,
                pool_bytes=fields.get("pool_bytes", 0) + self.backward.pool_bytes,
                buffer_bytes=fields["buffer_bytes"] + self.backward.new_buffer_bytes,
                bwd_seq=self.backward.seq,
            )
        return EntryGraphs(**fields)


def _capture_forward(
    plan: GraphPlan, inputs: dict[str, Any], index: int, opts: CaptureOptions
) -> ForwardCapture:
    target = plan.callable_of(index)
    leaves = list(inputs["leaves"])
    for pos, t in zip(inputs["tensor_positions"], inputs["static_inputs"]):
        leaves[pos] = t
    args, kwargs = pytree.tree_unflatten(leaves, inputs["in_spec"])
    grad_mode = torch.enable_grad if plan.training else torch.no_grad

    def run() -> Any:
        with grad_mode():
            return target.fn(*args, **kwargs)

    before = torch.cuda.memory_reserved(opts.stream.device)
    graph, output = capture_into_graph(
        run, opts.pool, stream=opts.stream, what=f"forward of {inputs['name']}"
    )
    grown = torch.cuda.memory_reserved(opts.stream.device) - before
    seq = lent_grads_of(opts.pool).deferred.next_capture()
    out_leaves, out_spec = pytree.tree_flatten(output)
    positions = tuple(i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor))
    return ForwardCapture(
        graph=graph,
        out_spec=out_spec,
        out_leaves=out_leaves,
        out_tensor_positions=positions,
        out_differentiable=tuple(out_leaves[i].requires_grad for i in positions),
        pool_bytes=grown,
        seq=seq,
    )


def check_entry_indices(value: object, n_entries: int, what: str) -> frozenset[int]:
    """``value`` (a collection of entry indices, ``what`` in errors) as a frozenset.

    Raises:
        CudaGraphsTypeError: not a collection, or an index that is not an int.
        CudaGraphsValueError: an index out of range.
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise CudaGraphsTypeError(
            f"{what} must be a collection of entry indices, got {type(value).__name__}"
        )
    items = tuple(value)
    for entry in items:
        if not isinstance(entry, int) or isinstance(entry, bool):
            raise CudaGraphsTypeError(f"{what}: entry index {entry!r} is not an int")
        if not 0 <= entry < n_entries:
            raise CudaGraphsValueError(
                f"{what}: entry {entry} is out of range (there are {n_entries} entries)"
            )
    return frozenset(items)


def check_unreached_outputs(value: object, n_entries: int) -> dict[int, frozenset[int]]:
    """``_unreached_outputs`` as ``make_graphed_callables`` takes it: per entry index,
    the positions among the entry's tensor outputs that no backward reaches (their
    backward graph gets no incoming-gradient buffer for them, and a backward that does
    reach one raises :class:`~cudagraphs.errors.UncapturedGradientError`). ``None``:
    every output may be reached.

    Raises:
        CudaGraphsTypeError: not a mapping of ints to collections of ints.
        CudaGraphsValueError: an entry index out of range, or a negative position.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise CudaGraphsTypeError(
            f"_unreached_outputs must be a mapping of entry index to output positions, "
            f"got {type(value).__name__}"
        )
    out: dict[int, frozenset[int]] = {}
    for entry, positions in value.items():
        if not isinstance(entry, int) or isinstance(entry, bool):
            raise CudaGraphsTypeError(f"_unreached_outputs: entry index {entry!r} is not an int")
        if not 0 <= entry < n_entries:
            raise CudaGraphsValueError(
                f"_unreached_outputs: entry {entry} is out of range (there are {n_entries} entries)"
            )
        if isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
            raise CudaGraphsTypeError(
                f"_unreached_outputs[{entry}] must be a collection of output positions, "
                f"got {type(positions).__name__}"
            )
        items = tuple(positions)
        bad = [p for p in items if not isinstance(p, int) or isinstance(p, bool) or p < 0]
        if bad:
            raise CudaGraphsValueError(
                f"_unreached_outputs[{entry}]: {bad} are not output positions (ints >= 0)"
            )
        out[entry] = frozenset(items)
    return out


def check_unreached_fits(unreached: frozenset[int], forward: ForwardCapture, name: str) -> None:
    """Refuse positions past the tensor outputs the forward capture made.

    Raises:
        CudaGraphsValueError: naming the entry, the positions and the output count.
    """
    count = len(forward.out_tensor_positions)
    past = sorted(p for p in unreached if p >= count)
    if past:
        raise CudaGraphsValueError(
            f"{name}: _unreached_outputs names output positions {past}, but the call "
            f"returns {count} tensor(s). Fix: name positions among its tensor outputs, "
            "in the order torch.utils._pytree flattens them."
        )


def _grad_output_buffers(
    outs: list[torch.Tensor], differentiable: tuple[bool, ...], shared: list | None
) -> tuple[list[torch.Tensor | None], bool]:
    """Static incoming-gradient buffers, and whether they were made here; reuses
    ``shared`` (a slot's or a shape's buffers from an earlier entry) when every shape
    and dtype fits, and fills it otherwise."""
    like = [o if d else None for o, d in zip(outs, differentiable)]

    def fits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        if a is None or b is None:
            return a is b
        return (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)

    if shared and len(shared) == len(like) and all(fits(a, b) for a, b in zip(shared, like)):
        return list(shared), False
    # Allocated before capture, so they come from the ordinary allocator, not the pool.
    buffers = [torch.zeros_like(o) if o is not None else None for o in like]
    if shared is not None:
        shared[:] = buffers
    return buffers, True


def grad_output_key(forward: ForwardCapture) -> tuple:
    """What two entries' differentiable outputs must agree on to share incoming-gradient
    buffers (:mod:`.sharing`)."""
    return tuple(
        (tuple(o.shape), o.dtype, o.device) if d else None
        for o, d in zip(forward.tensor_outputs, forward.out_differentiable)
    )


def _owned(grads: tuple, buffers: list[torch.Tensor]) -> tuple:
    """``grads`` with each one that is an incoming-gradient buffer, or a view of one,
    replaced by a copy (made inside the graph being captured).

    Why: a backward that passes its output's gradient through unchanged (``x + f(w)``
    for ``x``; ``x + b`` for a full-shape ``b``) hands back the buffer itself. Lent to
    ``.grad`` or passed on to another backward, it would change under the next copy
    into the buffer: the next replay of this entry, or of any entry sharing it.
    """
    ptrs = {b.untyped_storage().data_ptr() for b in buffers}
    return tuple(
        g.clone() if g is not None and g.untyped_storage().data_ptr() in ptrs else g for g in grads
    )


def _capture_backward(
    inputs: dict[str, Any],
    forward: ForwardCapture,
    opts: CaptureOptions,
    shared: list | None = None,
    targets: GradTargets | None = None,
    unreached: frozenset[int] = frozenset(),
) -> BackwardCapture:
    outs = forward.tensor_outputs
    positions, diff_inputs = differentiable_inputs(inputs["static_inputs"], inputs["params"])
    skipped = tuple(i for i, d in enumerate(forward.out_differentiable) if d and i in unreached)
    wanted = tuple(d and i not in unreached for i, d in enumerate(forward.out_differentiable))
    diff_outs = [o for o, w in zip(outs, wanted) if w]
    if not diff_outs or not diff_inputs:
        return BackwardCapture(diff_input_positions=tuple(positions), unreached_outputs=skipped)
    # Incoming gradients are copied into these before each backward replay.
    static_grad_outputs, made = _grad_output_buffers(outs, wanted, shared)
    grad_outputs = [s for s in static_grad_outputs if s is not None]
    n_diff = len(positions)

    def run() -> tuple[torch.Tensor | None, ...]:
        grads = torch.autograd.grad(
            diff_outs,
            diff_inputs,
            grad_outputs=grad_outputs,
            allow_unused=opts.allow_unused_input,
            retain_graph=opts.retain_graph_in_backward,
        )
        if targets is not None:
            # In-graph accumulation: one multi-tensor add inside the graph.
            targets.note_written(grads[n_diff:])
            pairs = [(t, d) for t, d in zip(targets.targets, grads[n_diff:]) if d is not None]
            if pairs:
                with torch.no_grad():
                    torch._foreach_add_([t for t, _ in pairs], [d for _, d in pairs])
            grads = (*grads[:n_diff], *(None,) * (len(grads) - n_diff))
        elif opts.staging is not None:
            grads = (*grads[:n_diff], *opts.staging.stage(grads[n_diff:]))
        return _owned(grads, grad_outputs)

    before = torch.cuda.memory_reserved(opts.stream.device)
    graph, grads = capture_into_graph(
        run, opts.pool, stream=opts.stream, what=f"backward of {inputs['name']}"
    )
    return BackwardCapture(
        diff_input_positions=tuple(positions),
        graph=graph,
        static_grad_outputs=static_grad_outputs,
        static_grad_inputs=tuple(grads),
        grad_targets=targets,
        pool_bytes=torch.cuda.memory_reserved(opts.stream.device) - before,
        new_buffer_bytes=sum(_nbytes(b) for b in grad_outputs) if made else 0,
        unreached_outputs=skipped,
        seq=lent_grads_of(opts.pool).deferred.next_capture(),
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def capture_plan(plan: GraphPlan, opts: CaptureOptions) -> list[EntryGraphs]:
    """Capture every step of ``plan.schedule``; return one :class:`EntryGraphs` per entry.

    On failure every graph captured so far is released before the error propagates.
    """
    if opts.clone_param_grads_on_return and plan.training and not opts.defer_owned_copies:
        # Owned gradients copied at every replay: the backward graphs copy theirs into
        # one shared buffer, sized for the largest callable (.grad_staging says why).
        staged = [
            c.params
            for c, t in zip(plan.callables, opts.grad_targets or (None,) * len(plan.callables))
            if t is None
        ]
        opts = dataclasses.replace(opts, staging=GradStaging.for_params(staged))
    pending: dict[int, _Pending] = {}
    # Under _reuse_graph_input_output_buffers, entries of one slot (same callable, same
    # shapes, lifetimes that never overlap in the schedule) share their static inputs
    # and incoming-gradient buffers; under sharing, entries with outputs of equal
    # shapes share incoming-gradient buffers (see .sharing).
    slot_inputs: dict[int, list[torch.Tensor]] = {}
    slot_grad_outputs: dict[Any, list] = {}
    chains: dict[int, dict[int, int]] = {}
    share_grads = opts.sharing is not None and opts.sharing.grad_outputs
    try:
        for step in plan.schedule:
            target = plan.callables[step.callable_index]
            hooks = plan.hooks[step.callable_index]
            if step.kind == "fwd":
                spec = plan.entries[step.entry]
                if plan.buffer_slots is not None:
                    slot = plan.buffer_slots[step.entry]
                    fresh = slot not in slot_inputs
                    static_inputs = slot_inputs.setdefault(slot, _new_static_inputs(spec))
                    chained: dict[int, int] = {}
                else:
                    fresh = True
                    static_inputs, chained = _static_inputs(plan, step.entry, pending, opts)
                inputs = _entry_inputs(plan, step.entry, static_inputs, opts)
                inputs["chained"] = tuple(
                    (i, pending[source].inputs["name"]) for i, source in sorted(chained.items())
                )
                inputs["buffer_bytes"] = (
                    sum(
                        _nbytes(t)
                        for i, t in enumerate(static_inputs)
                        if i not in chained and not isinstance(spec.tensors[i], torch.nn.Parameter)
                    )
                    if fresh
                    else 0
                )
                chains[step.entry] = chained
                p = pending[step.entry] = _Pending(inputs)
                hooks.run("forward_pre_hooks", target.fn)
                p.forward = _capture_forward(plan, p.inputs, step.entry, opts)
                hooks.run("forward_hooks", target.fn)
            else:
                hooks.run("backward_pre_hooks", target.fn)
                p = pending[step.entry]
                shared = None
                if plan.buffer_slots is not None:
                    shared = slot_grad_outputs.setdefault(plan.buffer_slots[step.entry], [])
                elif share_grads:
                    shared = slot_grad_outputs.setdefault(grad_output_key(p.forward), [])
                targets = opts.grad_targets[step.callable_index] if opts.grad_targets else None
                unreached = opts.unreached.get(step.entry, frozenset())
                check_unreached_fits(unreached, p.forward, p.inputs["name"])
                p.backward = _capture_backward(
                    p.inputs, p.forward, opts, shared, targets, unreached
                )
                if p.backward.graph is not None and not opts.retain_graph_in_backward:
                    # Drop the captured autograd graph that the static outputs still
                    # hang on to. It holds the parameters' AccumulateGrad nodes,
                    # created on the capture stream; kept alive, autograd would reuse
                    # them, with that stream, in eager backwards.
                    p.forward = p.forward.detached()
                hooks.run("backward_hooks", target.fn)
    except BaseException:
        for p in pending.values():
            p.release()
        raise
    for targets in opts.grad_targets or ():
        if targets is not None:
            targets.keep_written()
    graphs = {i: p.build() for i, p in pending.items()}
    for entry, chained in chains.items():
        for i, source in chained.items():
            graphs[source].dependents.append((graphs[entry], i))
    return [graphs[i] for i in range(len(plan.entries))]
