"""The generator's decode loop after the prefill (:func:`decode_loop`) and what it does
per token outside the graph: choose the next token from the logits, and learn one step
late whether every sequence has ended (:class:`EndFlag`). It touches neither the model
nor the cache nor the runner: a decode step is a callable it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .requests import Request
from .sampling import Sampling, StopTokens

__all__ = ["EndFlag", "decode_loop"]


class EndFlag:
    """A device boolean read on the host one step late: copied into pinned memory
    without blocking, with an event to wait on when it is read.

    Args:
        device: where the recorded values live (pinned memory and an event on CUDA;
            neither elsewhere).
    """

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False

    def record(self, value: torch.Tensor) -> None:
        self.host.copy_(value, non_blocking=self.event is not None)
        if self.event is not None:
            # The copy runs on the current stream of the value's device, which need not
            # be the current device.
            self.event.record(torch.cuda.current_stream(value.device))
        self.pending = True

    def read(self) -> bool:
        """The last recorded value (``False`` when none is pending)."""
        if not self.pending:
            return False
        self.pending = False
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host)


def _choose(
    logits: torch.Tensor,
    sequences: torch.Tensor,
    sampling: Sampling,
    processors: Any,
    generator: torch.Generator | None,
) -> torch.Tensor:
    scores = processors(sequences, logits) if processors else logits
    if not sampling.do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def decode_loop(
    request: Request,
    logits: torch.Tensor,
    positions: torch.Tensor,
    step: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
    *,
    sampling: Sampling,
    stops: StopTokens,
    generator: torch.Generator | None,
    ended: EndFlag | None,
    max_cache_len: int,
    cache_prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Choose ``request.max_new_tokens`` tokens, the first from the prefill's last
    ``logits`` (float, ``[batch, vocab]``), each later one from ``step`` (a decode step
    of the last tokens, their positions and the boolean ``[batch, max_cache_len]``
    mask); ``positions`` are the prompt's. ``cache_prefix`` is the boolean mask of the
    cache positions the prefill wrote (default: the prompt's own; a prefill padded to a
    length bucket wrote more), which the decode mask starts with and writes after. With
    stop tokens, finished sequences get the pad token, and ``ended`` (the generator's
    :class:`EndFlag`) ends the loop one step after every sequence finished.

    Returns:
        The prompt followed by the chosen tokens, as ``model.generate`` returns them.
    """
    batch, prompt_len, new = request.batch, request.prompt_len, request.max_new_tokens
    device = logits.device
    # Each row's left padding: HF's first real token of the mask.
    padding = request.attention_mask.int().argmax(dim=1)
    processors = sampling.processors(prompt_len, stops.eos, padding)
    tokens = torch.empty(batch, new, dtype=torch.long, device=device)
    prefix = request.attention_mask if cache_prefix is None else cache_prefix
    written = prefix.shape[1]
    mask = torch.zeros(batch, max_cache_len, dtype=torch.bool, device=device)
    mask[:, :written] = prefix
    position = positions[:, -1:].clone()
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    made = new
    last = request.input_ids[:, -1:]  # replaced by the first chosen token before use
    for t in range(new):
        if t:
            position += 1
            mask[:, written + t - 1] = True
            logits = step({"input_ids": last, "position_ids": position, "attention_mask": mask})
            # Read whether every sequence had ended after step t - 1 only now, with
            # step t queued behind it: the GPU runs step t while the host waits and
            # then prepares step t + 1, instead of idling through a sync per token
            # (HF's generate syncs each step). When they had ended, step t's replay
            # is dropped unread; nothing random was drawn for it.
            if ended is not None and ended.read():
                made = t
                break
        # The penalty and the minimum lengths read the sequences so far (HF's input_ids).
        so_far = request.input_ids
        if sampling.reads_sequences:
            so_far = torch.cat([request.input_ids, tokens[:, :t]], dim=1)
        chosen = _choose(logits, so_far, sampling, processors, generator)
        if stops.active:
            chosen = torch.where(unfinished, chosen, stops.pad)
        tokens[:, t] = chosen
        last = chosen[:, None]
        if ended is not None and t + 1 < new:
            unfinished &= ~torch.isin(chosen, stops.eos)
            ended.record(~unfinished.any())
    return torch.cat([request.input_ids, tokens[:, :made]], dim=1)
