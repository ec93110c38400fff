"""The replay state of ``make_graphed_callables``: one :class:`EntryGraphs` per graphed
entry, holding its graphs, static buffers and per-call checks.

The replay path does per call only what cannot be done at capture: one comparison of
each input's shape/dtype/requires_grad against the captured ones, one fused copy of
the inputs that are not already the static buffers, the replay, and detached views of
the static outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..dtypes import converts_losslessly
from ..errors import (
    ChainedInputError,
    CudaGraphInputError,
    CudaGraphsStateError,
    GraphReleasedError,
    Mismatch,
    UncapturedGradientError,
    describe_mismatches,
)
from ..torch_private import will_engine_execute_node
from .deferred_grads import SMALL_OUTPUT_BYTES, HeldStorage, held_storages
from .grad_targets import GradTargets
from .lent_grads import LentGrads, move_aliased_grads
from .te_compat import ReplayKeywords
from .tree_diff import structure_mismatches

__all__ = ["EntryGraphs", "SetupSeconds"]

logger = logging.getLogger(__name__)

_NOT_CAPTURED = "requires_grad (the sample did not: no gradient was captured for it)"
_NO_BACKWARD = "requires_grad (captured without a backward graph)"
_FROZEN = "requires_grad (frozen at capture: no gradient was captured for it)"


def copy_into(dsts: list[torch.Tensor], srcs: Any) -> None:
    """Copy each source into its static buffer, skipping sources that already are
    the buffer; all remaining copies go out in one fused launch."""
    pairs = []
    for d, s in zip(dsts, srcs):
        if s is None or s is d:
            continue
        if s.data_ptr() == d.data_ptr():
            if s.stride() == d.stride():
                continue  # the buffer itself, under another tensor object
            # Another view of the buffer's own memory (a transposed square buffer):
            # copy_ refuses overlapping memory, so read it through a copy first.
            s = s.clone()
        pairs.append((d, s))
    if len(pairs) == 1:
        pairs[0][0].copy_(pairs[0][1])
    elif pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def stage_grad_outputs(dsts: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Incoming gradients into their static buffers before a backward replay: each
    one given is copied (:func:`copy_into`), and the buffer of each output that no
    gradient reached (``None``) is zeroed in place, all in one launch.

    Why ``None`` rather than zeros: the replay Function does not let autograd
    materialize a zero tensor per such output (an HF model's logits beside its loss
    are one), which would cost an allocation of the output's size and a copy per
    step; a memset of the buffer does the same for the graph."""
    copy_into(dsts, grads)
    unreached = [d for d, g in zip(dsts, grads) if g is None]
    if unreached:
        torch._foreach_zero_(unreached)


@dataclass(frozen=True)
class SetupSeconds:
    """Where one ``make_graphed_callables`` call's set-up time went, shared by every
    result of the call (one account for all its entries: their warmups and captures
    interleave). ``compile`` is the part of ``warmup`` that ``torch.compile`` spent
    compiling (dynamo's records, backward compiles included; 0.0 for eager code),
    and ``compiled_frames`` the frames it compiled then."""

    warmup: float = 0.0
    compile: float = 0.0
    capture: float = 0.0
    compiled_frames: int = 0


