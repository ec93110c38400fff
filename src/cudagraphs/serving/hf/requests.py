"""One generate request, checked and laid out for a static cache. Pure policy, tested on
the CPU.

A request is a batch of prompts padded on the left to one length ``P`` (what HF
tokenizers give with ``padding_side="left"``), with an attention mask marking the real
tokens. Every row then writes its cache at the same positions (``P``, ``P+1``, ...), so
one write position serves the whole batch and a decode step is the same graph for every
request; the mask hides each row's padding, and positions count real tokens only (HF's
rule: the running count of the mask, minus one, and 0 on padding).

Vocabulary: ``prompt_len`` is ``P``; ``max_cache_len`` is the cache's length in
positions; a request needs ``P + max_new_tokens - 1`` positions (the last token is
returned, never fed back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...checks import check_int
from ...errors import (
    CudaGraphInputError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    Mismatch,
    describe_mismatches,
)

__all__ = ["Request", "check_request", "inferred_mask", "positions_from_mask", "token_ids"]


@dataclass(frozen=True)
class Request:
    """A checked request: prompts ``[batch, prompt_len]`` and their 0/1 mask (bool), on
    the model's device, and the number of new tokens asked for."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def positions_needed(self) -> int:
        """Cache positions the request writes: the prompt and every fed-back token."""
        return self.prompt_len + self.max_new_tokens - 1


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as HF's ``generate`` makes them: the running
    count of real tokens minus one, and 0 on padding."""
    mask = mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def check_request(
    input_ids: Any,
    attention_mask: Any,
    max_new_tokens: Any,
    max_cache_len: int,
    device: torch.device,
    vocab_size: int | None = None,
) -> Request:
    """Check a request and move it to ``device``.

    Reads the mask on the host once (a sync per request, not per token) to check that
    padding is on the left and every row has a real token.

    Raises:
        CudaGraphsTypeError: ``input_ids`` or ``attention_mask`` not tensors, ids not of
            an integer dtype, ``max_new_tokens`` not an int.
        CudaGraphsValueError: ``max_new_tokens`` below 1, an empty batch or prompt, ids
            outside ``[0, vocab_size)`` (the embedding would index out of range: on a GPU
            a device-side assert, after which the process's CUDA context is lost), or a
            request that needs more positions than the cache holds (naming both).
        CudaGraphInputError: a mask of another shape than the ids, with values other
            than 0 and 1, with padding on the right, or a row without any real token
            (every problem found, by row).
    """
    new = check_int("max_new_tokens", max_new_tokens, minimum=1)
    ids = token_ids(input_ids)
    if vocab_size is not None:
        _check_in_vocabulary(ids, vocab_size)
    batch, prompt_len = ids.shape
    if attention_mask is None:
        mask = torch.ones(batch, prompt_len, dtype=torch.bool, device=device)
    else:
        mask = _checked_mask(attention_mask, ids)
    needed = prompt_len + new - 1
    if needed > max_cache_len:
        raise CudaGraphsValueError(
            f"the request needs {needed} cache positions (prompt of {prompt_len} tokens + "
            f"{new} new tokens - 1) but the cache holds max_cache_len={max_cache_len}. "
            "Fixes: 1. ask for fewer new tokens or a shorter prompt; 2. build the "
            f"generator with max_cache_len >= {needed}."
        )
    return Request(ids.to(device), mask.to(device=device, dtype=torch.bool), new)


def token_ids(input_ids: Any) -> torch.Tensor:
    """``input_ids`` checked: a non-empty 2-D tensor of an integer dtype, as int64."""
    if not isinstance(input_ids, torch.Tensor):
        raise CudaGraphsTypeError(
            f"input_ids must be a torch.Tensor of token ids [batch, prompt_len], got "
            f"{type(input_ids).__name__}; pass tokenizer(..., return_tensors='pt').input_ids"
        )
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or input_ids.dtype == torch.bool
    ):
        raise CudaGraphsTypeError(
            f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; pass "
            "input_ids.long()"
        )
    _check_holds_values("input_ids", input_ids)
    if input_ids.dim() != 2:
        hint = " (one prompt: input_ids.unsqueeze(0))" if input_ids.dim() == 1 else ""
        raise CudaGraphsValueError(
            f"input_ids must be 2-D [batch, prompt_len], got shape {tuple(input_ids.shape)}{hint}"
        )
    if input_ids.numel() == 0:
        raise CudaGraphsValueError(
            f"input_ids is empty (shape {tuple(input_ids.shape)}); pass at least one token "
            "per prompt"
        )
    return input_ids.long()


def _check_holds_values(name: str, tensor: torch.Tensor) -> None:
    """A meta tensor has a shape and no values: the request's checks read its values on
    the host, and its copy to the model's device has nothing to copy."""
    if tensor.is_meta:
        raise CudaGraphsValueError(
            f"{name} is on the meta device: it has a shape but no values to read. Fix: "
            f"pass {name} on the CPU or the model's device (e.g. the tokenizer's tensors)"
        )


def _check_in_vocabulary(ids: torch.Tensor, vocab_size: int) -> None:
    """One host read of the ids' range; every id must index the input embedding."""
    outside = (ids < 0) | (ids >= vocab_size)
    if not bool(outside.any()):
        return
    row, position = (int(i) for i in outside.nonzero()[0])
    raise CudaGraphsValueError(
        f"input_ids[{row}, {position}] = {int(ids[row, position])} is outside the model's "
        f"vocabulary [0, {vocab_size}) ({int(outside.sum())} id(s) outside in all); pass "
        "ids of the model's tokenizer, and pad with an id inside the vocabulary "
        "(tokenizer.pad_token_id)"
    )


def inferred_mask(input_ids: Any, pad: int | None, eos: Sequence[int]) -> torch.Tensor | None:
    """The mask ``generate`` infers without one: ``ids != pad`` where the pad id is set,
    appears in the ids and is no end-of-sequence id; ``None`` (no padding) otherwise.

    Raises:
        CudaGraphsTypeError, CudaGraphsValueError: ids that are not token ids
            (:func:`token_ids`).
        CudaGraphInputError: the pad id after real tokens in a row: that mask is not
            left padding, which the static cache needs.
    """
    if pad is None or pad in eos:
        return None
    ids = token_ids(input_ids)
    real = ids.detach().to("cpu") != pad
    if bool(real.all()):
        return None
    started = real.long().cummax(-1).values.bool()
    holes = [r for r in range(real.shape[0]) if bool((started[r] & ~real[r]).any())]
    if holes:
        raise CudaGraphInputError(
            f"input_ids hold pad_token_id {pad} after real tokens in rows {holes}, and "
            "without attention_mask the padding is read from it as generate does "
            "(ids != pad_token_id): not left padding, which the static cache needs. Fix: "
            "pass the tokenizer's attention_mask, or a pad_token_id no prompt token is"
        )
    return real.to(ids.device).long()


def _checked_mask(attention_mask: Any, ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(attention_mask, torch.Tensor):
        raise CudaGraphsTypeError(
            f"attention_mask must be a torch.Tensor [batch, prompt_len] of 0/1 or None, got "
            f"{type(attention_mask).__name__}"
        )
    _check_holds_values("attention_mask", attention_mask)
    if tuple(attention_mask.shape) != tuple(ids.shape):
        wrong = [Mismatch("attention_mask", "shape", tuple(ids.shape), tuple(attention_mask.shape))]
        raise CudaGraphInputError(
            describe_mismatches(
                "attention_mask does not match input_ids",
                wrong,
                "Pass the mask the tokenizer returned with these ids (one 0/1 per token).",
            ),
            wrong,
        )
    host = attention_mask.detach().to("cpu")
    problems = []
    if not bool(((host == 0) | (host == 1)).all()):
        problems.append("it holds values other than 0 and 1")
    real = host != 0
    empty = [r for r in range(real.shape[0]) if not bool(real[r].any())]
    if empty:
        problems.append(f"rows {empty} have no real token")
    # Left padding: once a row's real tokens start, they run to the end.
    started = real.long().cummax(-1).values.bool()
    right = [r for r in range(real.shape[0]) if bool((started[r] & ~real[r]).any())]
    if right:
        problems.append(
            f"rows {right} have padding after real tokens (right padding or holes); the "
            "static cache needs left padding: tokenizer.padding_side = 'left'"
        )
    if problems:
        raise CudaGraphInputError(
            "attention_mask is not a left-padded 0/1 mask: " + "; ".join(problems)
        )
    return real
