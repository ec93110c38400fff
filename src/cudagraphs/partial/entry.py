"""One partial-graph target at run time: its recorded variants, their graphs, and the
dispatch that replays a matching call or runs the module eagerly, counted, with the
first eager run of each reason said at WARNING (see :mod:`.manager`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..core.graphed import GraphedCallable
from ..diagnostics import WarnOnce
from ..errors import ChainedInputError, CudaGraphInputError, describe_mismatches
from ..forward_swap import ForwardSwap
from .contract import CallContract, ContractSet, FallbackCounter, flatten_call
from .recording import is_inference_call
from .vocabulary import Target

__all__ = ["PartialGraphEntry"]

# The manager's logger: users filter partial-graph messages under one name.
logger = logging.getLogger("cudagraphs.partial.manager")


def _detached_clone(value: Any) -> Any:
    """A sample of a recorded argument: same metadata, its own storage, no history."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def _copied(out: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, torch.clone, out)


_CONTRACT_FIX = (
    "Fixes: 1. record these inputs as another variant: start_recording(), run one step, "
    "capture() (at most max_variants={n} per target); 2. make the calls match the "
    "recorded one (pad to a recorded shape; same dtypes, grad mode and train/eval "
    "mode); 3. nothing: the eager run is correct, only not graphed."
)


_INFERENCE_FIX = (
    "This is an evaluation-style call (torch.no_grad() or eval mode); to graph such "
    "calls, build the manager with inference_calls='record' and let one run while "
    "recording. "
)


_INNER = "inner"