@dataclass
class EntryGraphs:
    """The graphs and static buffers of one graphed entry (one ``sample_args`` element).

    Built once, complete, after the entry's captures (``capture_phase``), or without
    graphs for ``CUDAGRAPHS_DISABLE``; what each backward replay hands out is derived
    from the fields at construction. Only :meth:`release` changes it afterwards.

    ``static_inputs`` are owned by this object (shared with entries of the same slot
    under ``_reuse_graph_input_output_buffers``); ``static_outputs`` and
    ``static_grad_inputs`` live in the shared pool and are overwritten by each replay.
    """

    name: str
    in_spec: pytree.TreeSpec
    leaves: list[Any]  # captured leaves of (args, kwargs); tensors are replaced per call
    tensor_positions: tuple[int, ...]
    paths: tuple[str, ...]
    input_meta: tuple[tuple[torch.Size, torch.dtype, bool], ...]
    static_inputs: list[torch.Tensor]
    params: tuple[torch.nn.Parameter, ...]
    # Inputs that are parameters read in place: (tensor index, data_ptr at capture,
    # the parameter). The static input there is an alias of the parameter's storage.
    pinned: tuple[tuple[int, int, torch.nn.Parameter], ...] = ()
    fwd_graph: torch.cuda.CUDAGraph | None = None
    bwd_graph: torch.cuda.CUDAGraph | None = None
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)  # static output leaves
    out_tensor_positions: tuple[int, ...] = ()
    out_differentiable: tuple[bool, ...] = ()  # per tensor output
    static_grad_outputs: list[torch.Tensor | None] = field(default_factory=list)
    diff_input_positions: tuple[int, ...] = ()  # which static inputs get a gradient
    static_grad_inputs: tuple[torch.Tensor | None, ...] = ()  # diff inputs, then params
    clone_param_grads: bool = True
    positional_only: bool = False  # captured call was f(t0, t1, ...) with tensors only
    # (name, parameter) of the parameters that required grad at a capture that made no
    # backward graph (grad disabled, or modules in eval mode): see gradients_not_captured.
    untracked_params: tuple[tuple[str, torch.nn.Parameter], ...] = ()
    # (name, parameter) of the module's parameters frozen at capture: the graphs
    # compute no gradient for them, so one unfrozen since (gradual unfreezing, an
    # adapter switch) is said rather than left without a gradient.
    frozen_params: tuple[tuple[str, torch.nn.Parameter], ...] = ()
    replay_keywords: ReplayKeywords | None = None  # keywords a call may add (te_compat)
    grad_targets: GradTargets | None = None  # in-graph accumulation of param grads
    # Differentiable tensor outputs captured as getting no gradient (no incoming-gradient
    # buffer, not read by the backward graph): a backward that reaches one raises.
    unreached_outputs: tuple[int, ...] = ()
    lent: LentGrads | None = None  # the pool's registry of gradients lent to autograd
    # Owned mode: hand out the gradient buffers, copied only when kept (deferred_grads).
    defer_copies: bool = False
    # The caller owns the tensor outputs: a later replay never changes one it keeps.
    # Handed out as the static outputs, moved out only when still referenced at a
    # replay that could overwrite them (deferred_grads), else copied per replay.
    owned_outputs: bool = False
    fwd_seq: int = 0  # the graphs' numbers among the pool's captures (deferred_grads)
    bwd_seq: int = 0
    eager_only: bool = False  # CUDAGRAPHS_DISABLE: validate calls, run them eagerly
    # Static inputs that are an earlier entry's static output (.sharing): (tensor
    # index, the source's name). A call must pass that very buffer there.
    chained: tuple[tuple[int, str], ...] = ()
    # Entries chained to this one's outputs: (their graphs, tensor index); told when
    # this one is released, so that the buffer becomes theirs.
    dependents: list[tuple[EntryGraphs, int]] = field(
        default_factory=list, repr=False, compare=False
    )
    pool_bytes: int = 0  # reserved memory the captures grew by (the shared pool's)
    buffer_bytes: int = 0  # static input / incoming-gradient buffers made for it
    memory: Any = field(default=None, repr=False, compare=False)  # the call's MemoryAccount
    setup: SetupSeconds | None = field(default=None, repr=False, compare=False)  # the call's
    released: bool = field(default=False, init=False)
    # Forward replays so far: a backward replay reads the activations the last one
    # saved, so it must belong to that one (check_backward_of).
    forward_replays: int = field(default=0, init=False)
    # Derived by _derive() from the fields above, once: what replays hand out.
    autograd_params: tuple[torch.nn.Parameter, ...] = field(init=False, repr=False)
    _grad_free_positions: tuple[int, ...] = field(init=False, repr=False)
    _input_grads: tuple[tuple[int, torch.Tensor], ...] = field(init=False, repr=False)
    _param_grad_slots: tuple[int, ...] = field(init=False, repr=False)
    _param_grad_buffers: list[torch.Tensor] = field(init=False, repr=False)
    _param_grad_params: list[torch.nn.Parameter] = field(init=False, repr=False)
    _param_grad_ptrs: list[int] = field(init=False, repr=False)
    _lent_inputs: tuple[tuple[int, torch.nn.Parameter, torch.Tensor], ...] = field(
        init=False, repr=False
    )
    _lent_input_params: list[torch.nn.Parameter] = field(init=False, repr=False)
    _lent_input_ptrs: list[int] = field(init=False, repr=False)
    _lent_positions: frozenset[int] = field(init=False, repr=False)
    _probe_accumulator: Any = field(init=False, repr=False)
    _anchor_accumulator: Any = field(init=False, repr=False)
    _held: tuple[HeldStorage, ...] = field(init=False, repr=False)
    _held_of: tuple[HeldStorage | None, ...] = field(init=False, repr=False)  # per buffer
    # Owned outputs: their storages, decided at the first forward replay (None before;
    # () when they are copied at every replay), and the one of each tensor output.
    _held_outputs: tuple[HeldStorage, ...] | None = field(init=False, repr=False)
    _held_out_of: tuple[HeldStorage | None, ...] = field(init=False, repr=False)
    _grad_output_buffers: list[torch.Tensor] = field(init=False, repr=False)
    _grad_output_mask: tuple[bool, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._derive()

    # ---- validation -------------------------------------------------------------
    def user_tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensor leaves of a call, after checking it against the captured call.

        Raises:
            CudaGraphInputError: listing every difference as a
                :class:`~cudagraphs.errors.Mismatch` (path, field, expected, received).
        """
        if self.positional_only and not kwargs and len(args) == len(self.input_meta):
            tensors = list(args)
            if all(isinstance(t, torch.Tensor) for t in tensors):
                self._check_meta(tensors)
                return tensors
        keywords = self.replay_keywords
        if kwargs and keywords is not None and not kwargs.keys() <= keywords.captured:
            kwargs, added = keywords.split(kwargs)
            if added:
                self._raise(
                    "the call passes keywords the capture did not have",
                    added,
                    "1. pass them in sample_kwargs too, and graph again; 2. leave them out "
                    "(a keyword whose default is None may be passed as None).",
                )
        leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
        if spec != self.in_spec:
            self._raise(
                "call structure differs from the captured one",
                structure_mismatches(self.in_spec, spec),
                "Pass arguments with the same nesting and keyword names as sample_args/"
                "sample_kwargs.",
            )
        problems = []
        tensor_positions = set(self.tensor_positions)
        for pos, (got, want) in enumerate(zip(leaves, self.leaves)):
            if pos in tensor_positions:
                if not isinstance(got, torch.Tensor):
                    problems.append(Mismatch(self.paths[pos], "type", "Tensor", type(got).__name__))
            elif isinstance(got, torch.Tensor) or not _same_constant(got, want):
                problems.append(Mismatch(self.paths[pos], "constant", want, got))
        if problems:
            self._raise(
                "call differs from the captured one",
                problems,
                "Non-tensor arguments are baked into the graph: pass the captured values, "
                "or graph the callable again for new ones.",
            )
        tensors = [leaves[i] for i in self.tensor_positions]
        self._check_meta(tensors)
        return tensors

    def _check_meta(self, tensors: list[torch.Tensor]) -> None:
        # requires_grad is not checked here: an input that requires grad where the
        # sample did not replays, and a backward that reaches it raises
        # (gradients_not_captured, UncapturedGradientError).
        for t, (shape, dtype, _) in zip(tensors, self.input_meta):
            if t.shape != shape or t.dtype != dtype:
                # Off the common path: maybe only a dtype that converts without loss.
                problems = self._meta_mismatches(tensors)
                if problems:
                    self._raise(
                        "inputs differ from the captured ones (graphs have fixed shapes)",
                        problems,
                        "Capture another graph for this shape or dtype, or pad the inputs.",
                    )
                break
        self.check_pinned(tensors)

    def check_pinned(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every parameter read in place is still the one captured, with its storage.

        Raises:
            CudaGraphInputError: naming the input path of the replaced parameter.
        """
        for i, ptr, param in self.pinned:
            t = tensors[i]
            if t is not param or t.data_ptr() != ptr:
                # Copying into a parameter read in place would overwrite it, and a
                # parameter with new storage would leave the graph reading freed memory.
                path = self.paths[self.tensor_positions[i]]
                self._raise(
                    "a parameter read in place was replaced",
                    [Mismatch(path, "parameter", "the parameter captured there", _describe(t))],
                    f"{path} must be the parameter captured there, with the storage it had at "
                    "capture (it was replaced or re-allocated, e.g. by resharding or .data "
                    "assignment); graph again.",
                )

    def _meta_mismatches(self, tensors: list[torch.Tensor]) -> list[Mismatch]:
        problems = []
        for pos, t, (shape, dtype, _) in zip(self.tensor_positions, tensors, self.input_meta):
            where = self.paths[pos]
            if t.shape != shape:
                problems.append(Mismatch(where, "shape", tuple(shape), tuple(t.shape)))
            if t.dtype != dtype and not converts_losslessly(t.dtype, dtype):
                # A lossless conversion (bf16 into an fp32 input) is made by the staging
                # copy; autograd casts the gradient back to the input's dtype.
                problems.append(Mismatch(where, "dtype", dtype, t.dtype))
        return problems

    def gradients_not_captured(self, tensors: Sequence[torch.Tensor]) -> list[Mismatch]:
        """With grad enabled: the inputs of this call that require grad although no
        captured graph computes their gradient (the sample did not require grad), the
        parameters that require grad when no backward graph was captured, and those
        frozen at capture that require grad now. Empty on
        the common path. torch's helper replays such a call with outputs that carry no
        gradient path, so a backward that reaches the input by another path too
        (``graphed(x) + x``) comes out silently short (pytorch#124582)."""
        missing = [
            Mismatch(self.paths[self.tensor_positions[i]], _NOT_CAPTURED, False, True)
            for i in self._grad_free_positions
            if tensors[i].requires_grad
        ]
        for name, param in self.untracked_params:
            if param.requires_grad:
                missing.append(Mismatch(name, _NO_BACKWARD, False, True))
        for name, param in self.frozen_params:
            if param.requires_grad:
                missing.append(Mismatch(name, _FROZEN, False, True))
        return missing

    def _raise(self, what: str, problems: list[Mismatch], fix: str) -> None:
        raise CudaGraphInputError(
            describe_mismatches(f"{self.name}: {what}", problems, fix), problems
        )

    # ---- replay -----------------------------------------------------------------
    def check_live(self) -> None:
        """Raise :class:`~cudagraphs.errors.GraphReleasedError` once ``reset()`` released the graphs."""
        if self.released:
            raise GraphReleasedError(
                f"{self.name}: its graphs were released by reset(); graph it again with "
                "make_graphed_callables"
            )

    def replay_forward(self, tensors: Any) -> None:
        self.check_live()
        if self.chained:
            self._check_chained(tensors)
        lent = self.lent
        if lent is not None:
            if lent.params:
                lent.settle()  # this replay may overwrite pool memory lent as .grad
            if lent.deferred.held:
                lent.deferred.settle(self.fwd_seq)  # ... or owned gradients handed out
                if self._held_outputs:
                    # ... or this graph's own outputs, handed out by its last replay.
                    lent.deferred.settle_own(self._held_outputs)
        if self.owned_outputs and self._held_outputs is None:
            self._held_outputs, self._held_out_of = self._output_storages()
        copy_into(self.static_inputs, tensors)
        self.fwd_graph.replay()
        self.forward_replays += 1

    def _check_accumulates(self) -> None:
        """In-graph accumulation adds every parameter gradient into its ``.grad`` inside
        the backward graph: refuse a backward pass that adds into no ``.grad``
        (``torch.autograd.grad``, ``backward(inputs=...)`` without the parameters),
        which would otherwise change them all behind its back."""
        if self._anchor_accumulator is not None and not _engine_accumulates(
            self._anchor_accumulator
        ):
            raise CudaGraphsStateError(
                f"{self.name}: captured with accumulate_grads_in_graph=True, whose "
                "backward graph adds every parameter gradient into .grad itself, reached "
                "by a backward that adds into no parameter's .grad (torch.autograd.grad, "
                "or backward(inputs=...) without the parameters). Replayed, it would "
                "change .grad all the same. Fixes: 1. graph this module without "
                "accumulate_grads_in_graph for such uses; 2. run that backward through "
                "an eager copy"
            )

    def check_backward_of(self, forward: int) -> None:
        """Refuse the backward of forward replay number ``forward`` once a later forward
        replay of this entry has run: that one overwrote the static inputs and saved
        activations this backward reads, so its gradients would be another call's.

        Raises:
            CudaGraphsStateError: naming the entry, with the fixes.
        """
        if forward != self.forward_replays:
            later = self.forward_replays - forward
            raise CudaGraphsStateError(
                f"{self.name}: a backward reached a forward replay after {later} later "
                "forward replay(s) of the same graph, which overwrote the inputs and "
                "activations this backward reads (one module called twice in one step, "
                "or an evaluation call between a forward and its backward); its "
                "gradients would be wrong. Fixes: 1. run each call's backward before the "
                "next call of it; 2. graph one entry per use (a module per call site, or "
                "_order microbatches); 3. make the other calls on an eager copy"
            )

    def _check_chained(self, tensors: Any) -> None:
        # Before anything is copied: copying another tensor into a chained buffer would
        # overwrite the source's output, which the caller may still hold.
        problems = []
        for i, source in self.chained:
            t, buffer = tensors[i], self.static_inputs[i]
            if t.data_ptr() != buffer.data_ptr() or t.stride() != buffer.stride():
                path = self.paths[self.tensor_positions[i]]
                problems.append(
                    Mismatch(path, "chained input", f"the output of {source}", _describe(t))
                )
        if problems:
            raise ChainedInputError(
                describe_mismatches(
                    f"{self.name}: an input captured as another graph's output is not that output",
                    problems,
                    "The graph reads these inputs in place from the output of the graph "
                    "named, so pass that output itself (as the captured step did); "
                    "nothing was copied or replayed.",
                ),
                problems,
            )

    def unchain(self, index: int) -> None:
        """Make the chained static input ``index`` this entry's own buffer (its source
        was released): calls are copied into it from now on, and its bytes count in
        :attr:`buffer_bytes`."""
        if any(i == index for i, _ in self.chained):
            self.chained = tuple(c for c in self.chained if c[0] != index)
            buffer = self.static_inputs[index]
            self.buffer_bytes += buffer.numel() * buffer.element_size()

    def output_tensors(self) -> tuple[torch.Tensor, ...]:
        """What a forward replay hands out: detached views of the static outputs
        (autograd attaches its graph to these, never to the buffers). With
        ``owned_outputs`` held until a replay that could overwrite them moves out any
        still referenced, or copies where they cannot be held."""
        views = tuple(self.out_leaves[i].detach() for i in self.out_tensor_positions)
        if not self.owned_outputs:
            return views
        if not self._held_outputs:
            return tuple(v.clone() for v in views)
        repoint = not self.lent.deferred.exchange
        out = []
        for h, v in zip(self._held_out_of, views):
            if h is None or h.out_of_reach:
                out.append(v.clone())  # copied: small without the exchange, or once kept
            else:  # handed out as the static output
                if repoint:
                    h.hand(v)  # moves re-point what was handed out (deferred_grads)
                out.append(v)
        self.lent.deferred.hold([h for h in self._held_outputs if not h.out_of_reach])
        return tuple(out)

    @property
    def outputs_deferred(self) -> bool:
        """Whether owned outputs are handed out as the static outputs, any of them
        (decided at the first forward replay; ``False`` before it, and when all are
        copied)."""
        return any(not h.out_of_reach for h in self._held_outputs or ())

    def _output_storages(
        self,
    ) -> tuple[tuple[HeldStorage, ...], tuple[HeldStorage | None, ...]]:
        """The storages of the static tensor outputs to hand out (``()``: copy them at
        every replay: deferral is off, as for owned gradients (``defer_copies``), or
        something else refers to one), and the storage of each tensor output (``None``:
        copied at every replay, as are storages under
        :data:`~.deferred_grads.SMALL_OUTPUT_BYTES` without the storage exchange)."""
        outs = [self.out_leaves[i] for i in self.out_tensor_positions]
        held = None
        if self.lent is not None and self.defer_copies:
            held = held_storages(outs, self.fwd_seq, f"outputs of {self.name}", kind="output")
        if held and not self.lent.deferred.exchange:
            held = tuple(h for h in held if h.nbytes >= SMALL_OUTPUT_BYTES)
        if not held:
            return (), (None,) * len(outs)
        by_ptr = {h.storage.data_ptr(): h for h in held}
        return held, tuple(by_ptr.get(t.untyped_storage().data_ptr()) for t in outs)

    def output_tree(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for pos, t in zip(self.out_tensor_positions, tensors):
            leaves[pos] = t
        return pytree.tree_unflatten(leaves, self.out_spec)

    def _derive(self) -> None:
        """Precompute what each backward replay hands out (at construction, and again
        by :meth:`release` to drop the references to the buffers)."""
        self._grad_free_positions = tuple(
            i for i, (_, _, rg) in enumerate(self.input_meta) if not rg
        )
        n_user, n_diff = len(self.static_inputs), len(self.diff_input_positions)
        grads = self.static_grad_inputs
        if self.bwd_graph is None:
            n_diff, grads = 0, (None,) * len(self.params)
            self.diff_input_positions = ()
        self._input_grads = tuple(
            (pos, grads[k])
            for k, pos in enumerate(self.diff_input_positions)
            if grads[k] is not None
        )
        self._param_grad_slots = tuple(
            n_user + k for k in range(len(self.params)) if grads[n_diff + k] is not None
        )
        self._param_grad_buffers = [g for g in grads[n_diff:] if g is not None]
        self._param_grad_params = [p for p, g in zip(self.params, grads[n_diff:]) if g is not None]
        self._param_grad_ptrs = [g.data_ptr() for g in self._param_grad_buffers]
        # Lent mode lends parameters passed as inputs (read in place: the same
        # parameter every call) like the module's own: (position among the Function's
        # inputs, the parameter, its gradient buffer).
        pinned = {i: param for i, _, param in self.pinned}
        self._lent_inputs = (
            ()
            if self.clone_param_grads
            else tuple((pos, pinned[pos], g) for pos, g in self._input_grads if pos in pinned)
        )
        self._lent_input_params = [param for _, param, _ in self._lent_inputs]
        self._lent_input_ptrs = [g.data_ptr() for _, _, g in self._lent_inputs]
        self._lent_positions = frozenset(pos for pos, _, _ in self._lent_inputs)
        self._held = self._held_storages(grads)
        self._held_outputs, self._held_out_of = None, ()
        by_ptr = {h.storage.data_ptr(): h for h in self._held}
        self._held_of = tuple(
            by_ptr.get(g.untyped_storage().data_ptr()) for g in self._param_grad_buffers
        )
        # One parameter's gradient accumulator (held, so that autograd hands out this
        # very node every time) tells whether a backward accumulates into .grad
        # (backward()) or returns the gradients to the caller (autograd.grad()).
        lent_params = [*self._param_grad_params, *self._lent_input_params]
        self._probe_accumulator = (
            _grad_accumulator(lent_params[0])
            if lent_params and (not self.clone_param_grads or self._held)
            else None
        )
        # The parameters the autograd node takes as inputs. With in-graph accumulation
        # autograd gets no parameter gradient, so one parameter is enough: it keeps the
        # outputs differentiable when no user input requires grad, and the engine
        # tracks one edge instead of one per parameter.
        self.autograd_params = self.params if self.grad_targets is None else self.params[:1]
        # In-graph accumulation writes .grad inside the graph: its anchor's accumulator
        # tells whether the running backward adds into .grad at all (check_accumulates).
        self._anchor_accumulator = (
            _grad_accumulator(self.params[0])
            if self.grad_targets is not None and self.params and self.bwd_graph is not None
            else None
        )
        self._grad_output_buffers = [g for g in self.static_grad_outputs if g is not None]
        self._grad_output_mask = tuple(g is not None for g in self.static_grad_outputs)

    @property
    def held_storages(self) -> tuple[HeldStorage, ...]:
        """The storages its owned gradients are handed out from (``()``: copied at
        every replay, or lent)."""
        return self._held

    def _held_storages(self, grads: Sequence[torch.Tensor | None]) -> tuple[HeldStorage, ...]:
        """Owned mode with deferred copies: the storages of the parameter gradient
        buffers, with every gradient buffer on them; ``()`` where the copies are made
        at every replay (deferral off, or a buffer something else refers to)."""
        if not (
            self.clone_param_grads
            and self.defer_copies
            and self.lent is not None
            and self._param_grad_buffers
        ):
            return ()
        held = held_storages(
            [g for g in grads if g is not None],
            self.bwd_seq,
            f"parameter gradients of {self.name}",
        )
        if held is None:
            return ()
        owners: dict[int, list[torch.nn.Parameter]] = {}
        for p, g in zip(self._param_grad_params, self._param_grad_buffers):
            owners.setdefault(g.untyped_storage().data_ptr(), []).append(p)
        held = tuple(h for h in held if h.storage.data_ptr() in owners)
        for h in held:
            h.params = tuple(owners[h.storage.data_ptr()])
        return held

    def replay_backward(
        self, grads: tuple[torch.Tensor | None, ...], leaves: tuple[torch.Tensor | None, ...]
    ) -> list[torch.Tensor | None]:
        """Replay the backward graph; return one gradient per Function input
        (user tensors, then parameters). ``grads``: one per output, ``None`` for an
        output no gradient reached (:func:`stage_grad_outputs`). ``leaves`` holds each
        user input that is an autograd leaf (``None`` for the others)."""
        self.check_live()
        self.check_reached(grads)
        n_inputs = len(self.static_inputs) + len(self.autograd_params)
        result: list[torch.Tensor | None] = [None] * n_inputs
        if self.bwd_graph is None:
            return result
        if self.grad_targets is not None:
            self._check_accumulates()
            self.grad_targets.check_and_rebind()
        stage_grad_outputs(
            self._grad_output_buffers, [g for g, m in zip(grads, self._grad_output_mask) if m]
        )
        if not self.clone_param_grads and self._param_grad_buffers:
            # Lent mode, its own buffers: a .grad the last backward lent that still is one.
            move_aliased_grads(self._param_grad_params, self._param_grad_ptrs)
        if self._lent_inputs:
            move_aliased_grads(self._lent_input_params, self._lent_input_ptrs)
        if self.lent is not None and self.lent.deferred.held:
            # Owned gradients handed out by graphs captured after this one (their
            # memory may be this graph's temporaries), and by this one.
            self.lent.deferred.settle(self.bwd_seq)
            self.lent.deferred.settle_own(self._held)
        self.bwd_graph.replay()
        lend_inputs = bool(self._lent_inputs) and _engine_accumulates(self._probe_accumulator)
        if lend_inputs and self.lent is not None:
            self.lent.lend(self._lent_input_params, self._lent_input_ptrs)
        fresh = []
        for pos, g in self._input_grads:
            result[pos] = g.detach()
            if lend_inputs and pos in self._lent_positions:
                continue
            leaf = leaves[pos]
            # A leaf's gradient becomes its .grad when .grad is None, so it must not
            # alias a static buffer the next replay overwrites; when .grad exists,
            # AccumulateGrad adds into it and drops ours, so the view is enough.
            # Non-leaf inputs hand it to the producer's backward at once.
            if leaf is not None and leaf.grad is None:
                fresh.append(pos)
        if fresh:
            copies = torch._foreach_mul([result[p] for p in fresh], 1.0)  # one launch
            for pos, c in zip(fresh, copies):
                result[pos] = c
        if self._param_grad_buffers:
            self._hand_out_param_grads(result)
        return result

    def check_reached(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Raise :class:`~cudagraphs.errors.UncapturedGradientError` when a gradient
        reached an output captured as getting none (``unreached_outputs``), before
        anything is copied or replayed: the backward graph does not read it, so its
        gradient would be dropped."""
        reached = [i for i in self.unreached_outputs if grads[i] is not None]
        if not reached:
            return
        leaves = [self.out_tensor_positions[i] for i in reached]
        problems = [
            Mismatch(f"output[{i}] (leaf {leaf})", "gradient", None, "a tensor")
            for i, leaf in zip(reached, leaves)
        ]
        raise UncapturedGradientError(
            describe_mismatches(
                f"{self.name}: a backward pass gave a gradient to outputs captured as getting none",
                problems,
                "Its backward graph was captured without them (for partial graphs: the "
                "recorded step's backward did not reach them), so their gradient would "
                "be dropped. Fix: record a step whose loss uses these outputs and "
                "capture again. The forward of this call replayed and is correct.",
            ),
            problems,
        )

    def _hand_out_param_grads(self, result: list[torch.Tensor | None]) -> None:
        """Give autograd owned copies of the parameter gradients, made by one fused
        kernel (the default, Transformer Engine 2.20's contract: a gradient a hook or
        ``.grad`` keeps is never overwritten by a later replay); in lent mode, the
        buffers themselves (see ``lent_grads``), except under ``autograd.grad()``.
        Owned with deferred copies: the buffers too, held until nothing refers to them
        or a replay that could overwrite them moves them out (``deferred_grads``)."""
        accumulates = self._probe_accumulator is not None and _engine_accumulates(
            self._probe_accumulator
        )
        if self._held and accumulates:
            views = [g.detach() for g in self._param_grad_buffers]
            if not self.lent.deferred.exchange:
                # Moves re-point what was handed out (deferred_grads), so note it.
                for h, v in zip(self._held_of, views):
                    if h is not None:
                        h.hand(v)
            self.lent.deferred.hold(self._held)
        elif self.clone_param_grads or not accumulates:
            # autograd.grad() returns the gradients to its caller instead of adding
            # them into .grad, so no later replay could move them out of the way.
            # x * 1.0 is exact (signed zeros and NaNs included) and makes every copy in
            # one multi-tensor launch. (One torch.cat per dtype, handing out views of it,
            # measured slower on the H200: 1.12x to 1.23x torch's helper at dbefc20,
            # where this gave 1.05x to 1.07x at fed82b5; train_step results.)
            views = list(torch._foreach_mul([g.detach() for g in self._param_grad_buffers], 1.0))
        else:
            views = [g.detach() for g in self._param_grad_buffers]
            if self.lent is not None:
                self.lent.lend(self._param_grad_params, self._param_grad_ptrs)
        for pos, g in zip(self._param_grad_slots, views):
            result[pos] = g

    def static_tensors(self) -> list[torch.Tensor]:
        """The static buffers this entry's graphs read and write across replays: inputs,
        tensor outputs, incoming gradients and the gradients of differentiable inputs
        (parameters passed as inputs, read in place, and all parameter gradients
        excluded: eager holds those too). Views of shared buffers appear once per
        entry; :func:`~cudagraphs.memory.tensor_bytes` counts each storage once."""
        params = {i for i, _, _ in self.pinned}
        inputs = [t for i, t in enumerate(self.static_inputs) if i not in params]
        outs = [self.out_leaves[i] for i in self.out_tensor_positions]
        grads = [
            g for i, g in zip(self.diff_input_positions, self.static_grad_inputs) if i not in params
        ]
        found = [*inputs, *outs, *self.static_grad_outputs, *grads]
        return [t for t in found if isinstance(t, torch.Tensor)]

    def release(self) -> None:
        """Drop the graphs and static buffers (idempotent)."""
        if self.released:
            return
        if self._held:
            # What is still kept leaves the pool memory before the graphs' references
            # to it go; graphs still in the pool could overwrite it.
            self.lent.deferred.settle_own(self._held)
        if self._held_outputs:
            self.lent.deferred.settle_own(self._held_outputs)
        for g in (self.fwd_graph, self.bwd_graph):
            if g is not None:
                g.reset()
        self.fwd_graph = self.bwd_graph = None
        for graphs, index in self.dependents:
            graphs.unchain(index)
        self.dependents = []
        self.grad_targets = None
        self.static_inputs = []
        self.pinned = ()
        self.untracked_params = ()
        self.out_leaves = []
        self.static_grad_outputs = []
        self.static_grad_inputs = ()
        self._derive()  # drops the precomputed references to the buffers
        self._held_outputs = ()
        self.released = True


def _grad_accumulator(param: torch.nn.Parameter) -> Any:
    """The autograd node that adds into ``param.grad`` (a view's first edge)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


def _engine_accumulates(accumulator: Any) -> bool:
    """Whether the running backward pass adds into ``.grad`` (``backward()``), as
    opposed to returning gradients to its caller (``autograd.grad()``)."""
    try:
        return will_engine_execute_node(accumulator)
    except RuntimeError:
        # torch refuses the question for an accumulator under autograd.grad().
        return False


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} {tuple(value.shape)} {value.dtype} at {value.data_ptr():#x}"
    return type(value).__name__


def _same_constant(got: Any, want: Any) -> bool:
    """Whether a call's non-tensor leaf is the captured one: equal, NaN to NaN, and an
    array (numpy) equal element by element with the same shape; a comparison that
    fails or says nothing clear is a difference, never an error of its own."""
    if got is want:
        return True
    if isinstance(got, float) and isinstance(want, float) and got != got and want != want:
        return True  # NaN, as captured
    try:
        same = got == want
        if isinstance(same, bool):
            return same
        if getattr(got, "shape", None) != getattr(want, "shape", None):
            return False
        every = getattr(same, "all", None)
        return bool(every()) if callable(every) else bool(same)
    except Exception:  # an object whose == raises or gives no truth value
        return False
