"""transformers' choice of attention mask while a CUDA graph is captured.

Without padding, transformers' mask functions (``transformers.masking_utils``) return
no mask, and SDPA applies causality itself (``is_causal=True``). Before they skip the
mask they ask ``is_tracing(tensor)`` (``transformers.utils.import_utils``), which is
true while the current CUDA stream captures: under capture no tensor's values can be
read on the host. transformers 5.17 asks even where there is nothing to read:
``_ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa`` and
``_can_skip_bidirectional_mask_xpu`` call ``is_tracing(padding_mask)`` with
``padding_mask=None``. So every captured forward builds the explicit 4D mask, and
``sdpa_attention_forward`` passes it with ``is_causal=False``; with fewer key/value
heads than query heads it also repeats the keys and values (``repeat_kv``) instead of
``enable_gqa=True``, since SDPA's GQA path takes no mask. Eager and graph then run
different attention kernels and drift apart in the last bits. transformers fixed the
three helpers upstream (issue 48925, PR 48975; in 5.24.0, not in 5.17.0): they decline
only when a padding mask would have to be read.

:func:`eager_mask_choice` gives the installed transformers that rule for as long as it
is open: while the current stream captures (and nothing compiles), the ``is_tracing``
of ``transformers.masking_utils`` answers ``torch.jit.is_tracing()`` when called without
a tensor, so the decision is made from shapes, as eagerly. A call with a tensor still
answers true, and is recorded: there transformers declines a check it makes eagerly on
the values (padding in the attention mask, packed sequences in ``position_ids``) and
builds the mask, which is correct for every batch but may not be eager's attention path.

It does NOT: import transformers (nothing is changed where ``transformers.masking_utils``
was not imported), change any answer outside a capture or under ``torch.compile`` /
``torch.jit`` (so eager results are untouched), or make a data-dependent choice under
capture (the graph keeps the explicit mask wherever eager would have looked at values).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

__all__ = ["MASKING_MODULE", "MaskChoices", "eager_mask_choice", "unread_masks_warning"]

#: The transformers module whose ``is_tracing`` :func:`eager_mask_choice` replaces.
MASKING_MODULE = "transformers.masking_utils"

# What the masking_utils function that asked is_tracing(tensor) would have read.
_PADDING = "the attention mask's values, for padding"
_READS = {
    "_ignore_causal_mask_sdpa": _PADDING,
    "_ignore_bidirectional_mask_sdpa": _PADDING,
    "_can_skip_bidirectional_mask_xpu": _PADDING,
    "create_recurrent_attention_mask": _PADDING,
    "find_packed_sequence_indices": "position_ids, for packed sequences",
}
_PACKED = "find_packed_sequence_indices"

# Installing and removing the wrapper is shared by every open scope of the process.
_LOCK = threading.Lock()
_STATE = "__cudagraphs_mask_choice__"


@dataclass(eq=False)
class MaskChoices:
    """What transformers could not read under capture while one :func:`eager_mask_choice`
    was open.

    Attributes:
        unread: one line per distinct check, ``"<masking_utils function>: <what it
            reads>"``, in the order first seen; empty when every mask decision under
            capture was eager's.
    """

    unread: list[str] = field(default_factory=list)

    def note(self, caller: str) -> None:
        line = f"{caller}: {_READS.get(caller, 'a tensor')}"
        if line not in self.unread:
            self.unread.append(line)


@dataclass(eq=False)
class _Installed:
    """The wrapper in ``module.is_tracing`` and the scopes it records for."""

    module: ModuleType
    original: Callable[..., bool]
    wrapper: Callable[..., bool] | None = None
    open: list[MaskChoices] = field(default_factory=list)


def _stream_capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only torch build: its CUDA bindings are stubs that raise
        return False


def _capture_aware(state: _Installed) -> Callable[..., bool]:
    original = state.original

    def is_tracing(tensor=None) -> bool:
        # torch.compiler.is_compiling() is constant under dynamo, so a compiled model
        # traces only the first branch and keeps transformers' own answer.
        if torch.compiler.is_compiling() or not _stream_capturing():
            return original(tensor)
        if tensor is None:
            # Nothing to read: stream capture is no reason to decline (PR 48975's rule).
            return torch.jit.is_tracing()
        traced = original(tensor)
        if traced:
            caller = sys._getframe(1).f_code.co_name
            for choices in tuple(state.open):
                choices.note(caller)
        return traced

    setattr(is_tracing, _STATE, state)
    return is_tracing


def _install(module: ModuleType) -> _Installed:
    current = module.is_tracing
    state = getattr(current, _STATE, None)
    if state is None:
        state = _Installed(module, current)
        state.wrapper = _capture_aware(state)
        module.is_tracing = state.wrapper
    return state


def _remove(state: _Installed, choices: MaskChoices) -> None:
    state.open.remove(choices)
    # Someone who replaced is_tracing after us (a test's monkeypatch) keeps theirs.
    if not state.open and state.module.is_tracing is state.wrapper:
        state.module.is_tracing = state.original


@contextlib.contextmanager
def eager_mask_choice() -> Iterator[MaskChoices]:
    """Let transformers choose attention masks under capture as it does eagerly, where
    that choice reads no tensor (see the module docs); record where it cannot.

    Open it around the warmup and the capture both: a ``torch.compile``d model guards on
    the function it called, and then sees the same one in both. Scopes nest and may be
    open in several threads; the last one to close puts the original back.

    Yields:
        A :class:`MaskChoices`, filled while the scope is open (by captures in any
        thread of the process while it is).
    """
    choices = MaskChoices()
    module = sys.modules.get(MASKING_MODULE)
    if module is None or not callable(getattr(module, "is_tracing", None)):
        yield choices
        return
    with _LOCK:
        state = _install(module)
        state.open.append(choices)
    try:
        yield choices
    finally:
        with _LOCK:
            _remove(state, choices)


def unread_masks_warning(what: str, unread: Sequence[str]) -> str | None:
    """The warning for a capture in which transformers built an explicit mask (``None``
    when ``unread`` is empty): what it could not read and how to get eager's path."""
    if not unread:
        return None
    fixes = []
    if any(not line.startswith(_PACKED) for line in unread):
        fixes.append("call the model without attention_mask when no batch has padding")
    if any(line.startswith(_PACKED) for line in unread):
        fixes.append(
            "leave the model's cache on (do not pass use_cache=False): without a cache "
            "transformers checks position_ids for packed sequences, which it cannot read "
            "under capture"
        )
    numbered = "; ".join(f"{i}. {fix}" for i, fix in enumerate(fixes, 1))
    reads = "; ".join(
        f"{read} (masking_utils.{caller})"
        for caller, _, read in (line.partition(": ") for line in unread)
    )
    return (
        f"{what}: under capture transformers could not read {reads}, so the "
        "graph builds an explicit attention mask, where an eager step on a batch without "
        "padding passes none and lets SDPA apply causality (is_causal=True). The graph is "
        "correct for every batch, but SDPA may run another kernel, so losses and "
        "parameters can differ from the eager loop's in the last bits. For a step equal "
        f"to eager bit for bit: {numbered}."
    )
