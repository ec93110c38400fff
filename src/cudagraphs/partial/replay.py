"""The replay phase: one target's dispatching forward, from its first capture to
``close()``.

:class:`TargetDispatcher` stands in for the target module's ``forward``. A call that
matches a recorded contract (:class:`~.contract.ContractSet`) whose variant holds a
graph replays that graph; any other call runs the module's own forward, counted per
reason (:data:`~.vocabulary.FALLBACK`) and, the first time the manager sees a reason,
said at WARNING with the call's mismatch report and the fixes. Which graph to replay,
and the graph itself, come from the target's :class:`~.recording.TargetRecording`
(borrowed); the dispatcher owns the counter and the swapped ``forward``.

What this module does NOT do: it records nothing and captures nothing, and it decides
nothing about which targets are graphed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core.graphed import GraphedCallable
from ..diagnostics import WarnOnce
from ..errors import (
    ChainedInputError,
    CudaGraphInputError,
    KeptOutputViewError,
    describe_mismatches,
)
from ..forward_swap import ForwardSwap, swap_forward
from .contract import FallbackCounter
from .recording import TargetRecording, is_inference_call
from .vocabulary import MODEL_KIND, OffReason, Target

__all__ = ["PartialGraphEntry", "TargetDispatcher", "dispatch_paused", "owns_outputs"]

# The manager's logger: users filter partial-graph messages under one name.
logger = logging.getLogger("cudagraphs.partial.manager")


def _copied(out: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, torch.clone, out)


def owns_outputs(graph: Any) -> bool:
    """Whether ``graph`` hands out outputs its caller owns (the core's
    ``owned_outputs``: kept ones are moved out of the way of later replays), so that
    a whole model part's outputs need no copy here."""
    return isinstance(graph, GraphedCallable) and graph.graphs.owned_outputs


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


