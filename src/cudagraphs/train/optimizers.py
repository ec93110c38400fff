"""Optimizers inside a graph: what must change, what is baked in, what survives a load.

Vocabulary:

* *prepared*: an optimizer whose ``step()`` can be captured. Adam and AdamW keep their
  step counters on the device only with ``capturable=True`` (or ``fused=True``), and
  refuse capture otherwise; SGD has no counter.
* *baked*: a hyperparameter read as a Python number while the step is captured. The
  kernels hold its value; a later change of the number changes nothing on replay.
* *device learning rate*: the learning rate held as a one-element tensor on the
  parameters' device. The fused and capturable kernels read it at every replay, and
  torch's schedulers write it in place (``fill_``), so schedules keep working.

Implementations (``IMPLEMENTATIONS``):

* ``"fused"``: torch's fused kernels where they take the parameters. Not the
  capturable ``foreach`` AdamW: it computes the bias corrections with extra
  multi-tensor kernels per step, and on large parameters it is the slowest AdamW,
  slower in a whole-step graph than eager ``foreach`` AdamW beside per-layer graphs,
  while the fused kernel does the whole update in one pass and reads a device
  learning rate. For SGD, ``fused`` is the implementation that reads a device
  learning rate; ``foreach`` SGD would read a tensor learning rate with a host sync.
* ``"compiled"``: the other way to one pass over the state: the ``foreach``
  implementation (capturable for Adam/AdamW), its step compiled by
  :func:`compiled_optimizer_step`, so that inductor fuses the multi-tensor arithmetic
  into a few generated kernels. This is torch's own recipe for a fast step
  ("compiling the optimizer", torch.compile's tutorial), and under ``torch.compile``
  the ``foreach`` paths read a device learning rate without a host sync, SGD's
  included (``torch/optim/sgd.py``, ``_multi_tensor_sgd``).
* ``"auto"``: ``"fused"`` here (a plan cannot see the step). In
  :func:`~cudagraphs.graph_train_step` it becomes ``"compiled"`` when the step
  itself compiles (:func:`adopts_compiled_step`): measured on the H200 with a
  compiled model, the compiled step was the faster on both shapes tried, 0.92x on
  the compute-bound block stack and 0.96x on HF Llama (the
  ``cudagraphs_train_step_compiled_optimizer`` rows of ``benchmarks/results``), and
  it costs no compile a step of eager kernels would not otherwise make.
* ``"keep"``: only what capture needs.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks import check_instance
from ..errors import CudaGraphsStateError, CudaGraphsTypeError, CudaGraphsValueError

__all__ = [
    "IMPLEMENTATIONS",
    "adopts_compiled_step",
    "compiled_optimizer_step",
    "GroupPlan",
    "HyperparameterGuard",
    "OptimizerSnapshot",
    "StateKeeper",
    "exact_at_zero_lr",
    "plan_optimizer",
    "prepare_optimizer",
]

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "fused", "keep", "compiled")
# Warmup steps a step that compiles needs after its first, once the optimizer step is
# compiled too: one that compiles it, one that compiles nothing (the capture's check).
_STEPS_AFTER_ADOPTING = 2
# dtypes torch's fused Adam/AdamW/SGD kernels take on CUDA.
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Group keys that are not hyperparameters the step reads.
_NOT_BAKED = ("params", "lr", "initial_lr")


def _kind(optimizer: torch.optim.Optimizer) -> str:
    # AdamW is not a subclass of Adam in every torch we support: test both.
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    raise CudaGraphsTypeError(
        f"graph_train_step supports torch.optim.Adam, AdamW and SGD (and their "
        f"subclasses); got {type(optimizer).__qualname__}. Their fresh state is known "
        "(zeros), which the step needs to undo its warmup. Fixes: 1. use one of them; "
        "2. graph forward and backward with cudagraphs.graph_stack and step this "
        "optimizer eagerly."
    )


@dataclass(frozen=True)
class GroupPlan:
    """What :func:`prepare_optimizer` sets in one parameter group.

    Attributes:
        index: the group's position in ``optimizer.param_groups``.
        settings: group keys to set (``capturable``, ``fused``, ``foreach``).
        device_lr: hold the learning rate as a tensor on the parameters' device.
        changes: one line per change, for the log.
    """

    index: int
    settings: dict[str, Any]
    device_lr: bool
    changes: tuple[str, ...]


def _fusable(group: dict, device_type: str) -> bool:
    return (
        device_type == "cuda"
        and not group.get("differentiable", False)
        and all(p.dtype in _FUSED_DTYPES for p in group["params"])
    )


def plan_optimizer(
    optimizer: torch.optim.Optimizer, implementation: str = "auto", device_type: str = "cuda"
) -> list[GroupPlan]:
    """Decide, per parameter group, what makes ``optimizer.step()`` capturable (pure:
    nothing is changed; :func:`prepare_optimizer` applies the plan).

    * Adam/AdamW: ``capturable=True``; with ``"fused"`` (or ``"auto"``) also
      ``fused=True`` (and ``foreach=False``) where the fused kernel takes the
      parameters.
    * SGD: with ``"fused"`` (or ``"auto"``), ``fused=True`` where possible;
      ``"keep"`` leaves it.
    * ``"compiled"``: ``foreach=True`` and ``fused=False`` for all three (the step
      then runs through :func:`compiled_optimizer_step`).
    * The learning rate becomes a device tensor where the implementation reads one
      without a host sync (fused, capturable Adam, or any compiled step); elsewhere
      it is baked.

    Nothing is planned for parameters off CUDA (``device_type``): there is no graph
    to capture, and torch refuses ``capturable`` off the GPU.

    Raises:
        CudaGraphsTypeError: an optimizer other than Adam, AdamW or SGD.
        CudaGraphsValueError: an unknown ``implementation``.
    """
    if implementation not in IMPLEMENTATIONS:
        raise CudaGraphsValueError(
            f"optimizer_impl must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    kind = _kind(optimizer)
    plans = []
    for i, group in enumerate(optimizer.param_groups):
        if kind == "sgd" and group.get("momentum", 0) and group.get("dampening", 0):
            # SGD's first step sets the momentum buffer to the gradient; every later
            # step (and so the graph, captured after warmup) scales the gradient by
            # (1 - dampening). With dampening 0 both are the same, bit for bit.
            raise CudaGraphsValueError(
                f"param_groups[{i}]: SGD with momentum and dampening="
                f"{group['dampening']} cannot be graphed: its first step treats the "
                "gradient differently from the later ones, and the graph holds a later "
                "one. Fixes: 1. dampening=0; 2. use Adam or AdamW."
            )
        settings: dict[str, Any] = {}
        if device_type == "cuda":
            if kind == "adam":
                settings["capturable"] = True
            if implementation in ("auto", "fused") and _fusable(group, device_type):
                settings.update(fused=True, foreach=False)
            elif implementation == "compiled":
                settings.update(fused=False, foreach=True)
        settings = {k: v for k, v in settings.items() if group.get(k) != v}
        fused = settings.get("fused", group.get("fused")) or False
        capturable = settings.get("capturable", group.get("capturable")) or False
        # A tensor learning rate on the parameters' device stays; one elsewhere
        # (``lr=torch.tensor(1e-3)`` on the host, the compiled-optimizer tutorials'
        # way) is read by the fused kernels as a number at capture, so a scheduler's
        # later writes to it would never reach the graph: it moves like a float.
        lr = group["lr"]
        on_device = isinstance(lr, torch.Tensor) and lr.device == _group_device(group)
        device_lr = bool(
            device_type == "cuda"
            and not on_device
            and (fused or (kind == "adam" and capturable) or implementation == "compiled")
        )
        changes = [f"param_groups[{i}]['{k}'] = {v}" for k, v in settings.items()]
        if device_lr:
            changes.append(f"param_groups[{i}]['lr'] = a tensor on the device")
        plans.append(GroupPlan(i, settings, device_lr, tuple(changes)))
    return plans


def _group_device(group: dict) -> torch.device:
    return group["params"][0].device if group["params"] else torch.device("cpu")


def prepare_optimizer(
    optimizer: torch.optim.Optimizer, implementation: str = "auto"
) -> list[GroupPlan]:
    """Make ``optimizer.step()`` capturable in place (see :func:`plan_optimizer`).

    Call it on the optimizer of an eager reference loop to run the same kernels as
    :func:`~cudagraphs.graph_train_step` (which calls it). Existing step counters move
    to the parameters' device. Applying it twice changes nothing the second time.

    Returns:
        The plan that was applied, one :class:`GroupPlan` per group (changes are
        also logged at INFO).
    """
    devices = {_group_device(g).type for g in optimizer.param_groups if g["params"]}
    device_type = "cuda" if devices == {"cuda"} else "cpu"
    plans = plan_optimizer(optimizer, implementation, device_type)
    for plan in plans:
        group = optimizer.param_groups[plan.index]
        group.update(plan.settings)
        if plan.device_lr:
            group["lr"] = torch.tensor(
                float(group["lr"]), dtype=torch.float32, device=_group_device(group)
            )
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)
        for line in plan.changes:
            logger.info("optimizer prepared for capture: %s", line)
    return plans


def adopts_compiled_step(implementation: str, step_compiled: bool, steps_left: int) -> bool:
    """Whether :func:`~cudagraphs.graph_train_step`'s ``optimizer_impl`` becomes
    ``"compiled"`` after its first warmup step (pure policy).

    Only ``"auto"`` changes, and only when that step compiled (``torch.compile``
    inside ``step_fn``: dynamo compiled a frame) and at least two warmup steps are
    left: one to compile the optimizer step, one that compiles nothing, which the
    capture requires. With fewer, ``"auto"`` stays ``"fused"``.
    """
    return implementation == "auto" and step_compiled and steps_left >= _STEPS_AFTER_ADOPTING


def compiled_optimizer_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer.step()`` compiled with ``torch.compile`` (``mode="default"``): the
    step :func:`~cudagraphs.graph_train_step` runs with ``optimizer_impl="compiled"``.

    Call it, after ``prepare_optimizer(optimizer, "compiled")``, for the eager reference
    loop of such a step: the same generated kernels, so the same bits. Compiling is
    lazy (the first call compiles). Inductor's kernels hold no CUDA graph of their own
    (``mode="default"``): inside a graph of ours they are captured like any others.

    The optimizer is read through the closure, so a group's hyperparameters are
    dynamo guards: a learning rate held as a number recompiles whenever it changes,
    which is why the plan gives a compiled step a device learning rate.
    """
    check_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch optimizer")

    def optimizer_step() -> None:
        optimizer.step()

    return torch.compile(optimizer_step)


