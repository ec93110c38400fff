"""Partial graphs in a ``transformers.Trainer`` run, as one line::

    from cudagraphs.integrations.hf import PartialGraphsCallback

    trainer = Trainer(model, args, train_dataset=..., callbacks=[PartialGraphsCallback()])
    trainer.train()

What the callback does, by Trainer event:

* ``on_train_begin``: builds a :class:`~cudagraphs.partial.PartialCudaGraphManager`
  on the model (graphs are off, said once at WARNING, when the model is not on a CUDA
  device or nothing graphable is found: training then runs eagerly, unchanged).
* ``on_step_begin`` of optimizer step ``record_step``: starts recording. Every
  micro-batch forward of that step is recorded (gradient accumulation); an evaluation
  inside it follows ``inference_calls``.
* ``on_step_end`` of that step (after the optimizer step and ``zero_grad``): captures.
  From the next step on, matching calls replay their graphs.
* With ``inference_calls="record"``: the first evaluation after the capture is
  recorded (recording runs from each ``on_step_end`` to the next ``on_step_begin``
  until an evaluation happens) and captured at its ``on_evaluate``; later evaluations
  replay those inference graphs, captured in pools of their own.
* ``on_log``: adds the manager's ``stats()`` to the logs, as ``cudagraphs/<key>``.
* ``on_train_end``: logs the stats and closes the manager (the model's modules get
  their eager forwards back).

Evaluation and prediction run with ``model.eval()`` under ``torch.no_grad()``: their
calls do not match the training contracts, so they run eagerly (counted as fallbacks)
or, with ``inference_calls="record"``, replay inference graphs. Neither touches the
training graphs. Mixed precision (``bf16=True``) is recorded with each call and reproduced at
capture.

Where the stats show up: ``trainer.state.log_history`` and every callback after this
one (the console printer, which Trainer adds last). Reporting integrations chosen by
``report_to`` are registered before user callbacks and log before this one runs; to
report the stats there, put the callback first:
``trainer.callback_handler.callbacks.insert(0, callback)``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..checks import check_callable, check_instance, check_int
from ..compile_watch import GRAPH_RECORDING_MODES, check_compile_options
from ..errors import CudaGraphsValueError, MissingDependencyError
from ..partial import PartialCudaGraphManager, check_scopes
from ..partial.arguments import Selector
from ..partial.recording import InferenceCalls, check_inference_calls
from ..partial.speed import speed_check_of

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the hf extra brings it
    raise MissingDependencyError(
        "cudagraphs.integrations.hf needs transformers (and accelerate, which Trainer "
        "uses). Fix: pip install 'cudagraphs[hf]'"
    ) from exc

__all__ = ["PartialGraphsCallback"]

logger = logging.getLogger(__name__)


class PartialGraphsCallback(TrainerCallback):
    """Record one optimizer step, capture after it, replay for the rest of training.

    Args:
        scopes: what to graph in each decoder layer, from
            :data:`~cudagraphs.partial.SCOPES` (``"attention"``, ``"moe_router"``,
            ``"mlp"``, ``"moe"``, ``"layer"``): per layer the widest graph-safe one
            asked for. ``None``: the manager's default, every scope (each layer as
            widely as is safe; a float32 MoE whose ``grouped_mm`` experts torch runs
            on the host keeps attention and router scopes, said at INFO). Add
            ``"model"`` (:data:`~cudagraphs.partial.MODEL_SCOPE`) to graph the whole
            model with its loss in one graph, the layers kept in reserve.
        record_step: the optimizer step (1-based, as ``state.global_step`` counts
            them after the step) to record; the first step at or after it when
            training resumes from a later checkpoint.
        include: more modules to graph (glob patterns or a predicate, see
            :meth:`~cudagraphs.partial.PartialCudaGraphManager.from_model_parts`).
        max_variants: recorded variants per target.
        inference_calls: ``"ignore"`` or ``"record"``: what recording does with an
            evaluation-style call (see the manager).
        capture_backend: how recorded calls become graphed callables (the core
            ``make_graphed_callables`` by default). When given, graphs are on
            whatever the model's device is: the backend decides (tests pass an
            eager one to run this whole path on the CPU).
        speed_check: turn off a target whose graph is measured slower than its eager
            run right after capture (see the manager); ``True`` by default.
        compile_options: keywords for ``torch.compile`` (``{}``: its defaults): each
            target's graph records its compiled forward and backward (see the
            manager's ``from_model_parts``). Use this in place of the Trainer's
            ``torch_compile=True``, which is refused at ``on_train_begin``: the
            Trainer's compiled model would trace the targets' dispatching forwards.
        log_prefix: prefix of the keys added to the Trainer's logs.

    Attributes:
        manager: the manager while training runs (``None`` before, after, and when
            graphs are off).
        off_reason: why graphs are off for the last training run, else ``None``.

    Raises:
        CudaGraphsValueError: an unknown or repeated scope; ``record_step`` < 1; a bad
            ``inference_calls``; ``compile_options`` whose mode records CUDA graphs of
            its own. At ``on_train_begin``: ``TrainingArguments(torch_compile=True)``.
        CudaGraphsTypeError: an argument of the wrong type (named), ``scopes`` that
            is not a list or tuple included.
    """

    def __init__(
        self,
        *,
        scopes: Sequence[str] | None = None,
        record_step: int = 1,
        include: Selector | None = None,
        max_variants: int = 4,
        inference_calls: InferenceCalls = "ignore",
        capture_backend: Any = None,
        speed_check: Any = True,
        compile_options: Any = None,
        log_prefix: str = "cudagraphs/",
    ) -> None:
        self._scopes = None if scopes is None else check_scopes(scopes)
        self.record_step = check_int("record_step", record_step, minimum=1)
        self._options = {
            "include": include,
            "max_variants": check_int("max_variants", max_variants, minimum=1),
            "inference_calls": check_inference_calls(inference_calls),
            "speed_check": speed_check_of(speed_check),
            "capture_backend": (
                None
                if capture_backend is None
                else check_callable("capture_backend", capture_backend)
            ),
            "compile_options": check_compile_options("PartialGraphsCallback", compile_options),
        }
        self.log_prefix = check_instance("log_prefix", log_prefix, str, "a str")
        self.manager: PartialCudaGraphManager | None = None
        self.off_reason: str | None = None
        self._said_off = False
        self._last_stats: dict[str, int] = {}
        self._new_run()

    def _new_run(self) -> None:
        """Where a training run stands: nothing recorded or captured yet."""
        self._recording_step: int | None = None
        self._captured = False
        self._eval_recording = False  # recording between steps, for an evaluation
        self._eval_captured = False

    # ---- Trainer events --------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()
        self._new_run()
        refuse_trainer_compile(args)
        model = kwargs.get("model")
        self.off_reason = self._why_off(model)
        if self.off_reason is None:
            self.manager = PartialCudaGraphManager.from_model_parts(
                model,
                activation_checkpointing=_checkpointing(args),
                scopes=self._scopes,
                **self._options,
            )
            if self.manager is None:  # from_model_parts said why at WARNING
                self.off_reason = "nothing graphable was found in the model"
                return
        if self.off_reason is not None and not self._said_off:
            self._said_off = True
            logger.warning(
                "partial graphs are off for this Trainer run: %s. Training runs eagerly, "
                "unchanged.",
                self.off_reason,
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.manager is not None and self._eval_recording:
            # No evaluation since the last step: stop before training calls come.
            self.manager.stop_recording()
            self._eval_recording = False
        if self.manager is None or self._captured or self._recording_step is not None:
            return
        step = state.global_step + 1  # the optimizer step about to run
        if step >= self.record_step:
            self.manager.start_recording()
            self._recording_step = step
            logger.info("partial graphs: recording optimizer step %d", step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.manager is None:
            return
        if self.manager.recording and not self._eval_recording:
            self.manager.capture()
            self._captured = True
            logger.info(
                "partial graphs: captured after optimizer step %d: %s",
                self._recording_step,
                self.manager.stats(),
            )
        if self._captured and self.manager.inference_calls == "record" and not self._eval_captured:
            # Trainer evaluates after on_step_end, before the next on_step_begin.
            self.manager.start_recording()
            self._eval_recording = True

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.manager is None or not self._eval_recording:
            return
        self.manager.capture()  # the evaluation's calls: inference variants
        self._eval_recording, self._eval_captured = False, True
        logger.info("partial graphs: captured the evaluation's calls: %s", self.manager.stats())

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
    ) -> None:
        if self.manager is None or logs is None:
            return
        added = {self.log_prefix + k: v for k, v in self.manager.stats().items()}
        history = getattr(state, "log_history", None)
        if history and _is_copy_of(history[-1], logs):
            history[-1].update(added)  # Trainer stored this log's copy before on_log
        logs.update(added)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.manager is not None:
            self.manager.log_stats("train end")
        self._close()

    # ---- reporting -------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The manager's ``stats()`` now, or as they were when training ended; empty
        when graphs were off."""
        return self.manager.stats() if self.manager is not None else dict(self._last_stats)

    # ---- internals ---------------------------------------------------------------------
    def _why_off(self, model: Any) -> str | None:
        if not isinstance(model, nn.Module):
            return f"the Trainer passed no model to the callback (got {type(model).__name__})"
        if self._options["capture_backend"] is not None:
            return None
        if not torch.cuda.is_available():
            return "no CUDA device is available (torch.cuda.is_available() is False)"
        device = next((p.device for p in model.parameters()), None)
        if device is None or device.type != "cuda":
            return f"the model's parameters are on {device}, not on a CUDA device"
        return None

    def _close(self) -> None:
        if self.manager is not None:
            self._last_stats = self.manager.stats()
            self.manager.close()
            self.manager = None


