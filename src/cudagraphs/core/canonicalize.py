"""Turn the user's arguments to ``make_graphed_callables`` into a validated plan.

Every check that can be made before any GPU work is made here, so a bad argument
fails fast with a message naming the callable, entry and argument path, and so the
checks are tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..checks import check_int
from ..errors import CudaGraphsTypeError, CudaGraphsValueError
from ..torch_private import compiled_module
from .graphed import GraphedCallable
from .hooks import CaptureTimeHooks, canonicalize_capture_time_hooks
from .schedule import Entry, Layout, Step, assign_buffer_slots, build_layout, build_schedule

__all__ = ["CallableSpec", "EntrySpec", "GraphPlan", "canonicalize", "check_devices"]


@dataclass
class CallableSpec:
    """One callable passed in (a module or a function)."""

    index: int
    fn: Callable[..., Any]
    module: torch.nn.Module | None
    name: str
    params: tuple[torch.nn.Parameter, ...]  # graph inputs besides the user's tensors
    param_names: tuple[str, ...] = ()  # qualified names of ``params`` (for messages)
    # (name, parameter) of the module's parameters frozen (no requires_grad) at
    # capture: no graph computes their gradient, so unfreezing one must be said.
    frozen: tuple[tuple[str, torch.nn.Parameter], ...] = ()


@dataclass
class EntrySpec:
    """One ``sample_args`` element: the call that one graphed callable stands for."""

    entry: Entry
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    in_spec: pytree.TreeSpec  # structure of (args, kwargs)
    leaves: list[Any]  # flattened (args, kwargs): tensors and constants
    tensor_positions: tuple[int, ...]  # which leaves are tensors (graph inputs)
    paths: tuple[str, ...]  # per leaf, its path in (args, kwargs), e.g. "[0][1]['mask']"

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_positions]

    def input_key(self) -> tuple:
        """What two entries must share to share static input buffers."""
        return (
            self.entry.callable_index,
            tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in self.tensors),
        )


@dataclass
class GraphPlan:
    """Everything ``make_graphed_callables`` decided before touching the GPU."""

    callables: list[CallableSpec]
    entries: list[EntrySpec]
    layout: Layout
    schedule: list[Step]
    hooks: list[CaptureTimeHooks]
    training: bool  # capture backward graphs too
    module_training: bool | None  # the modules' .training at capture (None: no modules)
    single: bool  # one callable was passed (not a tuple): return one result
    buffer_slots: list[int] | None = field(default=None)  # reuse mode: slot per entry

    def callable_of(self, entry_index: int) -> CallableSpec:
        return self.callables[self.entries[entry_index].entry.callable_index]


def _name_of(index: int, fn: Any) -> str:
    kind = (
        type(fn).__name__
        if isinstance(fn, torch.nn.Module)
        else getattr(fn, "__qualname__", type(fn).__name__)
    )
    return f"callables[{index}] ({kind})"


def _registered_module_hooks(module: torch.nn.Module) -> list[str]:
    found = []
    for sub_name, sub in module.named_modules():
        for attr in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_backward_pre_hooks",
            "_backward_hooks",
        ):
            if len(getattr(sub, attr, {})):
                found.append(f"{sub_name or '<root>'}.{attr.strip('_')}")
    return found


def _refuse_buffers_requiring_grad(module: torch.nn.Module, name: str) -> None:
    # The backward graph computes gradients for the module's parameters and the inputs
    # that require grad; a buffer is neither, so its gradient would be silently dropped
    # (torch's and Transformer Engine's helpers refuse it too).
    found = [b for b, t in module.named_buffers() if t is not None and t.requires_grad]
    if found:
        raise CudaGraphsValueError(
            f"{name} has buffer(s) {found} with requires_grad=True; a graphed backward "
            "computes no gradient for buffers, so theirs would be dropped. Fixes: 1. make "
            "each a parameter (register_parameter / nn.Parameter) if it should train; 2. "
            "call .requires_grad_(False) on it if it should not."
        )


def _refuse_compiled_call(module: torch.nn.Module, name: str) -> None:
    # module.compile() compiles the module's __call__, which calls whatever forward the
    # module has: after capture that is the graphed forward installed on it, so dynamo
    # would trace every replay's Python (and record its side effects) instead of
    # running it. torch.compile(module) compiles only the forward that is replaced.
    if compiled_module(module) == "module.compile()":
        raise CudaGraphsValueError(
            f"{name} was compiled with module.compile(): its calls go through a compiled "
            "__call__, which would trace the graphed forward installed on it. Fixes: 1. "
            "graph a module that holds torch.compile(module) and calls it (its compiled "
            "forward and backward are captured); 2. graph the uncompiled module, if "
            "inductor's kernels are not needed inside the graph."
        )


def _refuse_graphed_again(module: torch.nn.Module, name: str) -> None:
    # Its forward is the graphed one: a warmup and capture in the same mode would run
    # the old graph's replays (refused for a new shape, recorded inside the new graph
    # for the same one). In the other mode the installed forward runs the module
    # eagerly, so a train graph and an eval graph of one module chain as intended.
    graphed = module.__dict__.get("cuda_graph")
    if (
        isinstance(graphed, GraphedCallable)
        and not graphed.graphs.released
        and graphed.captured_training == module.training
    ):
        mode = "training" if module.training else "eval"
        raise CudaGraphsValueError(
            f"{name} is graphed already in {mode} mode (module.cuda_graph), and its "
            "forward replays that graph. Fix: module.cuda_graph.reset() first, then "
            "graph it again (for new shapes, say)"
        )


def _canonical_callables(callables: Any) -> tuple[list[CallableSpec], bool]:
    single = not isinstance(callables, (tuple, list))
    items = (callables,) if single else tuple(callables)
    if not items:
        raise CudaGraphsValueError("make_graphed_callables needs at least one callable")
    specs = []
    seen: dict[int, int] = {}
    for i, fn in enumerate(items):
        if not callable(fn):
            raise CudaGraphsTypeError(
                f"callables[{i}] is a {type(fn).__name__}, not a module or function"
            )
        if id(fn) in seen:
            raise CudaGraphsValueError(
                f"callables[{i}] is the same object as callables[{seen[id(fn)]}]; each "
                "callable may appear once (use _order with microbatches to run a layer "
                "several times)"
            )
        seen[id(fn)] = i
        module = fn if isinstance(fn, torch.nn.Module) else None
        name = _name_of(i, fn)
        params: tuple[torch.nn.Parameter, ...] = ()
        param_names: tuple[str, ...] = ()
        frozen: tuple[tuple[str, torch.nn.Parameter], ...] = ()
        if module is not None:
            hooks = _registered_module_hooks(module)
            if hooks:
                raise CudaGraphsValueError(
                    f"{name} has registered module hooks ({', '.join(hooks)}); their Python "
                    "side effects would not run on replay. Remove them before graphing, or "
                    "move the work into capture_time_hooks."
                )
            _refuse_buffers_requiring_grad(module, name)
            _refuse_compiled_call(module, name)
            _refuse_graphed_again(module, name)
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            params = tuple(p for _, p in named)
            param_names = tuple(n for n, _ in named)
            frozen = tuple((n, p) for n, p in module.named_parameters() if not p.requires_grad)
        specs.append(
            CallableSpec(
                index=i,
                fn=fn,
                module=module,
                name=name,
                params=params,
                param_names=param_names,
                frozen=frozen,
            )
        )
    return specs, single


def _describe_path(keys: tuple) -> str:
    """Render a pytree key path of (args, kwargs) as ``args[0]['x']`` / ``kwargs['mask']``."""
    head, rest = keys[0], keys[1:]
    root = "args" if head.idx == 0 else "kwargs"
    return root + pytree.keystr(rest)


def _canonical_entry(entry: Entry, args: Any, kwargs: Any, callable_name: str) -> EntrySpec:
    where = f"sample_args[{entry.index}] (for {callable_name})"
    if not isinstance(args, (tuple, list)):
        raise CudaGraphsTypeError(
            f"{where} must be a tuple of arguments, got {type(args).__name__}"
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise CudaGraphsTypeError(
            f"sample_kwargs[{entry.index}] must be a dict, got {type(kwargs).__name__}"
        )
    # Keyword order is not part of a call's identity: sorted here and on every call.
    args, kwargs = tuple(args), dict(sorted(kwargs.items()))
    leaves_with_path, in_spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in leaves_with_path]
    positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    for i in positions:
        if leaves[i].layout != torch.strided:
            path = pytree.keystr(leaves_with_path[i][0])
            raise CudaGraphsValueError(
                f"{where}: tensor at {path} has layout {leaves[i].layout}; graph inputs "
                "must be dense (strided) tensors"
            )
    return EntrySpec(
        entry=entry,
        args=args,
        kwargs=kwargs,
        in_spec=in_spec,
        leaves=leaves,
        tensor_positions=positions,
        paths=tuple(_describe_path(p) for p, _ in leaves_with_path),
    )


def check_devices(plan: GraphPlan) -> torch.device:
    """All graph inputs must be CUDA tensors of one device; return that device.

    :func:`canonicalize` does not call it, so the rest of the validation runs (and is
    tested) on machines without a GPU.
    """
    devices: dict[torch.device, str] = {}
    for e in plan.entries:
        for pos in e.tensor_positions:
            t = e.leaves[pos]
            where = f"sample_args[{e.entry.index}] {e.paths[pos]}"
            if t.device.type != "cuda":
                raise CudaGraphsValueError(
                    f"{where} is on {t.device}; graph inputs must be CUDA tensors (.cuda())"
                )
            devices.setdefault(t.device, where)
    if len(devices) > 1:
        raise CudaGraphsValueError(
            f"graph inputs are spread over several devices: {devices}; use one"
        )
    if devices:
        return next(iter(devices))
    return torch.device("cuda", torch.cuda.current_device())


def _detect_training(
    callables: list[CallableSpec], entries: list[EntrySpec]
) -> tuple[bool, bool | None]:
    modules = [c for c in callables if c.module is not None]
    module_training = None
    if modules:
        flags = {c.module.training for c in modules}
        if len(flags) > 1:
            train = [c.name for c in modules if c.module.training]
            evals = [c.name for c in modules if not c.module.training]
            raise CudaGraphsValueError(
                f"callables mix training mode ({', '.join(train)}) and eval mode "
                f"({', '.join(evals)}); graph them with one mode, in separate calls"
            )
        module_training = flags.pop()
        training = module_training and torch.is_grad_enabled()
    else:
        training = torch.is_grad_enabled() and any(
            t.requires_grad for e in entries for t in e.tensors
        )
    return training, module_training


def _check_autocast() -> None:
    for device_type in ("cuda", "cpu"):
        try:
            enabled = torch.is_autocast_enabled(device_type)
        except TypeError:  # torch without the device_type argument
            enabled = torch.is_autocast_enabled()
        if enabled and torch.is_autocast_cache_enabled():
            raise CudaGraphsValueError(
                f"autocast ({device_type}) is enabled with its weight cache; cast weights "
                "cached during capture would be freed and replayed stale. Use "
                "torch.autocast(..., cache_enabled=False) around make_graphed_callables."
            )


def canonicalize(
    callables: Any,
    sample_args: Any,
    *,
    sample_kwargs: Any = None,
    num_warmup_iters: int = 3,
    capture_time_hooks: Sequence[Any] | None = None,
    order: Sequence[int] | None = None,
    num_layers_per_chunk: Sequence[int] | None = None,
    reuse_buffers: bool = False,
) -> GraphPlan:
    """Validate every argument of ``make_graphed_callables`` and build the plan.

    Raises:
        TypeError / ValueError: naming the argument, entry index and tree path.
    """
    check_int("num_warmup_iters", num_warmup_iters, minimum=0)
    specs, single = _canonical_callables(callables)
    if single:
        sample_args = (sample_args,)
        sample_kwargs = None if sample_kwargs is None else (sample_kwargs,)
    if not isinstance(sample_args, (tuple, list)):
        raise CudaGraphsTypeError(
            f"sample_args must be a tuple of tuples, got {type(sample_args).__name__}"
        )
    layout = build_layout(len(specs), len(sample_args), order, num_layers_per_chunk)
    if sample_kwargs is None:
        sample_kwargs = [None] * len(sample_args)
    if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != len(sample_args):
        got = (
            len(sample_kwargs)
            if isinstance(sample_kwargs, (tuple, list))
            else type(sample_kwargs).__name__
        )
        raise CudaGraphsValueError(
            f"sample_kwargs must hold one dict per sample_args entry ({len(sample_args)}), got {got}"
        )
    hooks = canonicalize_capture_time_hooks(capture_time_hooks, len(specs))
    _check_autocast()
    entries = [
        _canonical_entry(
            e, sample_args[e.index], sample_kwargs[e.index], specs[e.callable_index].name
        )
        for e in layout.entries()
    ]
    training, module_training = _detect_training(specs, entries)
    schedule = build_schedule(layout, training)
    slots = None
    if reuse_buffers:
        if order is None or not training:
            raise CudaGraphsValueError(
                "_reuse_graph_input_output_buffers needs _order and training (modules in "
                "train mode, grad enabled); drop it or pass _order"
            )
        slots = assign_buffer_slots(schedule, [e.input_key() for e in entries])
    return GraphPlan(
        callables=specs,
        entries=entries,
        layout=layout,
        schedule=schedule,
        hooks=hooks,
        training=training,
        module_training=module_training,
        single=single,
        buffer_slots=slots,
    )