def _state_tensors(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v for k, v in optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)}


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def exact_at_zero_lr(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether a step of ``group`` with learning rate 0 leaves every parameter
    bit for bit as it was (given finite gradients).

    True for SGD (``p - 0 * d``) and for fused Adam/AdamW with ``eps > 0``: the fused
    kernel subtracts ``lr * weight_decay * p`` and ``(lr / bc1) * m / denom`` with
    ``denom >= eps``. Not for torch's capturable ``foreach``/for-loop Adam: it divides
    by the negated step size, so a zero learning rate makes ``0 / 0`` wherever a
    gradient element was zero.
    """
    if _kind(optimizer) == "sgd":
        return True
    return bool(group.get("fused")) and float(group.get("eps", 0.0)) > 0


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


@dataclass
class OptimizerSnapshot:
    """What the warmup steps of :func:`~cudagraphs.graph_train_step` change, kept so
    that :meth:`restore` can undo them without a second copy of the model on the
    device.

    The warmup runs real optimizer steps (the only way to create the optimizer's
    lazy state before capture) with every learning rate set to 0
    (:meth:`zero_lr`). Where that is exact (:func:`exact_at_zero_lr`) the parameters
    are not copied at all; elsewhere, and when the warmup's gradients are not finite
    (``0 * inf``), they are copied to host memory first (:meth:`keep_params`). State
    that existed before (a resumed optimizer) is copied to host memory; state the
    warmup created is reset to its fresh value, zeros, which is why only Adam, AdamW
    and SGD are accepted. :meth:`restore` copies into the same tensors, whose
    addresses the graph keeps, and puts the learning rates back.
    """

    optimizer: torch.optim.Optimizer
    params: dict[int, tuple[torch.Tensor, torch.Tensor]]
    state: dict[int, dict[str, torch.Tensor]]
    lrs: list[Any]

    @classmethod
    def take(cls, optimizer: torch.optim.Optimizer) -> OptimizerSnapshot:
        with torch.no_grad():
            state = {
                id(p): {k: _host_copy(v) for k, v in _state_tensors(optimizer, p).items()}
                for p in _params(optimizer)
            }
            lrs = [
                g["lr"].detach().clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                for g in optimizer.param_groups
            ]
        snapshot = cls(optimizer, {}, {k: v for k, v in state.items() if v}, lrs)
        for group in optimizer.param_groups:
            if not exact_at_zero_lr(optimizer, group):
                snapshot.keep_params(group["params"])
        return snapshot

    def keep_params(
        self, params: Iterator[torch.Tensor] | list[torch.Tensor] | None = None
    ) -> None:
        """Copy ``params`` (default: all) to host memory, once each."""
        with torch.no_grad():
            for p in _params(self.optimizer) if params is None else params:
                if id(p) not in self.params:
                    self.params[id(p)] = (p, _host_copy(p))

    def zero_lr(self) -> None:
        """Set every group's learning rate to 0 (in place for a device tensor)."""
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(0.0)
                else:
                    group["lr"] = 0.0

    def restore(self, *, drop_created: bool = False) -> None:
        """Put back the learning rates, the kept parameters and the state that existed.

        State the warmup created is reset to zeros, its fresh value, and kept for the
        capture that follows (a capture must not create it: the creation would be
        recorded into the graph and redone at every replay). After a failure
        (``drop_created=True``) it is removed instead: the optimizer is then exactly
        as it was, and holds no device memory the failed attempt made.
        """
        optimizer = self.optimizer
        with torch.no_grad():
            for group, lr in zip(optimizer.param_groups, self.lrs):
                if isinstance(lr, torch.Tensor):
                    group["lr"].copy_(lr)
                else:
                    group["lr"] = lr
            for p, saved in self.params.values():
                p.copy_(saved)
            for p in _params(optimizer):
                before = self.state.get(id(p))
                if before is None and drop_created:
                    optimizer.state.pop(p, None)
                    continue
                for key, value in _state_tensors(optimizer, p).items():
                    if before is not None and key in before:
                        value.copy_(before[key])
                    else:
                        value.zero_()


@dataclass
class HyperparameterGuard:
    """Checks, before each replay, that the optimizer still asks for what the graph
    does.

    A learning rate assigned as a number (``group['lr'] = 0.01``) is written into the
    device learning rate and the tensor put back: that is what the user meant. Any
    other baked value that changed (betas cycled by ``OneCycleLR``, a new weight
    decay) cannot reach the kernels: it raises, naming group, key and both values.
    """

    optimizer: torch.optim.Optimizer
    lrs: list[torch.Tensor | None] = field(default_factory=list)
    baked: list[tuple[tuple[str, Any], ...]] = field(default_factory=list)

    @classmethod
    def watch(cls, optimizer: torch.optim.Optimizer) -> HyperparameterGuard:
        groups = optimizer.param_groups
        lrs = [g["lr"] if isinstance(g["lr"], torch.Tensor) else None for g in groups]
        # Copies of the plain values: a list edited in place must still differ.
        baked = [
            tuple(
                (k, v if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for k, v in g.items()
                if k not in _NOT_BAKED or (k == "lr" and lr is None)
            )
            for g, lr in zip(groups, lrs)
        ]
        return cls(optimizer, lrs, baked)

    def check(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.baked):
            raise CudaGraphsStateError(
                f"the optimizer has {len(groups)} parameter groups; the step was captured "
                f"with {len(self.baked)}. Build a new step with graph_train_step "
                "(reset() this one first to free its graphs)."
            )
        changed = []
        for i, (group, lr, baked) in enumerate(zip(groups, self.lrs, self.baked)):
            if lr is not None and group["lr"] is not lr:
                self._take_lr(i, group, lr)
            changed.extend(
                f"param_groups[{i}]['{k}']: captured {v!r}, now {group.get(k)!r}"
                for k, v in baked
                if group.get(k) is not v and not _same(group.get(k), v)
            )
        if changed:
            raise CudaGraphsStateError(
                "optimizer hyperparameters changed after the step was captured, and the "
                "graph holds the captured values: " + "; ".join(changed) + ". Fixes: "
                "1. change only the learning rate (schedulers write it in place); "
                "2. for OneCycleLR/CyclicLR pass cycle_momentum=False; "
                "3. call reset() and graph the step again with the new values."
            )

    def _take_lr(self, i: int, group: dict, lr: torch.Tensor) -> None:
        value = group["lr"]
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise CudaGraphsStateError(
                f"param_groups[{i}]['lr'] was replaced by a tensor of {value.numel()} "
                "elements; set a number or fill_ the existing learning rate"
            )
        _load_into(lr, value)
        group["lr"] = lr


def _load_into(tensor: torch.Tensor, value: Any) -> None:
    """Write a loaded value into a captured tensor: a tensor is copied (reshaped to the
    captured shape: a one-element learning rate saved as a number or a 0-dim tensor),
    a number fills, ``None`` (no such state saved: fresh) zeroes."""
    if isinstance(value, torch.Tensor):
        tensor.copy_(value.reshape(tensor.shape))
    elif value is None:
        tensor.zero_()
    else:
        tensor.fill_(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # identity was checked; tensors are compared by identity only
    try:
        return bool(a == b)
    except Exception:
        # A value whose == is not a bool (a numpy array of several elements): compare
        # what it prints, so that an untouched one is not reported as changed.
        return repr(a) == repr(b)


@dataclass
class StateKeeper:
    """Keeps the optimizer on the tensors the graph reads across
    ``optimizer.load_state_dict``.

    torch's ``load_state_dict`` builds new state tensors and new groups; the graph
    would go on updating the old ones, silently. A post-load hook copies the loaded
    values into the captured tensors (zeros where the loaded state has none, as for a
    state saved before the first step) and puts them back into ``optimizer.state``;
    in each group it does the same for every hyperparameter held as a tensor (the
    device learning rate), and puts back the prepared implementation flags. Other
    loaded hyperparameters are checked by the :class:`HyperparameterGuard` at the
    next step.
    """

    optimizer: torch.optim.Optimizer
    tensors: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
    group_tensors: list[dict[str, torch.Tensor]]
    settings: list[dict[str, Any]]
    handle: Any = None

    @classmethod
    def install(cls, optimizer: torch.optim.Optimizer) -> StateKeeper:
        tensors = [(p, _state_tensors(optimizer, p)) for p in _params(optimizer)]
        groups = optimizer.param_groups
        group_tensors = [
            {k: v for k, v in g.items() if isinstance(v, torch.Tensor)} for g in groups
        ]
        keys = ("capturable", "fused", "foreach")
        settings = [{k: g[k] for k in keys if k in g} for g in groups]
        keeper = cls(optimizer, tensors, group_tensors, settings)
        keeper.handle = optimizer.register_load_state_dict_post_hook(keeper._after_load)
        return keeper

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, captured in self.tensors:
                loaded = optimizer.state.get(p, {})
                for key, tensor in captured.items():
                    _load_into(tensor, loaded.get(key))
                if captured:
                    optimizer.state[p].update(captured)
            for group, ours, settings in zip(
                optimizer.param_groups, self.group_tensors, self.settings
            ):
                group.update(settings)
                for key, tensor in ours.items():
                    if group.get(key) is not tensor:
                        _load_into(tensor, group.get(key))
                        group[key] = tensor

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
