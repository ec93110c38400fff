"""``make_graphed_callables``: canonicalize -> schedule -> warmup -> capture -> wrap."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..capture import as_graph_pool
from ..capture_state import capture_scope
from ..checks import check_callable, check_optimizers, require_cuda
from ..compile_watch import CompileWatch, check_warmup, require_no_compile, warn_failed_compiles
from ..errors import CudaGraphCaptureError, CudaGraphsValueError
from ..forward_swap import swap_forward
from ..memory import MemoryMeter, tensor_bytes
from ..moe_kernels import check_grouped_mm_experts
from ..optimizer_state import compact_before_capture
from ..settings import DISABLE_ENV, graphs_disabled
from .canonicalize import GraphPlan, canonicalize, check_devices
from .capture_phase import (
    CaptureOptions,
    capture_plan,
    check_entry_indices,
    check_unreached_outputs,
    eager_entry_graphs,
)
from .deferred_grads import defers_owned_copies
from .grad_targets import GradTargets, prepare_grad_targets
from .graphed import GraphedCallable
from .runtime import EntryGraphs, SetupSeconds
from .sharing import BufferSharing, check_sharing
from .te_compat import check_fifth_argument, check_quantization_off
from .warmup import run_warmup

__all__ = ["make_graphed_callables"]

logger = logging.getLogger(__name__)

HookMap = Mapping[str, Mapping[Hashable, Callable[[Any], None]]]


def _install_on_module(module: torch.nn.Module, graphed: GraphedCallable) -> None:
    """Swap ``module.forward`` for the graphed one; ``reset()`` swaps it back."""

    def graphed_forward(*args: Any, **kwargs: Any) -> Any:
        return graphed(*args, **kwargs)

    swap = swap_forward(module, graphed_forward)

    def restore() -> None:
        swap.restore()
        module.__dict__.pop("cuda_graph", None)
        if module.__dict__.get("reset") == graphed.reset:  # bound methods compare by ==
            del module.__dict__["reset"]

    graphed.bind_forward_swap(swap.original, restore)
    module.cuda_graph = graphed
    # reset() on the module, as on a graphed function, unless the class already uses
    # the name (then module.cuda_graph.reset() is the way).
    if not hasattr(type(module), "reset") and "reset" not in module.__dict__:
        module.reset = graphed.reset


def _grad_targets(plan: GraphPlan, attr: str | None) -> tuple[GradTargets | None, ...]:
    """Per callable, its in-graph accumulation targets (None: no parameters, or no
    backward graphs are captured)."""
    if not plan.training:
        return ()
    return tuple(
        prepare_grad_targets(c.name, c.params, c.param_names, attr or "grad") if c.params else None
        for c in plan.callables
    )


def _wrap(plan: GraphPlan, entry_graphs: list[EntryGraphs]) -> list[Any]:
    one_entry_per_callable = plan.layout.num_microbatches == 1
    results = []
    for spec, g in zip(plan.entries, entry_graphs):
        target = plan.callables[spec.entry.callable_index]
        graphed = GraphedCallable(
            g,
            eager=target.fn,
            module=target.module,
            captured_training=plan.module_training,
        )
        if target.module is not None and one_entry_per_callable:
            _install_on_module(target.module, graphed)
            # Under _order the graphed callable, as Transformer Engine returns: callers
            # such as Megatron's TECudaGraphHelper store it and call it from the layer's
            # own __call__, which the module itself would re-enter.
            results.append(graphed if plan.layout.order is not None else target.module)
        else:
            results.append(graphed)
    return results


def _eager_results(plan: GraphPlan, main_grad_attr: str | None) -> Any:
    """``CUDAGRAPHS_DISABLE``: the same results, validating every call against the
    samples as replays do, but running the callables eagerly. Nothing is warmed up or
    captured, so no hook runs."""
    logger.warning(
        "%s is set: make_graphed_callables captures nothing; its %d result(s) check each "
        "call against sample_args and run eagerly",
        DISABLE_ENV,
        len(plan.entries),
    )
    if main_grad_attr is not None:
        _grad_targets(plan, main_grad_attr)  # the same argument checks
        logger.warning(
            "%s: gradients go to .grad, as eager autograd puts them, not to %r",
            DISABLE_ENV,
            main_grad_attr,
        )
    entry_graphs = [eager_entry_graphs(plan, i) for i in range(len(plan.entries))]
    results = _wrap(plan, entry_graphs)
    return results[0] if plan.single else tuple(results)


def make_graphed_callables(
    modules: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Any = None,
    enabled: Any = None,
    calibrating: bool | None = None,
    recipe: Any = None,
    amax_reduction_group: Any = None,
    cache_quantized_params: bool | None = None,
    _order: Sequence[int] | None = None,
    _num_layers_per_chunk: Sequence[int] | None = None,
    pool: Any = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    *,
    fp8_enabled: Any = None,
    fp8_calibrating: bool | None = None,
    fp8_recipe: Any = None,
    fp8_group: Any = None,
    fp8_weight_caching: bool | None = None,
    clone_param_grads_on_return: bool = True,
    pre_warmup_hook: Callable[[], Any] | None = None,
    post_warmup_hook: Callable[[], Any] | None = None,
    capture_time_hooks: Sequence[HookMap | None] | None = None,
    accumulate_grads_in_graph: bool = False,
    main_grad_attr: str | None = None,
    optimizers: Any = (),
    _buffer_sharing: BufferSharing | None = None,
    _unreached_outputs: Mapping[int, Iterable[int]] | None = None,
    _owned_outputs: Iterable[int] = (),
    _release_cache: bool = True,
) -> Any:
    """Graph modules or functions: forward (and in training backward) CUDA graphs,
    replayed behind an autograd node.

    The parameters are Transformer Engine's, in its positional order (the first
    fifteen), so code written for ``transformer_engine.pytorch.make_graphed_callables``
    runs unchanged as long as quantization is off; the parameters after
    ``_reuse_graph_input_output_buffers`` are keyword-only, so no positional call can
    land in the wrong one. ``is_graph_capturing()`` (ours, and Transformer Engine's
    when TE is imported) is true during warmup and capture.

    Args:
        modules: one callable, or a tuple of them: ``nn.Module`` s or functions. Under
            ``_order``, the layers of every chunk, chunk by chunk.
        sample_args: per entry, a tuple of arguments (a single tuple when one callable
            is passed). Tensor leaves (nested in lists, tuples, dicts) become graph
            inputs; other leaves are constants every call must repeat. Under ``_order``
            one entry per (chunk, microbatch, layer), ordered by chunk, then
            microbatch, then layer.
        num_warmup_iters: eager iterations of the whole schedule before capture.
        allow_unused_input: allow inputs/parameters that require grad but are not used
            (their gradient is ``None``); otherwise that is a ``ValueError``.
        sample_kwargs: per entry, a dict of keyword arguments (tensors are graph
            inputs). Fifth, as in Transformer Engine; torch's helper has ``pool``
            there, and a pool passed fifth is refused with that explanation.
        enabled, calibrating, recipe, amax_reduction_group, cache_quantized_params:
            Transformer Engine 2.x's quantization arguments, accepted while they leave
            quantization off (``enabled`` and ``calibrating`` false or ``None``; the
            others are then ignored). Their Transformer Engine 1.x names
            ``fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group,
            fp8_weight_caching`` are accepted as keywords (positionally they are the
            same five slots).
        _order: interleaved pipeline schedule: 1-based chunk ids, positive for the
            forward of the chunk's next microbatch, negative for its backward.
        _num_layers_per_chunk: layers per chunk under ``_order`` (default: even split).
        pool: the memory pool to capture into, shared by all graphs made here: a
            :class:`~cudagraphs.GraphMemoryPool`, ``torch.cuda.graph_pool_handle()`` (or
            Transformer Engine's), a ``torch.cuda.MemPool``, or a
            :class:`~cudagraphs.CudaGraphPool` (its scratch pool); a new one when
            ``None``.
        retain_graph_in_backward: capture the backward with ``retain_graph=True``
            (keeps the forward's saved tensors alive, costing memory).
        _reuse_graph_input_output_buffers: under ``_order`` in training, microbatches
            of a layer whose forward-to-backward lifetimes do not overlap share static
            input and incoming-gradient buffers.
        clone_param_grads_on_return: Transformer Engine 2.20's parameter (TE PR 2937),
            with its default and meaning. ``True``: every parameter gradient a backward
            replay hands to autograd is owned, so a gradient that a tensor hook, a
            variable or ``.grad`` keeps is never overwritten by a later replay. By
            default (``CUDAGRAPHS_OWNED_GRADS=defer``) the replay hands out the
            graph's buffers and copies out only what is still kept when a replay
            would overwrite it (:mod:`cudagraphs.core.deferred_grads`); with
            ``CUDAGRAPHS_OWNED_GRADS=copy`` every one is copied, in one fused launch
            per replay.
            ``False`` lends the buffers instead (no copy), for loops that consume the
            gradients at once: ``zero_grad(set_to_none=True)``, backward, ``step()``.
            Risk, as TE states it: a later replay overwrites a lent gradient that is
            kept past it (a hook's argument, a reference to ``.grad``). What stays
            exact in lent mode: ``.grad`` itself, also when gradients accumulate over
            backward passes (a ``.grad`` that still is a buffer is moved to an owned
            copy before the replay that would overwrite it), and
            ``torch.autograd.grad()``, which always gets owned copies. Leaf tensors
            passed as arguments (parameters among them) get an owned copy when their
            ``.grad`` is ``None``, a view otherwise, in both modes.
        pre_warmup_hook, post_warmup_hook: called with no arguments once before and
            once after the whole warmup phase.
        capture_time_hooks: one entry per callable, ``None`` or a dict with any of
            ``forward_pre_hooks``, ``forward_hooks``, ``backward_pre_hooks``,
            ``backward_hooks``, each ``{hook_id: fn(module) -> None}``. They run around
            every warmup and capture forward/backward of that callable, outside the
            capture context, and never on replay.
        accumulate_grads_in_graph: the backward graphs add the gradients of the
            modules' own parameters (not of tensors passed as arguments, parameters
            included) into pre-allocated tensors themselves (one multi-tensor add inside the
            graph), instead of handing them to autograd, which launches one
            accumulation kernel per parameter outside the graph. The targets are each
            parameter's ``.grad`` (allocated as zeros when ``None``) or, with
            ``main_grad_attr``, that attribute (Megatron-style fp32 ``main_grad``;
            it must exist). Every backward replay checks that the parameters still
            hold those very tensors: a ``.grad`` set to ``None`` by
            ``zero_grad(set_to_none=True)`` is zeroed and bound again; a replaced
            tensor raises :class:`~cudagraphs.errors.CudaGraphInputError`. Gradient
            hooks on these parameters (``register_post_accumulate_grad_hook``, DDP's
            reducer) do not fire for the graphed part of their gradients.
        main_grad_attr: with ``accumulate_grads_in_graph``, the parameter attribute
            to accumulate into instead of ``.grad``.
        optimizers: an optimizer, or a tuple of them, that has stepped eagerly over
            the graphed parameters before this call (graphing after eager steps).
            After the release of the unused cache and before the warmup, the state
            they made in the holes the eager steps' activations left is packed into
            one buffer per dtype and its old segments go back to the driver
            (:mod:`cudagraphs.optimizer_state`; the state keeps its identity and
            values). Without it those segments stay pinned by the state beside the
            pool (``docs/memory.md``). State of a ``capturable=True`` optimizer is
            left alone, and ``CUDAGRAPHS_COMPACT_STATE=0`` or
            ``CUDAGRAPHS_KEEP_CACHE=1`` turns packing off.
        _buffer_sharing: static buffers the entries share beyond the pool
            (:class:`~cudagraphs.core.sharing.BufferSharing`: incoming-gradient
            buffers of equal shapes, inputs that are an earlier entry's output); for
            layers replayed in capture order each step, as partial graphs' are. Not
            with ``_reuse_graph_input_output_buffers``.
        _unreached_outputs: per entry index, the positions among its tensor outputs
            that no backward reaches (an HF model's logits beside its loss, as partial
            graphs' recorded step sees): their backward graph gets no incoming-gradient
            buffer for them and does not read one, and a backward that reaches one
            raises :class:`~cudagraphs.errors.UncapturedGradientError`
            (:func:`~cudagraphs.core.capture_phase.check_unreached_outputs`).
        _owned_outputs: the entry indices whose callers own their tensor outputs: a
            later replay never changes an output the caller keeps (a whole model's
            logits and loss, as partial graphs' ``"model"`` scope hands them out). In
            a pool of this call's own they are handed out as the static outputs and
            moved out only when still referenced at a replay that could overwrite
            them (:mod:`~cudagraphs.core.deferred_grads`); otherwise copied per replay.
        _release_cache: give the unused cache back before the warmup, pack the state
            of ``optimizers``, and make the eager cuBLAS workspaces again
            (:meth:`~cudagraphs.memory.MemoryMeter.start`).
            ``False`` for a caller that releases around its captures itself and
            decides whether eager workspaces are worth making (partial graphs: none
            under the ``"model"`` scope, where no eager matmul is left).

    Returns:
        One result per entry (a single one when one callable was passed). A module
        with one entry gets its ``forward`` replaced by one that replays when
        ``module.training`` equals its flag at capture and runs eagerly otherwise
        (``module.cuda_graph`` is its :class:`GraphedCallable`), and is returned
        itself; under ``_order`` its :class:`GraphedCallable` is returned, as
        Transformer Engine does. Everything else is a :class:`GraphedCallable`. Each
        has ``reset()`` to release its graphs. Outputs are borrowed (overwritten by
        the next replay of that entry). A call may add keywords the samples did not
        have where they change nothing, as Transformer Engine's replay ignores them:
        a keyword the callable declares with default ``None``, passed as ``None``, and
        ``is_first_microbatch`` (TE's FP8 weight-caching flag); any other uncaptured
        keyword is a :class:`~cudagraphs.errors.CudaGraphInputError`.

    Raises:
        CudaGraphsTypeError, CudaGraphsValueError: bad arguments, before any GPU work
            (the message names the argument).
        QuantizationNotSupportedError: Transformer Engine's quantization turned on.
        NoCudaDeviceError: torch finds no usable CUDA device.
        CaptureTimeHookError: a capture-time hook returned a value.
        CudaGraphCaptureError: a capture failed; graphs captured so far are released
            and the pool and stream stay usable.

    Replay contract: graphs share one pool, so replay them in the order they were
    captured (the schedule): forwards in order, backwards in reverse order, or the
    ``_order`` schedule. Only one host thread may replay a given graph at a time.
    """
    check_fifth_argument(sample_kwargs)
    check_quantization_off(
        {
            "enabled": enabled,
            "calibrating": calibrating,
            "recipe": recipe,
            "amax_reduction_group": amax_reduction_group,
            "cache_quantized_params": cache_quantized_params,
        },
        {
            "fp8_enabled": fp8_enabled,
            "fp8_calibrating": fp8_calibrating,
            "fp8_recipe": fp8_recipe,
            "fp8_group": fp8_group,
            "fp8_weight_caching": fp8_weight_caching,
        },
    )
    for name, hook in (
        ("pre_warmup_hook", pre_warmup_hook),
        ("post_warmup_hook", post_warmup_hook),
    ):
        if hook is not None:
            check_callable(name, hook)
    graph_pool = as_graph_pool(pool)
    plan = canonicalize(
        modules,
        sample_args,
        sample_kwargs=sample_kwargs,
        num_warmup_iters=num_warmup_iters,
        capture_time_hooks=capture_time_hooks,
        order=_order,
        num_layers_per_chunk=_num_layers_per_chunk,
        reuse_buffers=_reuse_graph_input_output_buffers,
    )
    if main_grad_attr is not None and not accumulate_grads_in_graph:
        raise CudaGraphsValueError("main_grad_attr needs accumulate_grads_in_graph=True")
    if main_grad_attr is not None and not (
        isinstance(main_grad_attr, str) and main_grad_attr.isidentifier()
    ):
        raise CudaGraphsValueError(
            f"main_grad_attr must be an attribute name, got {main_grad_attr!r}"
        )
    sharing = check_sharing(_buffer_sharing, len(plan.entries), ordered=_order is not None)
    unreached = check_unreached_outputs(_unreached_outputs, len(plan.entries))
    owned_outputs = check_entry_indices(_owned_outputs, len(plan.entries), "_owned_outputs")
    if sharing is not None and plan.buffer_slots is not None:
        raise CudaGraphsValueError(
            "_buffer_sharing and _reuse_graph_input_output_buffers both decide which "
            "entries share buffers; pass one of them"
        )
    packed = check_optimizers("optimizers", optimizers)
    require_cuda("make_graphed_callables")
    device = check_devices(plan)
    if graphs_disabled():
        return _eager_results(plan, main_grad_attr)
    # Before any warmup: float32 grouped_mm experts sync with the host (moe_kernels).
    modules = [(c.name, c.module) for c in plan.callables if c.module is not None]
    check_grouped_mm_experts(modules, "make_graphed_callables")
    grad_targets = _grad_targets(plan, main_grad_attr) if accumulate_grads_in_graph else ()
    with torch.cuda.device(device), capture_scope():
        # Inside a fresh pool the warmup runs on the capture stream with its memory in
        # the pool, which the captures then reuse; otherwise on the warmup stream
        # (GraphMemoryPool.warmup_scope). Either way the cuBLAS workspace the graphs use is
        # inside the pool (GraphMemoryPool.capture_stream).
        stream = graph_pool.capture_stream(device)
        # Before the pool grows: the eager steps' state, packed, gives its fragmented
        # segments back under the peak those steps set (after the release, before the
        # eager workspaces are made again).
        meter = MemoryMeter.start(
            device,
            release="make_graphed_callables" if _release_cache else None,
            pack=lambda: compact_before_capture(packed, device.index, "make_graphed_callables")[1],
        )
        t0 = time.perf_counter()
        with graph_pool.warmup_scope(device):
            compiled, last = run_warmup(
                plan,
                num_warmup_iters,
                allow_unused_input=allow_unused_input,
                pre_warmup_hook=pre_warmup_hook,
                post_warmup_hook=post_warmup_hook,
                device_index=device.index,
                unreached=unreached,
            )
        t1 = time.perf_counter()
        # Compiled callables: the captures must run code compiled before them
        # (cudagraphs.compile_watch).
        check_warmup(compiled, last, "make_graphed_callables", "the last warmup iteration", logger)
        opts = CaptureOptions(
            pool=graph_pool,
            stream=stream,
            allow_unused_input=allow_unused_input,
            retain_graph_in_backward=retain_graph_in_backward,
            clone_param_grads_on_return=clone_param_grads_on_return,
            grad_targets=grad_targets,
            sharing=sharing,
            unreached=unreached,
            # Only in a pool of this call's own: every graph in it moves what it would
            # overwrite (.deferred_grads); a pool passed in may hold graphs that do not.
            defer_owned_copies=pool is None and defers_owned_copies(),
            owned_outputs=owned_outputs,
        )
        watch = CompileWatch.start(device.index)
        try:
            entry_graphs = capture_plan(plan, opts)
        except CudaGraphCaptureError as exc:
            # A compile inside a capture is the likelier cause: say it.
            require_no_compile(watch.finish(), "the captures", "make_graphed_callables", exc)
            raise
        during = watch.finish()
        # A frame dynamo gave up on during the captures ran eagerly there: the graphs
        # hold its eager kernels, correct, and it is said like one given up in warmup.
        warn_failed_compiles(during, "make_graphed_callables", logger)
        if during.compiled:
            for graphs in entry_graphs:
                graphs.release()
            require_no_compile(during, "the captures", "make_graphed_callables")
        static = tensor_bytes(t for graphs in entry_graphs for t in graphs.static_tensors())
        memory = meter.finish(
            graph_pool.handles(), what="make_graphed_callables", static_bytes=static
        )
        setup = SetupSeconds(
            warmup=t1 - t0,
            compile=compiled.seconds,
            capture=time.perf_counter() - t1,
            compiled_frames=len(compiled.compiled),
        )
        for graphs in entry_graphs:
            graphs.memory = memory
            graphs.setup = setup
        logger.info(
            "graphed %d entries (%d steps): warmup %.3fs (compiling %.3fs), capture %.3fs; "
            "memory: %s",
            len(entry_graphs),
            len(plan.schedule),
            setup.warmup,
            setup.compile,
            setup.capture,
            memory.summary(),
        )
    results = _wrap(plan, entry_graphs)
    return results[0] if plan.single else tuple(results)
