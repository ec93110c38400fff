"""The whole training iteration as one graph: forward, backward, gradient all-reduce,
clipping and the optimizer step.

Where the gradients live decides the design. Before capture every ``.grad`` is set to
``None``, so the captured backward *creates* the gradients inside the graph's pool
(autograd hands its result to ``.grad`` when there is none). Each replay then writes
the step's gradients at those addresses afresh: no ``zero_grad`` kernel and no add per
parameter, and ``.grad`` after a step holds that step's (clipped) gradients. With
gradient accumulation a second graph is captured with the gradients present, so its
backward adds into them, and a third holds the update.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..checks import check_callable, check_instance, require_cuda
from ..compile_watch import (
    CompileReport,
    CompileWatch,
    check_warmup,
    require_no_compile,
    warn_failed_compiles,
)
from ..errors import (
    CudaGraphCaptureError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    GraphReleasedError,
)
from ..graph_pool import GraphMemoryPool, as_graph_pool
from ..hf_masks import eager_mask_choice, unread_masks_warning
from ..memory import MemoryMeter, tensor_bytes
from ..optimizer_state import compact_before_capture
from ..program.buffer import ReusableValueBuffer
from ..program.signature import ValueTreeSignature
from ..settings import graphs_disabled
from .gradients import DEFAULT_BUCKET_MB, GradientReducer
from .optimizers import (
    HyperparameterGuard,
    OptimizerSnapshot,
    StateKeeper,
    adopts_compiled_step,
    compiled_optimizer_step,
    exact_at_zero_lr,
    prepare_optimizer,
)
from .records import TrainStepOptions, TrainStepStats
from .step_capture import CapturedStep, capture_step_graphs
from .step_modules import check_step_experts

__all__ = ["GraphedTrainStep", "graph_train_step"]

logger = logging.getLogger(__name__)

# torch warns once per optimizer when a capturable step runs eagerly; the warmup must.
_CAPTURABLE_WARNING = ".*capturable=True.*"


class GraphedTrainStep:
    """A training step replayed as CUDA graphs. Built by :func:`graph_train_step`.

    Workflow:

    1. ``__init__`` checks the arguments and prepares the optimizer
       (:func:`~cudagraphs.train.prepare_optimizer`); nothing is captured.
    2. :meth:`capture` warms up (real steps on the sample batch, at learning rate 0,
       inside the pool while it holds no graph: ``GraphMemoryPool.warmup_scope``), restores
       optimizer state and learning rates as they were, and captures: the warmup
       leaves no trace in the model and no second copy of it on the device
       (:class:`~cudagraphs.train.optimizers.OptimizerSnapshot`).
    3. Each call copies the batch into the graph's input buffers (one fused copy per
       dtype) and replays; it returns the loss, borrowed.
    4. :meth:`reset` releases the graphs; eager training can go on.

    It does NOT: take batches of another shape (use ``graph_stack`` or partial graphs
    for dynamic shapes), restore module buffers the warmup updated (BatchNorm
    statistics), replay random ops with the eager generator sequence (each replay
    draws fresh numbers from the CUDA generator's graph-safe offsets), or follow
    optimizer hyperparameters other than the learning rate after capture (a change
    raises).
    """

    def __init__(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        sample_batch: Any,
        optimizer: torch.optim.Optimizer,
        options: TrainStepOptions,
    ) -> None:
        self.step_fn = check_callable("step_fn", step_fn)
        self.optimizer = check_instance(
            "optimizer", optimizer, torch.optim.Optimizer, "a torch optimizer"
        )
        self.options = options
        self.signature = ValueTreeSignature.from_value(sample_batch, path="sample_batch")
        if not self.signature.tensor_signatures():
            raise CudaGraphsValueError("sample_batch holds no tensor; the step would read nothing")
        self.sample_batch = sample_batch
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise CudaGraphsValueError("the optimizer holds no parameters")
        # Before prepare_optimizer sets capturable=True: a step that was not capturable
        # sits in no graph, so its state may be packed at capture (optimizer_state).
        self._state_in_no_graph = not any(g.get("capturable") for g in optimizer.param_groups)
        self.plans = prepare_optimizer(optimizer, options.optimizer_impl)
        # Compiled lazily: the warmup's first step compiles it, never the capture.
        self._compiled_step = (
            compiled_optimizer_step(optimizer) if options.optimizer_impl == "compiled" else None
        )
        self.graphed = False
        self.stats: TrainStepStats | None = None
        self._captured: CapturedStep | None = None
        self._buffer: ReusableValueBuffer | None = None
        self._guard: HyperparameterGuard | None = None
        self._keeper: StateKeeper | None = None
        self._ends: tuple[int, int] = (0, 0)
        self._grads: list[torch.Tensor | None] = []
        self._losses: torch.Tensor | None = None
        self._released = False
        self._unused_said = False

    # ---- the step's pieces: run by the warmup, the capture and the eager path ---------
    def _micro(self, batch: Any) -> torch.Tensor:
        loss = self.step_fn(batch)
        if not isinstance(loss, torch.Tensor):
            raise CudaGraphsTypeError(
                f"step_fn must return the loss as a tensor (after calling backward on "
                f"it); it returned {type(loss).__name__}"
            )
        # The loss's autograd graph is spent; keeping it would keep the parameters'
        # AccumulateGrad nodes alive across captures.
        return loss.detach()

    def _update(self, before_update: OptimizerSnapshot | None = None) -> torch.Tensor | None:
        with_grad = [p for p in self.params if p.grad is not None]
        if self.options.reduces():
            GradientReducer(
                [p.grad for p in with_grad], self.options.process_group, self.options.bucket_mb
            )()
        if before_update is not None and not _grads_finite(with_grad):
            # A warmup step runs at learning rate 0, which keeps a parameter only where
            # its update is finite (0 * inf is NaN): keep the parameters on the host.
            # Read after the all-reduce: every rank then holds the same gradients and
            # decides alike (one rank's inf reaches all of them).
            before_update.keep_params()
        norm = None
        if self.options.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                with_grad, self.options.max_grad_norm, foreach=True
            )
        if self._compiled_step is not None:
            self._compiled_step()
        else:
            # Looked up at each step: an LR scheduler built later wraps optimizer.step.
            self.optimizer.step()
        return norm

    def _say_unused(self) -> None:
        """Once: name the optimizer's parameters the step gave no gradient. Like an
        eager step, ``optimizer.step()`` skips them (graphed: in every replay, since
        the graph holds the step as captured), and their ``.grad`` stays ``None``."""
        if self._unused_said:
            return
        self._unused_said = True
        unused = [
            f"param_groups[{g}]['params'][{i}] {tuple(p.shape)}"
            for g, group in enumerate(self.optimizer.param_groups)
            for i, p in enumerate(group["params"])
            if p.grad is None
        ]
        if unused:
            logger.warning(
                "graph_train_step: %d of the optimizer's %d parameters get no gradient in "
                "step_fn (%s%s): optimizer.step() skips them, as an eager step does, and "
                "their .grad stays None. If the loss should depend on them, it does not; "
                "else build the optimizer without them.",
                len(unused),
                len(self.params),
                ", ".join(unused[:3]),
                ", ..." if len(unused) > 3 else "",
            )

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _buffer_batch(self) -> Any:
        """The batch buffer's tensors in new containers: a ``step_fn`` may change the
        batch it is given (``batch.pop("labels")``, as HF's ``compute_loss`` does), as it
        may in an eager loop that makes a batch per step; each warmup step, micro-batch
        and capture then gets containers of its own over the same tensors."""
        return self.signature.rebuild(self._buffer.tensors)

    def _eager_step(
        self, batches: Sequence[Any], before_update: OptimizerSnapshot | None = None
    ) -> torch.Tensor:
        self._drop_grads()
        losses = [self._micro(b) for b in batches]
        if not any(p.grad is not None for p in self.params):
            raise CudaGraphsValueError(
                "step_fn returned without a gradient for any parameter of the optimizer. "
                "Either it does not call backward, or the loss does not depend on the "
                "optimizer's parameters (an optimizer built over another model). Fixes: "
                "1. call loss.backward() inside step_fn; 2. build the optimizer over the "
                "parameters of the model step_fn runs."
            )
        self._say_unused()
        self._update(before_update)
        return losses[0] if len(losses) == 1 else torch.stack(losses)

    # ---- capture -------------------------------------------------------------------
    def capture(self, pool: GraphMemoryPool | Any = None) -> GraphedTrainStep:
        """Warm up and capture (see the class docs). Returns ``self``.

        With ``CUDAGRAPHS_DISABLE`` set, nothing is captured and each call runs the
        same step eagerly.

        Raises:
            NoCudaDeviceError: no usable GPU.
            CudaGraphsValueError: parameters off CUDA or on several devices.
            CudaGraphCaptureError: the step cannot be captured (cause chained, with
                fixes). Parameters, optimizer state and the pool are as before, and
                ``.grad`` is ``None``: eager training can go on.
        """
        self._check_live()
        if graphs_disabled():
            logger.info("CUDAGRAPHS_DISABLE is set: the train step runs eagerly")
            self.stats = TrainStepStats(
                0,
                0.0,
                0.0,
                self.options.accumulation_steps,
                self.options.reduces(),
                self._changes(),
            )
            return self
        require_cuda("graph_train_step")
        device = self._device()
        check_step_experts(self.step_fn, self.params)
        pool = as_graph_pool(pool)
        # The pool's streams first: they drop the eager cuBLAS workspaces, which the
        # release at the meter's start then gives back with the rest of the cache.
        stream = pool.capture_stream(device)
        # Eager steps before the capture made the optimizer's state in the holes their
        # activations left; from the capture on the activations live in the pool and
        # those segments would hold the state and holes for good. Packed after the
        # release, they go back before the pool grows (cudagraphs.optimizer_state).
        pack = None
        if self._state_in_no_graph:
            optimizers = [self.optimizer]

            def pack() -> int:
                return compact_before_capture(
                    optimizers, device.index, "graph_train_step", in_no_graph=True
                )[1]

        # No eager workspaces: the step's matmuls are all in its graphs.
        meter = MemoryMeter.start(
            device, release="graph_train_step", eager_workspaces=False, pack=pack
        )
        # A second capture of this step (or another step over this optimizer) finds the
        # state in this one's graph.
        self._state_in_no_graph = False
        self._buffer = ReusableValueBuffer(self.signature, device)
        self._buffer.copy_from(self.sample_batch, path="sample_batch")
        snapshot = OptimizerSnapshot.take(self.optimizer)
        try:
            # transformers chooses its attention masks under capture as eagerly where the
            # choice reads no tensor (cudagraphs.hf_masks); warmup included, so that a
            # compiled model sees one is_tracing in warmup and capture.
            with eager_mask_choice() as masks:
                t0 = time.perf_counter()
                snapshot.zero_lr()
                # Inside a fresh pool the warmup's memory is the capture's (warmup_scope).
                compiled = last = CompileReport()
                with pool.warmup_scope(device), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=_CAPTURABLE_WARNING)
                    steps = self.options.warmup_steps
                    for done in range(1, steps + 1):
                        watch = CompileWatch.start(device.index)
                        self._eager_step(
                            [self._buffer_batch() for _ in range(self.options.accumulation_steps)],
                            before_update=snapshot,
                        )
                        last = watch.finish()
                        compiled += last
                        if done == 1:
                            self._resolve_auto(bool(last.compiled), steps - done, snapshot)
                torch.cuda.synchronize(device)
                t1 = time.perf_counter()
                # A compiled step (torch.compile inside step_fn): the capture must run
                # code compiled before it, never compile (cudagraphs.compile_watch).
                check_warmup(compiled, last, "graph_train_step", "the last warmup step", logger)
                self._drop_grads()
                snapshot.restore()
                watch = CompileWatch.start(device.index)
                try:
                    self._captured = capture_step_graphs(
                        self._micro,
                        self._update,
                        self._buffer_batch,
                        self.options.accumulation_steps,
                        pool,
                        stream,
                    )
                except CudaGraphCaptureError as exc:
                    # A compile inside the capture is the likelier cause: say it.
                    require_no_compile(watch.finish(), "the capture", "graph_train_step", exc)
                    raise
                during = watch.finish()
                warn_failed_compiles(during, "graph_train_step", logger)
                require_no_compile(during, "the capture", "graph_train_step")
                t2 = time.perf_counter()
        except BaseException:
            # No graph from here on (a step captured before is gone with its buffer):
            # calls run the step eagerly until a capture succeeds.
            self._captured = None
            self.graphed = False
            self._drop_grads()
            snapshot.restore(drop_created=True)
            raise
        del snapshot
        # The batch buffer and the losses the graphs write: the step's static bytes.
        captured = self._captured
        static = tensor_bytes(
            [
                *self._buffer.tensors,
                captured.first_loss,
                captured.accumulate_loss,
                captured.grad_norm,
            ]
        )
        memory = meter.finish(pool.handles(), what="graph_train_step", static_bytes=static)
        self._grads = [p.grad for p in self.params]
        # One parameter with a gradient tells whether zero_grad() ran since the last step.
        self._sentinel = next((p, g) for p, g in zip(self.params, self._grads) if g is not None)
        self._guard = HyperparameterGuard.watch(self.optimizer)
        # The first and last parameters' memory, checked at each call: the graphs read
        # and update the parameters where they were at capture.
        self._ends = (self.params[0].data_ptr(), self.params[-1].data_ptr())
        if self._keeper is not None:  # a capture before this one: one load hook only
            self._keeper.remove()
        self._keeper = StateKeeper.install(self.optimizer)
        n = self.options.accumulation_steps
        if n > 1:
            loss = self._captured.first_loss
            self._losses = torch.empty((n, *loss.shape), dtype=loss.dtype, device=device)
        self.graphed = True
        self.stats = TrainStepStats(
            1 if n == 1 else 3,
            t1 - t0,
            t2 - t1,
            n,
            self.options.reduces(),
            self._changes(),
            masks_built_in_capture=tuple(masks.unread),
            memory=memory,
            compile_seconds=compiled.seconds,
            compiled_frames=len(compiled.compiled),
            graph_breaks=compiled.graph_breaks,
        )
        logger.info("train step captured: %s", self.stats)
        said = unread_masks_warning("graph_train_step", masks.unread)
        if said is not None:
            logger.warning(said)
        return self

    def _resolve_auto(
        self, step_compiled: bool, steps_left: int, snapshot: OptimizerSnapshot
    ) -> None:
        """``optimizer_impl="auto"`` on a step that compiles: from the next warmup step
        on, the optimizer step is compiled too (:func:`~.optimizers.adopts_compiled_step`
        says when). The state the fused first step made is the ``foreach`` step's
        too; parameters of a group no longer exact at learning rate 0 are kept on the
        host now, before any step of the new kind."""
        if self._compiled_step is not None or not adopts_compiled_step(
            self.options.optimizer_impl, step_compiled, steps_left
        ):
            return
        self.plans = [*self.plans, *prepare_optimizer(self.optimizer, "compiled")]
        for group in self.optimizer.param_groups:
            if not exact_at_zero_lr(self.optimizer, group):
                snapshot.keep_params(group["params"])
        self._compiled_step = compiled_optimizer_step(self.optimizer)
        logger.info(
            "graph_train_step: the step compiles, so optimizer_impl='auto' compiles the "
            "optimizer step too (optimizer_impl='fused' keeps the fused kernels)"
        )

    @property
    def optimizer_compiled(self) -> bool:
        """Whether the step runs the optimizer step compiled (``optimizer_impl=
        "compiled"``, or ``"auto"`` on a step that compiles, decided in the warmup)."""
        return self._compiled_step is not None

    def _device(self) -> torch.device:
        devices = sorted({str(p.device) for p in self.params})
        if len(devices) != 1 or not devices[0].startswith("cuda"):
            raise CudaGraphsValueError(
                f"graph_train_step needs every parameter of the optimizer on one CUDA "
                f"device; they are on {devices}. Move the model with model.cuda() before "
                "building the optimizer."
            )
        return self.params[0].device

    def _changes(self) -> tuple[str, ...]:
        return tuple(line for plan in self.plans for line in plan.changes)

    # ---- replay --------------------------------------------------------------------
    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm of the last step before clipping (borrowed), when
        ``max_grad_norm`` is set and the step is graphed; else ``None``."""
        return self._captured.grad_norm if self._captured is not None else None

    def __call__(self, batch: Any) -> torch.Tensor:
        """Run one training step on ``batch`` (with ``accumulation_steps > 1``: a list
        or tuple of that many micro-batches).

        Returns:
            The loss (borrowed: the next step overwrites it); with accumulation, the
            micro-batches' losses stacked along a new first dimension.

        Raises:
            CudaGraphInputError: a batch whose structure, shapes, strides or dtypes
                differ from ``sample_batch`` (every difference named by path).
            CudaGraphsStateError: optimizer hyperparameters other than the learning
                rate changed after capture, or the parameters were moved to new memory
                (the first and last parameters are checked).
            GraphReleasedError: after :meth:`reset`.
        """
        self._check_live()
        batches = self._batches(batch)
        sources = [
            self.signature.flatten(b, path=f"batch[{i}]" if len(batches) > 1 else "batch")
            for i, b in enumerate(batches)
        ]
        if not self.graphed:
            return self._eager_step(batches)
        self._guard.check()
        if self._ends != (self.params[0].data_ptr(), self.params[-1].data_ptr()):
            self._refuse_moved_params()
        sentinel, grad = self._sentinel
        if sentinel.grad is not grad:
            # zero_grad() dropped the graph's gradients; they are ours and still written
            # by every replay, so hand them out again. One parameter is checked, not
            # all (a pass over every .grad costs about 0.3 us a parameter, each step):
            # a zero_grad() of a part of the model alone leaves that part's .grad None
            # until the next whole one; the replays still train it (docs/train-step.md).
            for p, g in zip(self.params, self._grads):
                p.grad = g
        captured, buffer = self._captured, self._buffer
        buffer.copy_tensors(sources[0])
        captured.first.replay()
        if captured.update is None:
            return captured.first_loss
        losses = self._losses
        losses[0].copy_(captured.first_loss)
        for i in range(1, len(sources)):
            buffer.copy_tensors(sources[i])
            captured.accumulate.replay()
            losses[i].copy_(captured.accumulate_loss)
        captured.update.replay()
        return losses

    def _refuse_moved_params(self) -> None:
        """The parameters' memory changed since capture (``model.to(dtype)``,
        ``model.cuda(1)``, ``param.data = ...``): the graphs would read and update the
        old memory, training nothing the model holds."""
        raise CudaGraphsStateError(
            "graph_train_step: the optimizer's parameters were moved to new memory since "
            "capture (model.to(...), .data assignment, resharding); the graphs read and "
            "update the old memory, so the step would train nothing the model holds. "
            "Fix: call capture() again (or build a new step) after moving the model"
        )

    def _batches(self, batch: Any) -> Sequence[Any]:
        n = self.options.accumulation_steps
        if n == 1:
            return (batch,)
        if not isinstance(batch, (list, tuple)) or len(batch) != n:
            got = (
                f"{type(batch).__name__} of {len(batch)}"
                if isinstance(batch, (list, tuple))
                else type(batch).__name__
            )
            raise CudaGraphsTypeError(
                f"with accumulation_steps={n} a step takes a list or tuple of {n} "
                f"micro-batches; got a {got}"
            )
        return batch

    def _check_live(self) -> None:
        if self._released:
            raise GraphReleasedError(
                "this train step was reset(); build a new one with graph_train_step"
            )

    def reset(self) -> None:
        """Release the graphs and stop watching the optimizer. Parameters, gradients and
        optimizer state stay as the last step left them; train eagerly or graph again."""
        if self._keeper is not None:
            self._keeper.remove()
        self._captured = self._buffer = self._guard = self._keeper = self._losses = None
        self._grads = []
        self.graphed = False
        self._released = True


def _grads_finite(params: Sequence[torch.Tensor]) -> bool:
    """Whether every gradient element is finite (one host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads)
    return bool(torch.stack([n.float() for n in norms]).isfinite().all())


def graph_train_step(
    step_fn: Callable[[Any], torch.Tensor],
    sample_batch: Any,
    *,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    optimizer_impl: str = "auto",
    all_reduce: bool | None = None,
    process_group: Any = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    warmup_steps: int = 3,
    pool: Any = None,
) -> GraphedTrainStep:
    """Capture a whole training step, optimizer included, and return it as a callable.

    The step is, for each micro-batch, ``step_fn(batch)`` (forward and backward, on any
    model; it returns the loss), then, once, the gradient all-reduce (when
    distributed), clipping (when asked) and ``optimizer.step()``. Its eager
    equivalent, for comparison, with the optimizer prepared the same way
    (:func:`~cudagraphs.train.prepare_optimizer`)::

        for p in params: p.grad = None
        losses = [step_fn(b) for b in micro_batches]
        all_reduce_gradients(params)                  # when distributed
        clip_grad_norm_(params, max_grad_norm, foreach=True)  # when asked
        optimizer.step()

    Args:
        step_fn: ``step_fn(batch) -> loss``; must call ``loss.backward()``. Scale the
            loss by ``1 / accumulation_steps`` inside it if you want a mean.
        sample_batch: one micro-batch as the step will get it (a tree of tensors:
            tensors, tuples, lists, dicts, registered containers). Every later batch
            must match its structure, shapes, strides and dtypes.
        optimizer: ``torch.optim.Adam``, ``AdamW`` or ``SGD`` over the parameters on
            one CUDA device. Changed in place: ``capturable=True`` for Adam/AdamW,
            the implementation ``optimizer_impl`` picks, and the learning
            rate as a device tensor (schedulers keep working: they write it in place).
        max_grad_norm: clip the gradients' total norm to this (no host sync); the norm
            before clipping is :attr:`GraphedTrainStep.grad_norm`.
        accumulation_steps: micro-batches per step; a call then takes a list of them.
        optimizer_impl: ``"auto"``: ``"fused"``, except that on a step that compiles
            (``torch.compile`` inside ``step_fn``, seen in the first warmup step, with
            at least three warmup steps) the optimizer step is compiled too;
            ``"fused"`` (fused kernels where possible); ``"compiled"`` (the
            ``foreach`` step compiled by ``torch.compile``:
            :func:`~cudagraphs.train.compiled_optimizer_step`; its compile is part of
            the warmup and of ``stats.compile_seconds``) or ``"keep"`` (only what
            capture needs). :attr:`GraphedTrainStep.optimizer_compiled` says which
            ran.
        all_reduce: average gradients over ranks inside the graph (one NCCL call per
            bucket of ``bucket_mb`` MiB); ``None``: when ``torch.distributed`` is
            initialized with more than one rank. Do not also wrap the model in DDP.
        process_group: the group to reduce over (``None``: the default group).
        warmup_steps: eager steps before capture (undone afterwards).
        pool: a graph pool to share with other graphs (``None``: a new one).

    Returns:
        A captured :class:`GraphedTrainStep`.

    Raises:
        CudaGraphsTypeError: ``optimizer`` is not Adam, AdamW or SGD, ``step_fn`` not
            callable, or ``step_fn`` returned no tensor.
        CudaGraphsValueError: a bad option, or ``step_fn`` produced no gradient.
        CudaGraphCaptureError: see :meth:`GraphedTrainStep.capture`.
    """
    options = TrainStepOptions(
        max_grad_norm=max_grad_norm,
        accumulation_steps=accumulation_steps,
        optimizer_impl=optimizer_impl,
        all_reduce=all_reduce,
        process_group=process_group,
        bucket_mb=bucket_mb,
        warmup_steps=warmup_steps,
    )
    return GraphedTrainStep(step_fn, sample_batch, optimizer, options).capture(pool)