class _ForwardOnly(nn.Module):
    """Runs a target's ``forward`` without the target's own module hooks.

    Why: at replay the real call goes through the target's ``__call__``, whose hooks
    run there, around the dispatching forward, once. Graphing them as well would run
    them twice, and FSDP2's are wrong to graph: when the target is itself a
    ``fully_shard`` unit, its pre-forward hook unshards and installs its own unsharded
    parameters over the ones ``functional_call`` binds, so the graph would not read
    its parameter inputs. Holding the target as a child keeps its parameters
    addressable (``inner.<name>``) for ``functional_call``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        setattr(self, _INNER, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, _INNER).forward(*args, **kwargs)


@dataclass
class RecordedVariant:
    """One recorded call of a target (a variant): the samples its capture needs, and
    its graph once captured. The samples are dropped after capture (the graph holds
    inputs of its own); until then a failed capture can be retried from them."""

    args: tuple | None
    kwargs: dict | None
    # Under FSDP2 (see .fsdp) the recorded values of the unsharded parameters, which
    # the graph copies in at each call; empty otherwise.
    params: tuple[torch.Tensor, ...] = ()
    graph: Any = None
    # The graph's replay from the call's tensors alone (GraphedCallable.replay_checked),
    # when the graph flattens its call exactly as the contract does behind the
    # parameters: the call is then flattened and checked once, by the contract.
    replay_checked: Callable[[list], Any] | None = None
    # While recording: tensor input index -> (target, variant, tensor output index)
    # for the inputs that were another target's output in every recorded call
    # (.chaining); None before the first.
    chained: dict[int, tuple[Any, int, int]] | None = None

    def captured(self, graph: Any, params: tuple[torch.Tensor, ...]) -> None:
        """Hold ``graph``, captured from this variant's samples with ``params`` passed
        first; drop the samples."""
        self.graph = graph
        self.replay_checked = _checked_replay(graph, params, self.args, self.kwargs)
        self.args = self.kwargs = None
        self.params = ()
        self.chained = None


def _checked_replay(
    graph: Any, params: tuple[torch.Tensor, ...], args: tuple | None, kwargs: dict | None
) -> Callable[[list], Any] | None:
    # Only the core's graphs offer it (a capture backend of the user's, or the eager one
    # under CUDAGRAPHS_DISABLE, is called with the arguments). The tensors the contract
    # returns follow the parameters in the graph's order exactly when the graph's input
    # spec is that of (params, *args) with these keywords: checked once, here.
    if not isinstance(graph, GraphedCallable) or graph.graphs.eager_only or args is None:
        return None
    if graph.graphs.in_spec != flatten_call((tuple(params), *args), kwargs or {})[1]:
        return None
    return graph.replay_checked


@dataclass
class PartialGraphEntry:
    """One target: its recorded variants (``variants[i]`` records the call of
    ``contracts.variants[i]``, the matcher's view of it), counters and hooks."""

    target: Target
    contracts: ContractSet
    counter: FallbackCounter = field(default_factory=FallbackCounter)
    variants: list[RecordedVariant] = field(default_factory=list)
    param_names: tuple[str, ...] = ()
    params: tuple[nn.Parameter, ...] = ()
    # Under FSDP2 (see .fsdp): parameters are fetched at each call and copied into the
    # graph rather than read in place.
    fsdp: bool = False
    # The target's forward replaced by dispatch (from the first capture to close()).
    swap: ForwardSwap | None = None
    # Why the target runs eagerly for good (a graph measured slower than eager, see
    # .speed); None while it is graphed or graphable.
    off_reason: str | None = None
    recorder: Any = None  # the recording hook's handle while recording
    # While recording: calls recorded, the forward of the model the last one belonged
    # to, and whether a call was seen again within one forward (a real reuse, refused by
    # capture()).
    recorded_calls: int = 0
    last_forward: int | None = None
    repeated: bool = False
    bypass: bool = False  # set while the graphed adapter itself runs the module
    # The owning manager's once-per-cause warnings (set by the manager).
    warn_once: WarnOnce | None = None

    @property
    def name(self) -> str:
        """The target's qualified name; a whole model part (named ``""``) by its class."""
        return self.target.name or type(self.target.module).__name__

    @property
    def original_forward(self) -> Callable[..., Any]:
        """The module's own forward (what an eager run calls)."""
        return self.swap.original if self.swap is not None else self.target.module.forward

    def begin_recording(self) -> None:
        # No calls recorded: record() sets last_forward before it reads it.
        self.recorded_calls = 0
        self.repeated = False

    def record(self, args: tuple, kwargs: dict, forward: int | None) -> int | None:
        """Record one call made within the model's forward number ``forward``; return
        the index of its variant (``None`` when it was not recorded).

        ``forward`` is ``None`` when forwards cannot be told apart (a manager built
        without its model parts): then any second call counts as a repeat. A repeat
        within one forward is only noted here; capture() refuses it, naming the
        target. Calls from different forwards (micro-batches of one step, gradient
        accumulation) are recorded: an identical contract adds nothing, a new one is
        another variant, up to ``max_variants``.
        """
        if self.recorded_calls and (forward is None or forward == self.last_forward):
            self.repeated = True
            return None
        self.recorded_calls += 1
        self.last_forward = forward
        contract = CallContract.from_call(args, kwargs, training=self.target.module.training)
        index = self.contracts.add(contract)
        if index is None:
            self._warn(
                "variants_full",
                "partial graphs: %s already has max_variants=%d recorded variants; this "
                "new call is not recorded and will run eagerly. Fix: pass a larger "
                "max_variants to from_model_parts, or keep fewer distinct input shapes. "
                "Later refusals (any target) are not logged again.",
                self.name,
                self.contracts.max_variants,
            )
        elif index == len(self.variants):
            self.variants.append(
                RecordedVariant(
                    args=tuple(_detached_clone(a) for a in args),
                    kwargs={k: _detached_clone(v) for k, v in kwargs.items()},
                    # Plain tensors, not parameters: the graph copies these per call.
                    params=tuple(_detached_clone(p) for p in self.call_params())
                    if self.fsdp
                    else (),
                )
            )
        return index

    def call_params(self) -> tuple[nn.Parameter, ...]:
        """The parameters to pass to the graph now: fixed ones, or under FSDP2 the
        module's current (unsharded, inside forward) parameters."""
        if not self.fsdp:
            return self.params
        module = self.target.module
        return tuple(module.get_parameter(name) for name in self.param_names)

    def capture_params(self, variant: int) -> tuple[torch.Tensor, ...]:
        """The parameter samples to capture ``variant`` with."""
        return self.variants[variant].params if self.fsdp else self.params

    def turn_off(self, reason: str) -> None:
        """Run the module's own forward from now on: forward restored, graphs released
        (recording and capture skip the target from then on)."""
        if self.swap is not None:
            self.swap.restore()
            self.swap = None
        self.release_graphs()
        self.off_reason = reason

    def release_graphs(self) -> None:
        """Reset every graph held (a graph with a ``reset`` releases its memory) and
        forget the variants' graphs and samples."""
        for g in self.graphs():
            reset = getattr(g, "reset", None)
            if reset is not None:
                reset()
        for v in self.variants:
            v.graph = v.args = v.kwargs = None
            v.params = ()

    def graphs(self) -> list[Any]:
        """The graphs held, one per captured variant."""
        return [v.graph for v in self.variants if v.graph is not None]

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """The target's forward while graphs exist: replay or fall back, counted.

        A fallback runs the module's own forward. Its reason is counted (``stats()``)
        and, the first time the manager sees that reason, logged at WARNING.
        """
        if self.bypass:
            return self.original_forward(*args, **kwargs)
        index, reason, tensors = self.contracts.match(
            args, kwargs, training=self.target.module.training
        )
        variant = self.variants[index] if index is not None else None
        graph = variant.graph if variant is not None else None
        if graph is not None:
            try:
                if variant.replay_checked is not None:
                    out = variant.replay_checked([*self.call_params(), *tensors])
                else:
                    out = graph(self.call_params(), *args, **kwargs)
            except ChainedInputError as exc:
                # An input read in place from another target's output got another
                # tensor (that target ran eagerly, say); checked before any copy.
                self._fall_back("unchained_input", args, kwargs, exc)
                return self.original_forward(*args, **kwargs)
            except CudaGraphInputError as exc:
                # The contract matched, so only the parameters can differ: one was
                # replaced or re-allocated since capture (checked before any replay).
                self._fall_back("param_storage", args, kwargs, exc)
                return self.original_forward(*args, **kwargs)
            self.counter.replay()
            # A whole part's outputs reach the caller's code (loss, logits), which may
            # keep them past the next call: hand back copies, not the static buffers.
            return _copied(out) if self.target.kind == "model" else out
        self._fall_back(reason or "not_captured", args, kwargs, index)
        return self.original_forward(*args, **kwargs)

    def _fall_back(self, reason: str, args: tuple, kwargs: dict, detail: Any) -> None:
        self.counter.fallback(reason)
        # One set lookup per fallback; the report is built only the first time.
        if self.warn_once is not None and not self.warn_once.said(reason):
            try:
                report = self._fallback_report(reason, args, kwargs, detail)
            except Exception as exc:  # a report (a control's repr, say) must not break a step
                report = (
                    f"partial graphs: {self.name} ran eagerly (reason {reason!r}); its "
                    f"mismatch report failed ({type(exc).__name__}: {exc}). Later eager "
                    f"runs for this reason are counted in stats()['fallback_{reason}']."
                )
            self._warn(reason, "%s", report)

    def _fallback_report(self, reason: str, args: tuple, kwargs: dict, detail: Any) -> str:
        head = f"partial graphs: {self.name} ran eagerly (reason {reason!r})"
        if reason == "param_storage":
            body = (
                f"{head}: a parameter was replaced or re-allocated since capture, and the "
                f"graph reads parameters in place.\n{detail}\nFixes: 1. change parameters "
                "in place (copy_, load_state_dict) rather than assigning .data or new "
                "Parameters; 2. build a new manager and capture again after the change."
            )
        elif reason == "unchained_input":
            body = (
                f"{head}: its graph reads an input in place from another target's graph "
                f"output (no copy), and this call passed another tensor there, usually "
                f"because that target ran eagerly for this call.\n{detail}\nFix: none "
                "needed, the eager run is correct; remove the first target's own "
                "fallback to graph both again."
            )
        elif reason == "not_captured":
            body = (
                f"{head}: the call matches variant {detail}, which was recorded but not "
                "captured yet (expected during a recording step). Fix: call capture() "
                "after the recording step."
            )
        else:
            mismatches = self.contracts.mismatches(
                args, kwargs, training=self.target.module.training
            )
            fix = _CONTRACT_FIX.format(n=self.contracts.max_variants)
            if is_inference_call(self.target.module):
                fix = _INFERENCE_FIX + fix
            body = describe_mismatches(
                f"{head}: the call differs from its first recorded variant", mismatches, fix
            )
        return (
            f"{body}\nLater eager runs for this reason (this or any other target) are not "
            f"logged again; stats()['fallback_{reason}'] counts them all."
        )

    def _warn(self, cause: str, message: str, *args: Any) -> None:
        if self.warn_once is not None:
            self.warn_once(cause, message, *args)
        else:  # an entry used outside a manager
            logger.warning(message, *args)

    def adapter(self) -> Callable[..., Any]:
        """The function graphed for this target: parameters first, as explicit inputs,
        then the recorded call. It runs the module with those tensors bound in place of
        its parameters, so the graph reads its inputs rather than captured state."""
        wrapper = _ForwardOnly(self.target.module)
        names = [f"{_INNER}.{n}" for n in self.param_names]

        def run(params: tuple, *args: Any, **kwargs: Any) -> Any:
            self.bypass = True
            try:
                return torch.func.functional_call(wrapper, dict(zip(names, params)), args, kwargs)
            finally:
                self.bypass = False

        run.__qualname__ = f"partial[{self.name}]"
        return run
