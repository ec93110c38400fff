"""The records of a graphed train step: the checked keyword arguments of
:func:`~.step.graph_train_step` and what its capture did. Plain data with no capture
or replay code, so the options are checked and tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..checks import check_bool, check_int, check_number
from ..errors import CudaGraphsValueError
from ..memory import MemoryAccount
from .gradients import DEFAULT_BUCKET_MB

__all__ = ["TrainStepOptions", "TrainStepStats"]


@dataclass(frozen=True)
class TrainStepOptions:
    """The keyword arguments of :func:`graph_train_step`, checked."""

    max_grad_norm: float | None = None
    accumulation_steps: int = 1
    optimizer_impl: str = "auto"
    all_reduce: bool | None = None
    process_group: Any = None
    bucket_mb: float = DEFAULT_BUCKET_MB
    warmup_steps: int = 3

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None:
            value = check_number("max_grad_norm", self.max_grad_norm)
            if not value > 0:
                raise CudaGraphsValueError(f"max_grad_norm must be positive, got {value!r}")
        check_int("accumulation_steps", self.accumulation_steps, minimum=1)
        check_int("warmup_steps", self.warmup_steps, minimum=1)
        if not check_number("bucket_mb", self.bucket_mb) > 0:
            raise CudaGraphsValueError(f"bucket_mb must be positive, got {self.bucket_mb!r}")
        if self.all_reduce is not None:
            check_bool("all_reduce", self.all_reduce)
        dist = torch.distributed
        if self.all_reduce and not (dist.is_available() and dist.is_initialized()):
            raise CudaGraphsValueError(
                "all_reduce=True, but torch.distributed has no process group (it is "
                f"{'not initialized' if dist.is_available() else 'not built in'}), so "
                "there are no ranks to average gradients over. Fixes: 1. call "
                "torch.distributed.init_process_group(...) before graph_train_step; "
                "2. leave all_reduce at None (it then all-reduces when more than one rank "
                "runs)"
            )

    def reduces(self) -> bool:
        """Whether gradients are all-reduced: as asked, else when ``torch.distributed``
        runs with more than one rank."""
        if self.all_reduce is not None:
            return self.all_reduce
        dist = torch.distributed
        return (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )


@dataclass(frozen=True)
class TrainStepStats:
    """What :meth:`GraphedTrainStep.capture` did.

    Attributes:
        graphs: graphs captured (1 without accumulation, 3 with: first micro-batch,
            later micro-batches, update); 0 when graphs are disabled.
        warmup_seconds / capture_seconds: wall time of the warmup steps and captures.
        all_reduce: whether gradients are averaged over ranks inside the step.
        optimizer_changes: what :func:`~cudagraphs.train.prepare_optimizer` changed.
        masks_built_in_capture: the checks transformers could not make under capture
            (:class:`~cudagraphs.hf_masks.MaskChoices`), each of which made the graph
            build an explicit attention mask where an eager step on a batch without
            padding passes none; said once at WARNING. Empty: every mask choice in the
            graph is eager's.
        memory: where the capture's device memory went
            (:class:`~cudagraphs.memory.MemoryAccount`); ``None`` when graphs are
            disabled.
        compile_seconds: of ``warmup_seconds``, what ``torch.compile`` spent compiling
            (dynamo's records; backward compiles included), 0.0 for eager code.
        compiled_frames / graph_breaks: frames it compiled during the warmup, and the
            graph breaks in them.
    """

    graphs: int
    warmup_seconds: float
    capture_seconds: float
    accumulation_steps: int
    all_reduce: bool
    optimizer_changes: tuple[str, ...]
    masks_built_in_capture: tuple[str, ...] = ()
    memory: MemoryAccount | None = None
    compile_seconds: float = 0.0
    compiled_frames: int = 0
    graph_breaks: int = 0