class TargetDispatcher:
    """The forward of one graphed target: replay a matching call, or run the module's
    own forward, counted.

    Workflow (driven by the manager):

    1. made around the target's :class:`~.recording.TargetRecording`, not installed;
    2. :meth:`install` after a capture that gave the target a graph: the module's
       ``forward`` is this dispatcher from then on;
    3. each call: :meth:`__call__`;
    4. :meth:`restore` when the target is turned off (:meth:`turn_off` does both),
       and at ``close()``.

    ``passthrough`` makes every call run the module's own forward, uncounted: the
    manager sets it while it captures (the capture runs the targets' forwards), and
    the dispatcher sets it while a graph that is a plain callable runs (the eager
    stand-in under ``CUDAGRAPHS_DISABLE``, or a user's backend), which calls the
    module's ``forward`` again.

    ``PartialGraphEntry`` is this class's former name, kept as a deprecated alias for
    one release.

    Args:
        recording: the target's recording store (borrowed).
        warn_once: the owning manager's once-per-cause warnings; ``None`` logs every
            warning on the manager's logger.
    """

    def __init__(self, recording: TargetRecording, warn_once: WarnOnce | None = None) -> None:
        self.recording = recording
        self.counter = FallbackCounter()
        self.warn_once = warn_once
        # The target's forward replaced by this dispatcher (from install() to restore()).
        self.swap: ForwardSwap | None = None
        self.passthrough = False

    @property
    def target(self) -> Target:
        """The target dispatched for."""
        return self.recording.target

    @property
    def name(self) -> str:
        """The target's name (see :attr:`.TargetRecording.name`)."""
        return self.recording.name

    @property
    def original_forward(self) -> Callable[..., Any]:
        """The module's own forward (what an eager run calls)."""
        return self.swap.original if self.swap is not None else self.target.module.forward

    def install(self) -> None:
        """Make this dispatcher the module's ``forward`` (idempotent)."""
        if self.swap is None:
            self.swap = swap_forward(self.target.module, self)

    def restore(self) -> None:
        """Give the module its own ``forward`` back (idempotent)."""
        if self.swap is not None:
            self.swap.restore()
            self.swap = None

    def turn_off(self, reason: OffReason) -> None:
        """Take the target out for good now: its own forward back, its recording
        turned off (:meth:`.TargetRecording.turn_off`: graphs released, counted as
        ``off_<reason>``)."""
        self.restore()
        self.recording.turn_off(reason)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The target's forward while installed: replay or fall back, counted.

        A fallback runs the module's own forward. Its reason is counted (``stats()``)
        and, the first time the manager sees that reason, logged at WARNING.
        """
        if self.passthrough:
            return self.original_forward(*args, **kwargs)
        rec = self.recording
        index, reason, tensors = rec.contracts.match(
            args, kwargs, training=self.target.module.training
        )
        variant = rec.variants[index] if index is not None else None
        graph = variant.graph if variant is not None else None
        if graph is None:
            self._fall_back(reason or "not_captured", args, kwargs, index)
            return self.original_forward(*args, **kwargs)
        failed: tuple[str, Exception] | None = None
        # A graph that is a plain callable runs the module's forward, this dispatcher.
        self.passthrough = True
        try:
            if variant.replay_checked is not None:
                out = variant.replay_checked([*rec.call_params(), *tensors])
            else:
                out = graph(rec.call_params(), *args, **kwargs)
        except ChainedInputError as exc:
            # An input read in place from another target's output got another
            # tensor (that target ran eagerly, say); checked before any copy.
            failed = ("unchained_input", exc)
        except CudaGraphInputError as exc:
            # The contract matched, so only the parameters can differ: one was
            # replaced or re-allocated since capture (checked before any replay).
            failed = ("param_storage", exc)
        except KeptOutputViewError as exc:
            # The last replay's outputs are still referenced where this torch cannot
            # move them (checked before the replay): the eager run leaves them intact.
            failed = ("kept_output", exc)
        finally:
            self.passthrough = False
        if failed is not None:
            self._fall_back(failed[0], args, kwargs, failed[1])
            return self.original_forward(*args, **kwargs)
        self.counter.replay()
        # A whole part's outputs reach the caller's code (loss, logits), which may
        # keep them past the next call: the core's graphs hand them out owned (moved
        # out of the way of the next replay only if still kept); any other graph's
        # are copied here.
        if self.target.kind == MODEL_KIND and not owns_outputs(graph):
            return _copied(out)
        return out

    def _fall_back(self, reason: str, args: tuple, kwargs: dict, detail: Any) -> None:
        self.counter.fallback(reason)
        # One set lookup per fallback; under a manager the report is built only the
        # first time, and a dispatcher of its own reports every fallback.
        if self.warn_once is None or not self.warn_once.said(reason):
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
        contracts = self.recording.contracts
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
        elif reason == "kept_output":
            body = (
                f"{head}: an output its last replay handed out (graph memory, which this "
                f"replay would overwrite) is still referenced by a tensor that torch "
                f"{torch.__version__} cannot move.\n{detail}\nFixes: 1. keep a .clone() "
                "of the output instead of a view or .detach() of it; 2. use a torch "
                "with UntypedStorage._swap_data_ptr_ (2.13 has it). That output is "
                "copied at every replay from now on, and the graph replays again once "
                "that tensor is dropped."
            )
        elif reason == "not_captured":
            body = (
                f"{head}: the call matches variant {detail}, which was recorded but not "
                "captured yet (expected during a recording step). Fix: call capture() "
                "after the recording step."
            )
        else:
            mismatches = contracts.mismatches(args, kwargs, training=self.target.module.training)
            fix = _CONTRACT_FIX.format(n=contracts.max_variants)
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
        else:  # a dispatcher used outside a manager
            logger.warning(message, *args)


#: Deprecated: the former name of :class:`TargetDispatcher`, kept for one release.
PartialGraphEntry = TargetDispatcher


@contextmanager
def dispatch_paused(dispatchers: Sequence[TargetDispatcher]) -> Iterator[None]:
    """While the block runs, every call of these targets runs the module's own forward
    uncounted (a capture and its speed check run the targets' forwards); restored
    after, whatever happens."""
    for d in dispatchers:
        d.passthrough = True
    try:
        yield
    finally:
        for d in dispatchers:
            d.passthrough = False
