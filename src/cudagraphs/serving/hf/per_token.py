"""What the generator's decode loop does per token outside the graph: choose the next
token from the logits, and learn one step late whether every sequence has ended. Kept
apart from :class:`~cudagraphs.serving.hf.generator.GraphedGenerator` because neither
touches the model, the cache or the runner.
"""

from __future__ import annotations

from typing import Any

import torch

from .sampling import Sampling


class _EndFlag:
    """A device boolean read on the host one step late: copied into pinned memory
    without blocking, with an event to wait on when it is read."""

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
