"""GraphedGenerator: a Hugging Face causal LM generating through the bucketed runner.

A request runs in two parts. The prefill writes the prompts into the shared static
cache (:mod:`.cache`): eagerly through the model, or, for prompts that fit a length
bucket, by replaying that bucket's graph of the model's kernels over the prompts
left-padded to it (:mod:`.prefill`; by default only when decoding through compiled
kernels, since padding changes the rounding). Then each decode step feeds the
batch's last tokens through :class:`~cudagraphs.serving.GraphRunner`: the tightest
bucket's graph replays over static ``input_ids [B, 1]``, ``position_ids [B, 1]`` and a
boolean ``attention_mask [B, max_cache_len]``; the cache is fixed-address state the
graph reads and writes, and its write counters advance inside the graph. The next token
is chosen outside the graph (:mod:`.sampling`), with HF's logits processors when
sampling.

What makes the tokens HF's: the prefill is the model's own forward with the arguments
HF's ``generate`` passes (positions from the mask, ``logits_to_keep=1``); the decode
step is the same forward at one token, and the mask the model builds from ours equals
the one HF builds from its growing mask (positions past the current one are hidden by
causality in both). At a batch that is exactly a bucket the kernels are HF's; a padded
batch runs the bucket's matmuls, whose rows agree to rounding. MoE experts whose grouped
GEMM would sync the host (float32 ``grouped_mm``) decode with ``batched_mm``, as HF's
``generate`` decodes them, the prefill keeping ``grouped_mm`` (:mod:`.experts`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from ...checks import check_bool, check_instance, check_int
from ...compile_watch import check_compile_options
from ...diagnostics import WarnOnce
from ...errors import CudaGraphCaptureError, CudaGraphsStateError, CudaGraphsTypeError
from ...settings import graphs_disabled
from ...stacking import (
    StackedGroups,
    check_stack_projections,
    stack_projections,
    with_stacked_projections,
)
from ...torch_private import (
    SubgraphSchemaMemo,
    mark_dynamic,
    memoized_subgraph_schemas,
    size_oblivious_shapes,
    start_compile_workers,
)
from ..buckets import Bucket, BucketConfig
from ..graphs import BucketBackend
from ..input_specs import InputSpec
from ..runner import GraphRunner
from .attention import check_sdpa_backends, sdpa_scope
from .cache import LayerShape, SharedStaticCache, cache_keyword, layer_shapes, static_layer_check
from .experts import DecodeExperts, decode_experts
from .gqa import PackedGqa
from .per_token import EndFlag, decode_loop
from .prefill import (
    DEFAULT_PREFILL_TOKENS,
    PrefillGraphs,
    check_prefill_lengths,
    check_prefill_tokens,
    default_prefill_lengths,
)
from .regions import check_compile_regions
from .requests import Request, check_request, inferred_mask, positions_from_mask
from .sampling import (
    Sampling,
    StopTokens,
    check_sampling_generator,
    sampling_rule,
    stop_tokens,
    vocab_size_of,
)
from .support import WeightAddresses, check_groups_in_place, check_supported
from .unapplied import warn_unapplied

__all__ = ["DEFAULT_GENERATE_BATCH_SIZES", "GraphedGenerator", "compiles_with_inductor"]

logger = logging.getLogger(__name__)

DEFAULT_GENERATE_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def compiles_with_inductor(compile_options: dict[str, Any] | None) -> bool:
    """Whether ``torch.compile(**compile_options)`` runs inductor (its default backend,
    or named); ``None`` compiles nothing."""
    if compile_options is None:
        return False
    return compile_options.get("backend", "inductor") == "inductor"


class GraphedGenerator:
    """Greedy and sampled generation of an HF causal LM, decode steps replayed from
    per-batch-size graphs.

    Workflow: ``GraphedGenerator(model, batch_sizes, max_cache_len=...)`` checks the
    model and allocates nothing; ``capture()`` allocates the static cache once (largest
    bucket x ``max_cache_len``) and captures a decode graph per bucket; ``generate(...)``
    returns token ids shaped like ``model.generate``'s; ``close()`` releases the graphs
    and the cache.

    It does NOT: run beam search, assisted decoding or streaming; apply the logits
    processors of ``model.generation_config`` other than temperature, top-k, top-p, the
    repetition penalty and the minimum lengths (bad words, n-grams, ...: a request
    under a config that sets them says so once at WARNING, naming them); support
    chunked- or linear-attention caches; let several threads share one generator.
    Sliding-window layers keep every position, the window applied by the mask
    (:mod:`.cache`): their tokens equal HF's, their cache costs ``max_cache_len`` as a
    full layer's does. Put the model in eval mode (as for ``generate``); its weights
    are read by the graphs in place, so they may be updated in place, not replaced (a
    request after a replacement is a ``CudaGraphsStateError`` naming the tensors).

    Args:
        model: a transformers causal LM (``AutoModelForCausalLM``) on a CUDA device
            whose static cache has only full-attention and sliding-window layers.
        batch_sizes: the decode buckets.
        max_cache_len: cache positions: the longest prompt plus ``max_new_tokens`` - 1
            any request may use.
        max_pad_ratio: a batch that would pad its bucket more runs eagerly.
        require_all_buckets, pool, capture_backend: as for :class:`GraphRunner`
            (``capture_backend`` replaces the CUDA capture; the CPU tests pass an eager
            stand-in).
        compile_options: decode through ``torch.compile(model, **compile_options)``:
            inductor's fused kernels are what the bucket graphs record, so fewer and
            shorter kernels per token. Costs one compile in :meth:`capture` for every
            bucket (tens of seconds for a large model): the batch dimension is dynamic
            from the first compile, and dynamo reasons about it without specializing a
            size of 1 (torch's ``backed_size_oblivious``, during capture only); a model
            whose code still specializes a size compiles once more for it. Greedy
            tokens then agree with HF's eager ones up to the rounding of fused kernels,
            not token for token. The prefill and batches above every bucket stay eager.
            Default ``None``: the model's own kernels, captured in about a second.
            Not the modes that record CUDA graphs of their own (``reduce-overhead``,
            ``max-autotune``).
        sdpa_backends: the attention kernels the decode graphs may record: every
            decode step through the runner's forward (warmups, compiles, captures, and
            a step run eagerly) and every prefill graph runs under
            ``torch.nn.attention.sdpa_kernel(sdpa_backends)``; an eager prefill does not.
            Default ``None``: with ``compile_options``, every backend but cuDNN's
            (:data:`~.attention.COMPILED_SDPA_BACKENDS`), which halves the compiled
            capture (one compile serves every bucket, the one-row bucket too) at up to
            4% more time per token at batch 1 and up to 11% at batch 8
            (:mod:`.attention` has the numbers); without, torch's own choice. Pass
            every backend, cuDNN's included, for torch's choice in a compiled capture.
        compile_regions: with ``compile_options``, compile one decoder layer's code for
            every layer (torch's hierarchical compilation, :mod:`.regions`): the decode
            step stays one graph of the whole model, and its layers share one compiled
            body. Default ``None``: on when compiling a model that declares two or more
            decoder layers (``_no_split_modules``) without biased projections; where
            torch still cannot compile them as one body, :meth:`capture` compiles the
            whole model instead (WARNING, ``stats()["compile_regions_error"]``).
            ``True``: required (a refusal or a capture error instead); ``False``: the
            whole model compiled as one, fusing across the layers' edges at a longer
            compile. With regions the shared cache holds one spare row
            (:class:`~.cache.SharedStaticCache`, ``spare_row``).
        prefill_lengths: prompt length buckets whose prefills replay graphs
            (:mod:`.prefill`): a request's prompts are left-padded to the shortest
            bucket that holds them, and its prefill replays that bucket's graph at the
            request's rows bucket, captured in :meth:`capture` with the model's
            kernels. Padding changes the kernels' rounding, not the attention, so the
            greedy tokens agree with an eager prefill's to rounding. Default ``None``:
            with ``compile_options``, powers of two from 16 to 512 that fit
            ``max_cache_len`` (:func:`~.prefill.default_prefill_lengths`); without,
            none (every prefill eager, the tokens HF's). ``()``: none. Prompts longer
            than every bucket, or that would not fit the cache once padded, prefill
            eagerly (``stats()["prefills"]`` counts both paths by cause).
        prefill_tokens: the most rows x length a prefill graph holds: a rows bucket
            above it has no prefill graph at that length (its activations' memory;
            a prefill that long is compute-bound anyway). Default 2048.
        stack_projections: with ``compile_options`` through inductor, make each group
            of sibling linears that read one input (q/k/v, gate/up) one GEMM in the
            decode step (:mod:`cudagraphs.stacking`): :meth:`capture` lays their weights back to
            back in one buffer per group, each ``Parameter`` the same object viewing
            its rows (memory not doubled; in-place updates still reach the graphs),
            and they stay so after :meth:`close` (``stacked.unstack()`` gives them
            memory of their own; the next request then says the graphs are stale).
            Capture this generator before any other graphs of the same model: those
            would read the weights' old memory. Default ``None``: on where inductor
            compiles and ``compile_options`` set no ``post_grad_custom_pre_pass``;
            ``True`` requires that; ``False``: off.
        pack_gqa: read each key/value head's group of query heads as that head's rows
            in the decode step's attention (:mod:`.gqa`), so the graphs never copy the
            cache to repeat its heads (HF's compiled SDPA attention does, every layer
            and step). The same attention over the same cache; the kernel sees fewer
            heads with more rows. Only one-token steps of grouped heads with SDPA's
            plain options are packed, every other call goes to transformers' own.
            Default ``None``: off (on an H100 it decodes faster, but the decoder layers
            then compiled apart and the cold capture doubled: docs/serving-hf.md);
            ``True``: on, where
            with ``compile_options`` the compiled kernels set the tokens' rounding
            anyway, and without it the graphs record the packed attention in place of
            HF's eager one (the same math, another kernel shape).

    Raises:
        CudaGraphsTypeError: ``model`` not an ``nn.Module`` with a ``config``.
        CudaGraphsValueError: bad ``batch_sizes``, ``max_cache_len`` or ratio,
            ``compile_options`` whose mode records CUDA graphs of its own, or
            ``sdpa_backends`` empty or holding ``SDPBackend.ERROR``, or
            ``compile_regions=True`` without ``compile_options`` or decoder layers,
            ``prefill_lengths`` repeated or longer than ``max_cache_len``,
            ``prefill_tokens`` below 1 or below a length times the smallest batch size, or ``stack_projections=True`` where inductor
            does not compile or its post-grad pass is taken.
        CudaGraphsTypeError: ``pack_gqa`` neither a bool nor ``None``.
        UnsupportedModelError: an encoder-decoder or stateful model, a model HF does not
            mark as graph-safe (``_can_compile_fullgraph``), a cache with other layers
            than full attention and sliding windows (chunked or linear attention), or
            MoE experts with host-side shapes (the fix is named).
    """

    def __init__(
        self,
        model: nn.Module,
        batch_sizes: Sequence[int] = DEFAULT_GENERATE_BATCH_SIZES,
        *,
        max_cache_len: int,
        max_pad_ratio: float | None = None,
        require_all_buckets: bool | None = None,
        pool: Any = None,
        capture_backend: BucketBackend | None = None,
        compile_options: Mapping[str, Any] | None = None,
        sdpa_backends: Sequence[SDPBackend] | None = None,
        compile_regions: bool | None = None,
        prefill_lengths: Sequence[int] | None = None,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        stack_projections: bool | None = None,
        pack_gqa: bool | None = None,
    ) -> None:
        check_instance("model", model, nn.Module, "a transformers causal LM (nn.Module)")
        if getattr(model, "config", None) is None:
            raise CudaGraphsTypeError(
                f"model must be a transformers causal LM with a config, got "
                f"{type(model).__name__} without one"
            )
        self.max_cache_len = check_int("max_cache_len", max_cache_len, minimum=2)
        check_supported(model)
        self.compile_options = check_compile_options("GraphedGenerator", compile_options)
        self.sdpa_backends = check_sdpa_backends(sdpa_backends, compile_options is not None)
        self._regions = check_compile_regions(compile_regions, model, compile_options is not None)
        self._regions_required = compile_regions is True
        self._regions_compiled = False  # a decode step has compiled them
        #: Why the layers could not share one compiled body at capture (None: they did,
        #: or were not asked to).
        self.compile_regions_error: str | None = None
        self.subgraph_schemas: SubgraphSchemaMemo | None = None
        self.model = model
        # Only the model is compiled: the decode step's own work (looking the bucket's
        # cache up, slicing the logits) stays outside the traced code, so one traced
        # forward serves every bucket, with the batch size as a dynamic dimension.
        self._step_model: Callable[..., Any] = model
        self._stack = check_stack_projections(stack_projections, self.compile_options)
        #: The decode steps' attention with grouped heads packed (None: off).
        packing = pack_gqa is not None and check_bool("pack_gqa", pack_gqa)
        self.packed_gqa = PackedGqa() if packing else None
        #: The projection groups laid back to back at capture (empty: none).
        self.stacked = StackedGroups()
        if compile_options is not None:
            traced = model if self._regions is None else self._own_regional_forward()
            self._step_model = torch.compile(traced, **self._compile_keywords())
        self.layers = static_layer_check(model, self.max_cache_len)
        self.device = next(model.parameters()).device
        self._cache_keyword = cache_keyword(model)
        params = inspect.signature(model.forward).parameters
        self._logits_to_keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.config = BucketConfig(batch_sizes, max_pad_ratio=max_pad_ratio)
        if prefill_lengths is None:
            prefill_lengths = (
                default_prefill_lengths(self.max_cache_len) if compile_options is not None else ()
            )
        #: The prompt length buckets whose prefills replay graphs (sorted; () for none).
        self.prefill_lengths = check_prefill_lengths(prefill_lengths, self.max_cache_len)
        self.prefill_tokens = check_int("prefill_tokens", prefill_tokens, minimum=1)
        check_prefill_tokens(self.prefill_lengths, self.config, self.prefill_tokens)
        self._require_all_buckets = require_all_buckets
        self._capture_backend = capture_backend
        #: The prefill graphs of the last capture (None before capture and after close).
        self.prefill: PrefillGraphs | None = None
        rows = self.config.largest.rows
        specs = [
            InputSpec("input_ids", (rows, 1), torch.long),
            InputSpec("position_ids", (rows, 1), torch.long),
            # Padding rows attend to every position: finite junk, never NaN.
            InputSpec("attention_mask", (rows, self.max_cache_len), torch.bool, pad_value=True),
        ]
        self.runner = GraphRunner(
            self._decode,
            specs,
            self.config,
            device=self.device,
            require_all_buckets=require_all_buckets,
            pool=pool,
            capture_backend=capture_backend,
            compiled_inside=compile_options is not None,
        )
        self.kv: SharedStaticCache | None = None
        #: Requests per path: "graphs" (decode through the runner) and "too_large".
        self.requests: Counter[str] = Counter()
        #: Prefills per path: "graphs" (replayed), or the cause of an eager one.
        self.prefills: Counter[str] = Counter()
        self.tokens = 0
        self._ended: EndFlag | None = None
        self._weights = WeightAddresses((), ())  # taken at capture
        self._experts = DecodeExperts()  # decided at capture
        self._warn = WarnOnce(logger)

    # ---- capture ---------------------------------------------------------------------
    def capture(
        self,
        *,
        warmup: int = 2,
        plan_memory: bool = False,
        free_bytes: int | None = None,
        headroom_bytes: int = 0,
        progress: bool | None = None,
    ) -> None:
        """Allocate the shared static cache and capture a decode graph per bucket.

        Args:
            warmup: eager decode steps before the first bucket's capture (later buckets
                run one: :meth:`GraphRunner.capture`; with ``compile_options`` every
                bucket runs ``warmup``, its shape compiling in the first).
            plan_memory, free_bytes, headroom_bytes: capture only the buckets that fit
                (:meth:`GraphRunner.capture`); the cache is allocated first, so the plan
                sees the memory left beside it. The prefill graphs are planned after the
                decode graphs, against what they left (of ``free_bytes`` when given).
            progress: a tqdm bar over the buckets when tqdm is installed (``None``: when
                stderr is a terminal; ``False``: never). An INFO line per bucket is
                logged either way.

        Raises:
            CudaGraphsStateError: captured already (``close()`` first).
            UnsupportedModelError: MoE experts whose grouped GEMM would sync the host
                (float32 ``grouped_mm``) where HF's generate would not decode them with
                ``batched_mm`` (:mod:`.experts`); raised before anything is allocated,
                naming the experts and the fixes.
        """
        if self.runner.captured is not None:
            raise CudaGraphsStateError(
                "GraphedGenerator.capture() on a generator that is captured already; "
                "close() it first"
            )
        self._experts = decode_experts(self.model, capturing=not graphs_disabled())
        if self._stack and (not self.stacked.groups or self.stacked.moved()):
            # Kept after close(): a capture again reuses the compiled step, whose
            # guards are on these groups' forwards; laid anew where a weight was
            # replaced since (load_state_dict(assign=True), a new module): the decode
            # step reads the groups' buffers, which would hold the old weights.
            self.stacked = stack_projections(self.model)
        if compiles_with_inductor(self.compile_options):
            start_compile_workers()  # ready by the time inductor has kernels to build
        if self.kv is None:
            self._make_cache()
        # Every bucket's cache view is made here, not in its first decode step: a
        # compiled step must find them made (binding one is Python work dynamo would
        # trace, and a lazy ``from transformers import`` inside it does not trace).
        for bucket in self.config.buckets():
            self.kv.cache_for(bucket.rows)
        # Compiled: the batch dimension is dynamic from the first compile (marked in
        # _decode and on the cache views), and sizes are reasoned about without
        # specializing 1, so one compile serves every bucket, a bucket of one row too.
        shapes = size_oblivious_shapes() if self.compile_options is not None else nullcontext()
        # The decoder layers' region: its schema made once, not at every layer (torch
        # before pytorch/pytorch#184646 traced the layer again for each).
        regional = self.compile_options is not None and self._regions is not None
        schemas = memoized_subgraph_schemas() if regional else nullcontext(SubgraphSchemaMemo())
        plan = {"plan_memory": plan_memory, "headroom_bytes": headroom_bytes}
        with torch.no_grad(), self._experts.decoding(), shapes, schemas as memo:
            self.subgraph_schemas = memo
            self.runner.capture(
                self._dummy_inputs,
                warmup,
                free_bytes=free_bytes,
                progress=progress,
                **plan,
            )
        try:
            plan["free_bytes"] = self._left_of(free_bytes)
            self._capture_prefills(plan, progress)
        except BaseException:
            self.runner.close()  # a capture is all or nothing
            raise
        finally:
            self.kv.reset()
        self._weights = WeightAddresses.of(self.model)

    def _left_of(self, free_bytes: int | None) -> int | None:
        """What a given free-memory budget has left after the decode graphs' captures
        (``None``: the prefill plan reads the device's free memory itself)."""
        used = self.runner.memory_used
        if free_bytes is None or used is None:
            return free_bytes
        return max(0, free_bytes - used.device_bytes)

    def _capture_prefills(self, plan: dict[str, Any], progress: bool | None) -> None:
        """The prefill graphs, into the decode graphs' pool (replays never overlap),
        with the experts the decode steps run (a prefill graph must not sync the host
        either). A memory plan sees the memory the decode graphs left."""
        self.prefill = PrefillGraphs(
            self._prefill_step,
            self.prefill_lengths,
            self.config,
            self.prefill_tokens,
            device=self.device,
            pool=self.runner.captured.pool,
            require_all_buckets=self._require_all_buckets,
            capture_backend=self._capture_backend,
        )
        try:
            with torch.no_grad(), self._experts.decoding():
                self.prefill.capture(self._prefill_inputs, progress=progress, **plan)
        except BaseException:
            self.prefill.close()
            self.prefill = None
            raise

    def _make_cache(self) -> None:
        shapes = layer_shapes(self.model, self._cache_keyword)
        self.kv = SharedStaticCache(
            self.model,
            shapes,
            self.config.largest.rows,
            self.max_cache_len,
            self.device,
            # Regions bind the rows inside the step (SharedStaticCache.bind_rows).
            dynamic_rows=self.compile_options is not None and self._regions is None,
            spare_row=self._regions is not None,
        )
        logger.info(
            "GraphedGenerator: static cache of %d layers x %d rows x %d positions: %.1f MiB",
            len(shapes),
            self.kv.max_rows,
            self.max_cache_len,
            self.kv.nbytes / 2**20,
        )

    def _regions_failed(self, exc: Exception) -> None:
        """The first decode step through the regional compile raised: where torch
        cannot compile the layers as one body (its errors vary by model and version:
        :mod:`.regions`) the whole model compiles instead, said at WARNING and in
        ``stats()["compile_regions_error"]``; with ``compile_regions=True`` that is an
        error. The storage keeps its spare row; the views get the dynamic marks the
        whole model's compile needs."""
        reason = _reason(exc)
        self.kv.reset()
        if self._regions_required:
            raise CudaGraphCaptureError(
                "compile_regions=True, but the decoder layers did not compile as one "
                f"body ({reason}). Fix: leave compile_regions at None (the whole model "
                "then compiles as one) or pass False"
            ) from exc
        logger.warning(
            "GraphedGenerator: the decoder layers did not compile as one body (%s); "
            "the whole model compiles as one instead",
            reason,
        )
        self.compile_regions_error = reason
        self._regions = None
        self._step_model = torch.compile(self.model, **self._compile_keywords())
        self.kv.mark_rows_dynamic()

    def _compile_keywords(self) -> dict[str, Any]:
        """``compile_options``, with the projection-stacking pass where it is on."""
        if self._stack:
            return with_stacked_projections(self.compile_options)
        return dict(self.compile_options)

    def _dummy_inputs(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        rows = bucket.rows
        return {
            "input_ids": torch.zeros(rows, 1, dtype=torch.long, device=self.device),
            "position_ids": torch.zeros(rows, 1, dtype=torch.long, device=self.device),
            "attention_mask": torch.ones(
                rows, self.max_cache_len, dtype=torch.bool, device=self.device
            ),
        }

    def _prefill_inputs(self, length: int) -> Callable[[Bucket], dict[str, torch.Tensor]]:
        def make(bucket: Bucket) -> dict[str, torch.Tensor]:
            shape = (bucket.rows, length)
            positions = torch.arange(length, device=self.device).expand(shape)
            return {
                "input_ids": torch.zeros(shape, dtype=torch.long, device=self.device),
                "position_ids": positions.contiguous(),
                "attention_mask": torch.ones(shape, dtype=torch.long, device=self.device),
            }

        return make

    def _prefill_step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """A prefill graph's forward: every replay writes from position 0 (the counters
        are zeroed inside the graph), with the arguments the eager prefill passes."""
        self.kv.reset()
        with sdpa_scope(self.sdpa_backends):
            return self._prefill(self.kv, input_ids, attention_mask, position_ids)

    def _decode(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """One decode step at ``input_ids.shape[0]`` rows: the runner's forward."""
        if self.compile_options is not None and input_ids.shape[0] > 1:
            # The batch dimension dynamic from the first compile: every bucket of two
            # rows or more shares one compiled step (the cache's views are marked alike).
            for t in (input_ids, position_ids, attention_mask):
                mark_dynamic(t, 0)
        # Warmups, compiles and captures alike, and a decode step run eagerly: a
        # compiled step must never meet a backend set other than its trace's, nor layers
        # marked otherwise than in its trace.
        inputs = (input_ids, position_ids, attention_mask)
        if self._regions is not None and not self._regions_compiled:
            # The first step compiles (in the largest bucket's warmup, whose compile
            # seconds it is): a failure falls back to the whole model, in that step.
            try:
                out = self._decode_step(*inputs)
            except Exception as exc:  # torch's compile errors share no base class
                self._regions_failed(exc)
            else:
                self._regions_compiled = True
                return out
        return self._decode_step(*inputs)

    def _decode_step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        regions = nullcontext() if self._regions is None else self._regions.marked()
        packed = nullcontext() if self.packed_gqa is None else self.packed_gqa.installed()
        with sdpa_scope(self.sdpa_backends), regions, self.stacked.reading(), packed:
            return self._decode_on(
                self._step_model, self.kv, input_ids, position_ids, attention_mask
            )

    def _own_regional_forward(self) -> Callable[..., Any]:
        """:meth:`_regional_forward` over a code object of this generator's own.

        Why: dynamo keeps its compiles per code object, at most ``recompile_limit``
        (8) of them, and each generator's regions are other objects its guards check;
        over one shared code object the ninth generator of a process would decode
        eagerly (and the tenth without a word)."""
        function = GraphedGenerator._regional_forward
        code = function.__code__.replace(co_name=f"decode_step_{id(self):x}")
        own = types.FunctionType(code, function.__globals__, code.co_name)
        own.__qualname__ = f"GraphedGenerator.{code.co_name}"
        return types.MethodType(own, self)

    def _regional_forward(self, **kwargs: Any) -> Any:
        # Traced: the cache layers sliced from the storage by this step's batch size,
        # so every layer's region sees the same symbols and one body serves them all.
        rows = kwargs["input_ids"].shape[0]
        for name in ("position_ids", "attention_mask"):
            # The inputs' batch dimensions, each marked dynamic, are one size: learnt
            # here, before the first layer, that layer traces as the others do.
            torch._check(kwargs[name].shape[0] == rows)
        self.kv.bind_rows(kwargs[self._cache_keyword], rows)
        return self.model(**kwargs)

    def _decode_on(
        self,
        model: Callable[..., Any],
        kv: SharedStaticCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_keyword: kv.cache_for(input_ids.shape[0])},
        )
        # HF's generate reads the last position's logits in float32.
        return out.logits[:, -1, :].float()

    # ---- generate --------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        min_new_tokens: int | None = None,
        min_length: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Generate up to ``max_new_tokens`` tokens per prompt.

        Args:
            input_ids: ``[batch, prompt_len]`` token ids, left-padded.
            attention_mask: ``[batch, prompt_len]`` 0/1, 0 on the left padding.
                Default: as ``generate``, ``input_ids != pad_token_id`` where the pad id
                appears in the ids and is no end-of-sequence id, else no padding.
            max_new_tokens: tokens to make per prompt.
            do_sample, temperature, top_k, top_p: the decoding rule; ``None`` takes the
                model's ``generation_config`` value, as ``model.generate`` does (so
                sampling without ``top_k`` keeps HF's default top-k of 50; greedy
                unless the config says ``do_sample``).
            repetition_penalty: HF's repetition penalty over the prompt and the tokens
                made so far, greedy or sampled (``None``: the config's; 1.0 is off).
            min_new_tokens, min_length: end-of-sequence ids held back until that many new
                tokens, or tokens in all (prompt included), as HF does (``None``: the
                config's; 0 is off). A ``min_new_tokens`` that is set, 0 included,
                replaces ``min_length``, as in ``generate``.
            eos_token_id, pad_token_id: stop and pad ids (default: the model's
                ``generation_config``, as ``generate``); after a sequence's end-of-
                sequence token, its later tokens are the pad id, and the request stops
                when every sequence has ended.
            generator: the ``torch.Generator`` sampling draws from (on the model's
                device; default: torch's global one). The same seed gives the same
                tokens.

        Returns:
            ``[batch, prompt_len + n]`` int64 on the model's device: the prompts and
            ``n <= max_new_tokens`` new tokens (fewer when every sequence ended early).

        Raises:
            CudaGraphsStateError: before :meth:`capture` or after :meth:`close`, or a
                parameter or buffer of the model replaced since :meth:`capture` (the
                graphs would read the old memory; named, with the fix).
            CudaGraphsTypeError, CudaGraphsValueError, CudaGraphInputError: a bad
                request (:func:`~cudagraphs.serving.hf.requests.check_request`, sampling
                values, token ids), nothing run.
        """
        if self.kv is None or self.runner.static is None:
            raise CudaGraphsStateError(
                "GraphedGenerator.generate() before capture() (or after close()): call "
                "capture() first"
            )
        defaults = getattr(self.model, "generation_config", None)
        stops = stop_tokens(eos_token_id, pad_token_id, defaults, self.device, self.model)
        if attention_mask is None:
            # As generate: the padding read from the pad id where it can be.
            attention_mask = inferred_mask(input_ids, stops.pad, stops.eos.tolist())
        request = check_request(
            input_ids,
            attention_mask,
            max_new_tokens,
            self.max_cache_len,
            self.device,
            vocab_size_of(self.model, "input"),
        )
        check_sampling_generator(generator, self.device)
        sampling = sampling_rule(
            defaults,
            do_sample,
            temperature,
            top_k,
            top_p,
            repetition_penalty,
            min_length,
            min_new_tokens,
        )
        warn_unapplied(self._warn, defaults, sampling.do_sample)
        if request.batch <= self.kv.max_rows:
            if not self.runner.disabled:
                self._weights.check(self.model)
            else:
                # Eager, but the decode step still reads the projection groups'
                # buffers: a weight replaced since would be read as it was.
                check_groups_in_place(self.stacked)
            kv, step = self.kv, self.runner.run
            self.requests["graphs"] += 1
        else:
            kv, step = self._too_large(request.batch)
        with torch.no_grad():
            out = self._generate(request, sampling, stops, generator, kv, step)
        self.tokens += (out.shape[1] - request.prompt_len) * request.batch
        return out

    def _too_large(self, batch: int) -> tuple[SharedStaticCache, Callable]:
        """A request above the largest bucket: its own cache, every step eager."""
        self.requests["too_large"] += 1
        self._warn(
            "too_large",
            "GraphedGenerator: a batch of %d is larger than the largest bucket (%d): it "
            "and later ones like it decode eagerly, with a static cache of their own, "
            "counted in stats()['requests']['too_large']",
            batch,
            self.kv.max_rows,
        )
        kv = SharedStaticCache(
            self.model,
            [_shape_of(k, v) for k, v in zip(self.kv.keys, self.kv.values)],
            batch,
            self.max_cache_len,
            self.device,
        )

        def step(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
            # The eager model: a compiled one would compile this shape mid-request.
            return self._decode_on(self.model, kv, **inputs)

        return kv, step

    def _generate(
        self,
        request: Request,
        sampling: Sampling,
        stops: StopTokens,
        generator: torch.Generator | None,
        kv: SharedStaticCache,
        step: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        replayed = None
        if kv is self.kv and self.prefill is not None:
            replayed = self.prefill.run(request, self.max_cache_len)
            path = replayed.eager_cause
            if replayed.logits is not None:
                path = "disabled" if self.prefill.disabled else "graphs"
            self.prefills[path] += 1
        else:
            self.prefills["too_large"] += 1
        # A padded prefill's positions end where the prompt's own do: the decode
        # continues from the prompt's.
        positions = positions_from_mask(request.attention_mask)
        if replayed is not None and replayed.logits is not None:
            logits, prefix = replayed.logits, replayed.mask  # the graph zeroed the counters
        else:
            kv.reset()
            prefix = request.attention_mask
            logits = self._prefill(kv, request.input_ids, prefix.long(), positions)
        with self._experts.decoding():
            return decode_loop(
                request,
                logits,
                positions,
                step,
                sampling=sampling,
                stops=stops,
                generator=generator,
                ended=self._end_flag() if stops.active else None,
                max_cache_len=self.max_cache_len,
                cache_prefix=prefix,
            )

    def _prefill(
        self,
        kv: SharedStaticCache,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The model's forward over whole prompts, with the arguments HF's ``generate``
        passes: the 0/1 mask as integers, positions from it, the last position's
        logits only; those logits in float32, as ``generate`` reads them."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_keyword: kv.cache_for(input_ids.shape[0])},
            **self._logits_to_keep,
        )
        return out.logits[:, -1, :].float()

    def _end_flag(self) -> EndFlag:
        # One per generator: pinned memory is slow to allocate, and requests run one
        # at a time.
        if self._ended is None:
            self._ended = EndFlag(self.device)
        self._ended.pending = False
        return self._ended

    # ---- reporting and teardown ------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The runner's stats (buckets, replays, eager runs, capture times) with
        ``requests`` (per path), ``tokens`` (new tokens returned), ``cache_bytes``
        (the shared static cache) and ``decode_experts`` (the experts implementations
        decode steps run with where they differ from the model's, as
        ``set_experts_implementation`` takes them; ``None``: as loaded), ``sdpa_backends``
        (the decode steps' attention backends by name; ``None``: torch's choice) and
        ``compile_regions`` (the decoder layers sharing one compiled body; 0: none) and
        ``compile_regions_error`` (why they could not, the whole model compiled instead;
        ``None``: they could, or were not asked to), ``prefills`` (requests per prefill
        path: ``graphs``, ``disabled`` (``CUDAGRAPHS_DISABLE``: the padded prefill run
        eagerly on the graphs' path), or why one ran eagerly: ``off`` without length
        buckets, ``longer``, ``no_room``, ``too_large``, ``pad_ratio``, ``no_graphs``) and
        ``prefill_graphs`` (per length bucket: captured, dropped, replays and capture
        seconds; ``None`` before capture and after close) and ``subgraph_schemas``
        (the decoder layers' region schema memo of the last capture: ``active``,
        ``built``, ``reused``; ``None`` before capture) and ``stacked_projections``
        (the linear groups whose weights lie back to back; 0: none) and ``pack_gqa``
        (whether the decode steps' attention packs grouped heads)."""
        out = self.runner.stats()
        out["requests"] = dict(self.requests)
        out["tokens"] = self.tokens
        out["cache_bytes"] = 0 if self.kv is None else self.kv.nbytes
        decode = self._experts.decode
        out["decode_experts"] = None if decode is None else dict(decode)
        backends = self.sdpa_backends
        out["sdpa_backends"] = None if backends is None else [b.name for b in backends]
        out["compile_regions"] = 0 if self._regions is None else len(self._regions.layers)
        out["compile_regions_error"] = self.compile_regions_error
        out["stacked_projections"] = len(self.stacked.groups)
        out["pack_gqa"] = self.packed_gqa is not None
        out["prefills"] = dict(self.prefills)
        out["prefill_graphs"] = None if self.prefill is None else self.prefill.stats()
        memo = self.subgraph_schemas
        out["subgraph_schemas"] = None if memo is None else dataclasses.asdict(memo)
        return out

    def close(self) -> None:
        """Release the graphs and the static cache (idempotent); ``capture()`` may run
        again."""
        self.runner.close()
        if self.prefill is not None:
            self.prefill.close()
            self.prefill = None
        self.kv = None


def _shape_of(keys: torch.Tensor, values: torch.Tensor) -> LayerShape:
    return LayerShape(keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype)


def _reason(exc: BaseException) -> str:
    """``exc``'s type and the first line of its innermost cause (dynamo wraps the
    backend's error as "backend=... raised:" with the cause below)."""
    inner = exc
    # BackendCompilerFailed keeps the backend's error as inner_exception.
    for _ in range(8):  # a bounded walk: a chain could loop
        cause = getattr(inner, "inner_exception", None) or inner.__cause__
        if cause is None:
            break
        inner = cause
    lines = [line for line in str(inner).strip().splitlines() if line.strip()]
    text = lines[0][:300] if lines else type(inner).__name__
    return (
        f"{type(exc).__name__}: {text}"
        if inner is exc
        else f"{type(exc).__name__} ({type(inner).__name__}: {text})"
    )