def _checkpointing(args: Any) -> bool:
    # transformers 5.x renamed gradient_checkpointing to activation_checkpointing and
    # keeps the old name as a deprecated alias for a while: read both.
    return any(
        bool(getattr(args, name, False))
        for name in ("activation_checkpointing", "gradient_checkpointing")
    )


def _is_copy_of(entry: Any, logs: dict) -> bool:
    """Whether a ``log_history`` entry is Trainer's copy of ``logs`` (``{**logs,
    "step": ...}``): it holds the very same value objects under the same keys."""
    return isinstance(entry, dict) and all(k in entry and entry[k] is v for k, v in logs.items())


def refuse_trainer_compile(args: Any) -> None:
    """Refuse ``TrainingArguments(torch_compile=True)``.

    Why: the Trainer then calls ``torch.compile`` on the model it steps, whose dynamo
    would trace the dispatching forwards the callback installs on the targets (each a
    graph replay in Python) into its own graphs.

    Raises:
        CudaGraphsValueError: saying what to pass instead.
    """
    if not getattr(args, "torch_compile", False):
        return
    keywords = {
        "backend": getattr(args, "torch_compile_backend", None),
        "mode": getattr(args, "torch_compile_mode", None),
    }
    # Modes and backends that record CUDA graphs of their own cannot go inside ours:
    # left out.
    said = {
        k: v
        for k, v in keywords.items()
        if v is not None
        and not (k == "mode" and v in GRAPH_RECORDING_MODES)
        and not (k == "backend" and v == "cudagraphs")
    }
    raise CudaGraphsValueError(
        "PartialGraphsCallback: TrainingArguments(torch_compile=True) compiles the whole "
        "model, whose compiled code would trace the partial graphs' dispatching "
        "forwards. Fix: set torch_compile=False and pass "
        f"PartialGraphsCallback(compile_options={said!r}): each graphed target then "
        "records its compiled forward and backward."
    )
