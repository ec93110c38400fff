"""Capturing a train step's graphs: the step as one graph, or with gradient
accumulation as three, and the record of what they write. Runs once, at capture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..capture import capture_into_graph
from ..errors import CudaGraphCaptureError
from ..graph_pool import GraphMemoryPool

__all__ = ["CapturedStep", "capture_step_graphs"]


@dataclass
class CapturedStep:
    """The graphs of one step and the tensors they write (borrowed outputs)."""

    first: torch.cuda.CUDAGraph
    first_loss: torch.Tensor
    accumulate: torch.cuda.CUDAGraph | None = None
    accumulate_loss: torch.Tensor | None = None
    update: torch.cuda.CUDAGraph | None = None
    grad_norm: torch.Tensor | None = None


def capture_step_graphs(
    micro_step: Callable[[Any], torch.Tensor],
    update_step: Callable[[], torch.Tensor | None],
    batch: Callable[[], Any],
    accumulation_steps: int,
    pool: GraphMemoryPool,
    stream: torch.cuda.Stream,
) -> CapturedStep:
    """Capture the step reading the batch ``batch()`` gives (the input buffer's tensors,
    in containers of their own at each call) into ``pool`` on ``stream``: one graph, or with ``accumulation_steps > 1`` three (first micro-batch,
    later micro-batches, update). ``micro_step(batch)`` runs one micro-batch and
    returns its detached loss; ``update_step()`` reduces, clips and steps.

    Returns:
        The graphs and the tensors they write (borrowed).

    Raises:
        CudaGraphCaptureError: a capture failed (cause chained); the message says the
            caller restored parameters and optimizer state, which it must do.
    """

    def whole() -> tuple[torch.Tensor, torch.Tensor | None]:
        return micro_step(batch()), update_step()

    def micro() -> torch.Tensor:
        return micro_step(batch())

    def capture(run: Callable[[], Any], what: str) -> tuple[torch.cuda.CUDAGraph, Any]:
        try:
            return capture_into_graph(run, pool, stream=stream, what=what)
        except CudaGraphCaptureError as exc:
            raise CudaGraphCaptureError(
                f"{exc} Parameters and optimizer state were restored to their values "
                "before graph_train_step and every .grad set to None: eager training "
                "can go on."
            ) from exc.__cause__

    if accumulation_steps == 1:
        graph, (loss, norm) = capture(whole, "train step")
        return CapturedStep(graph, loss, grad_norm=norm)
    first, first_loss = capture(micro, "train step: first micro-batch")
    accumulate, accumulate_loss = capture(micro, "train step: later micro-batches")
    update, norm = capture(update_step, "train step: update")
    return CapturedStep(first, first_loss, accumulate, accumulate_loss, update, norm)
