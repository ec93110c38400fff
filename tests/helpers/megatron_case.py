"""Megatron-Core's own TE graph helper over a ``GPTModel`` on cudagraphs, at one rank.

The case, shared by ``test_cuda_megatron.py``, ``test_megatron_kwargs_cpu.py`` and
``benchmarks/_upstream_megatron.py``:

1. Import Megatron-Core normally, without Transformer Engine, so every module of it
   takes its non-TE path (the local layer spec, Megatron's own RNG tracker, torch
   norms and optimizers).
2. :func:`megatron_te_graphs`: install the TE stand-in (``te_standin.py``) and
   re-execute ``megatron.core.transformer.cuda_graphs`` alone under it, so that its
   ``HAVE_TE_GRAPHS`` is true and its ``make_graphed_callables`` is cudagraphs'. On
   exit the module's namespace and Megatron's TE-version cache are put back.
3. Build two identical ``GPTModel`` s (local spec, bf16, dropout 0) wrapped in
   Megatron's ``DistributedDataParallel``; hand one to ``TECudaGraphHelper``, call its
   ``create_cudagraphs()`` as Megatron's training loop does at iteration
   ``cuda_graph_warmup_steps`` (0 here), and train both the same steps.

Why not install the stand-in before importing Megatron: then the 37 modules of
``megatron/core`` that import Transformer Engine (``tensor_parallel.random``,
``extensions.transformer_engine``, ``fp8_utils``, ``generalized_tensor_parallelism``,
the optimizers, ...) take their TE paths, and the stand-in would have to impersonate
TE's layers and kernels. Scoping it to the graph helper keeps the model the local,
non-TE model the test means.

What the training loop must call around the helper (``megatron/training/training.py``,
0.19.2): ``TECudaGraphHelper(model, config, seq_length, micro_batch_size,
optimizers)`` once; ``create_cudagraphs()`` when ``iteration == cuda_graph_warmup_steps``;
``cuda_graph_set_manual_hooks()`` only where forward pre-hooks are disabled (the
distributed optimizer with overlapped parameter all-gather; not used here, and DDP's
pre-hook asserts ``overlap_param_gather`` when called); ``delete_cuda_graphs()`` at
the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from helpers.te_standin import TE_VERSION, StandIn, te_standin

__all__ = [
    "GRAPH_HELPER_MODULE",
    "CaseShape",
    "KwargsRecorder",
    "helper_kwargs_on_cpu",
    "megatron_skip_reason",
    "megatron_te_graphs",
    "one_rank",
    "run_case",
]

GRAPH_HELPER_MODULE = "megatron.core.transformer.cuda_graphs"


@dataclass(frozen=True)
class CaseShape:
    """The model and batch. Small, so a step is launch-bound, as graphs are meant for."""

    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int = 512
    vocab_size: int = 256
    seq_length: int = 64
    micro_batch_size: int = 2
    seed: int = 1234
    lr: float = 1e-3


def megatron_skip_reason(need_gpu: bool) -> str | None:
    """Why the Megatron case cannot run here (``None``: it can)."""
    if need_gpu and sys.version_info < (3, 12):
        return f"megatron-core 0.19 needs Python >= 3.12 (this is {sys.version.split()[0]})"
    if need_gpu and not torch.cuda.is_available():
        return "needs a CUDA device"
    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine"):
        # Megatron would import the real one: the case is Megatron without TE.
        return "Transformer Engine is installed; this case runs Megatron's helper without it"
    try:
        importlib.import_module(GRAPH_HELPER_MODULE)
    except Exception as exc:  # ImportError, or a missing dependency of its import chain
        return f"megatron-core is not importable: {type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def megatron_te_graphs(
    version: str = TE_VERSION, make_graphed_callables: Callable[..., Any] | None = None
) -> Iterator[tuple[Any, StandIn]]:
    """Megatron's graph module re-executed under the TE stand-in.

    Yields:
        ``(cuda_graphs module, StandIn)``. Use the helper class from that module inside
        the block only: on exit the module's namespace is restored to what it was (no
        TE), and a helper made inside would then find no ``make_graphed_callables``.

    Raises:
        RuntimeError: Megatron's TE import block still failed under the stand-in (a
            name it imports is missing from the stand-in).
    """
    cg = importlib.import_module(GRAPH_HELPER_MODULE)  # first import: without TE
    utils = importlib.import_module("megatron.core.utils")
    saved_namespace = dict(cg.__dict__)
    saved_version = utils._te_version
    with te_standin(version, make_graphed_callables) as standin:
        try:
            # is_te_min_version caches the version it first saw (0.0.0 without TE).
            utils._te_version = None
            importlib.reload(cg)
            if not cg.HAVE_TE_GRAPHS:
                raise RuntimeError(
                    f"{GRAPH_HELPER_MODULE} still has HAVE_TE_GRAPHS=False under the TE "
                    "stand-in: its `from transformer_engine... import` block needs a name "
                    "tests/helpers/te_standin.py does not provide"
                )
            if cg.make_graphed_callables is not standin.make_graphed_callables:
                raise RuntimeError("Megatron did not bind the stand-in's make_graphed_callables")
            yield cg, standin
        finally:
            utils._te_version = saved_version
            cg.__dict__.clear()
            cg.__dict__.update(saved_namespace)


@contextlib.contextmanager
def one_rank(init_file: str, backend: str, shape: CaseShape) -> Iterator[None]:
    """torch.distributed (world size 1, file rendezvous), Megatron's parallel state,
    its graph-safe RNG tracker and microbatch calculator; all torn down on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        init_num_microbatches_calculator(0, None, shape.micro_batch_size, shape.micro_batch_size, 1)
        torch.manual_seed(shape.seed)
        if torch.cuda.is_available():  # the tracker reads CUDA generator states
            # The training loop seeds with use_cudagraphable_rng when cuda_graph_impl is
            # set (megatron/training/initialize.py); dropout is 0 here: no kernel draws.
            model_parallel_cuda_manual_seed(
                shape.seed, use_cudagraphable_rng=True, force_reset_rng=True
            )
        yield
    finally:
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def transformer_config(shape: CaseShape, graphs: bool, cpu: bool = False) -> Any:
    """bf16 (the helper's sample hidden states are bf16), dropout 0, no fused kernels
    that need Apex or TE, and ``deterministic_mode``: Megatron's embedding otherwise
    uses ``F.embedding``, whose backward it calls non-deterministic
    (``tensor_parallel/layers.py``), and eager itself would not repeat bit for bit."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn_hidden_size,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deterministic_mode=True,
        use_cpu_initialization=cpu,
        cuda_graph_impl="transformer_engine" if graphs else "none",
        cuda_graph_warmup_steps=0,
    )


def gpt_model(config: Any, shape: CaseShape) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        position_embedding_type="rope",
    )


def ddp(config: Any, model: torch.nn.Module) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def causal_mask(shape: CaseShape, device: Any) -> torch.Tensor:
    """True where attention is masked, (b, 1, s, s): the layout (and dtype) of the
    helper's sample mask (``TransformerLayer.get_layer_static_inputs``)."""
    s = shape.seq_length
    mask = ~torch.tril(torch.ones((s, s), device=device)).bool()
    return mask.reshape(1, 1, s, s).tile(shape.micro_batch_size, 1, 1, 1)


def batches(shape: CaseShape, steps: int, device: Any) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(shape.seed + 1)
    b, s = shape.micro_batch_size, shape.seq_length
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, shape.vocab_size, (b, s + 1), generator=gen)
        out.append(
            {
                "input_ids": tokens[:, :-1].to(device),
                "labels": tokens[:, 1:].to(device),
                "position_ids": torch.arange(s).expand(b, s).to(device),
                "attention_mask": causal_mask(shape, device),
            }
        )
    return out


class MasterAdam:
    """Adam on fp32 master copies of bf16 parameters, reading Megatron DDP's fp32
    ``main_grad`` (what Megatron's mixed-precision optimizer does, without its
    bookkeeping). Identical inputs give identical updates, so it keeps two runs equal
    exactly when their gradients are."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.inner = torch.optim.Adam(self.master, lr=lr)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = p.main_grad
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.data.copy_(m)

    def zero_grad(self) -> None:
        for m in self.master:
            m.grad = None


def train_step(model: Any, optimizer: MasterAdam, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One Megatron-style step: zero the grad buffer, forward to per-token losses,
    backward, finish the (one-rank) gradient sync, optimizer step."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = model(
        batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    loss = losses.float().mean()
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()
    return loss.detach()


@dataclass
class KwargsRecorder:
    """Stands where the stand-in's ``make_graphed_callables`` is: records what
    Megatron passes, forwards to cudagraphs', and records a refusal."""

    target: Callable[..., Any]
    calls: list[dict[str, Any]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def __call__(self, modules: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append({"num_callables": len(modules), "args": args, "kwargs": dict(kwargs)})
        from cudagraphs.errors import (
            CudaGraphsTypeError,
            CudaGraphsValueError,
            QuantizationNotSupportedError,
        )

        try:
            return self.target(modules, sample_args, *args, **kwargs)
        except (CudaGraphsValueError, CudaGraphsTypeError, QuantizationNotSupportedError) as exc:
            self.refused.append(f"{type(exc).__name__}: {exc}")
            raise

    @property
    def kwarg_names(self) -> list[str]:
        return sorted(self.calls[-1]["kwargs"]) if self.calls else []


def describe_kwargs(kwargs: dict[str, Any]) -> dict[str, str]:
    """Each kwarg's value in a line (tensors by shape and dtype)."""

    def short(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"Tensor{tuple(v.shape)} {v.dtype}"
        if isinstance(v, (list, tuple)) and len(v) > 4:
            return f"{type(v).__name__} of {len(v)}: {[short(x) for x in v[:2]]}..."
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {short(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (list, tuple)):
            return f"{type(v).__name__}({', '.join(short(x) for x in v)})"
        return repr(v)

    return {k: short(v) for k, v in sorted(kwargs.items())}


@contextlib.contextmanager
def replay_args_seen() -> Iterator[list[list[str]]]:
    """Record the keyword names Megatron passes to a graphed layer at replay
    (``TransformerLayer._get_te_cuda_graph_replay_args``), as a pass-through."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    seen: list[list[str]] = []
    original = TransformerLayer.__dict__["_get_te_cuda_graph_replay_args"]

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        seen.append(sorted(out[1]))
        return out

    TransformerLayer._get_te_cuda_graph_replay_args = recording
    try:
        yield seen
    finally:
        TransformerLayer._get_te_cuda_graph_replay_args = original


@contextlib.contextmanager
def counting_replays() -> Iterator[list[int]]:
    """Count ``torch.cuda.CUDAGraph.replay`` calls (forward and backward graphs)."""
    count = [0]
    original = torch.cuda.CUDAGraph.replay

    def replay(self: Any) -> Any:
        count[0] += 1
        return original(self)

    torch.cuda.CUDAGraph.replay = replay
    try:
        yield count
    finally:
        torch.cuda.CUDAGraph.replay = original


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def graphed_results(helper: Any) -> list[Any]:
    """What the helper stored per layer (``layer.cuda_graphs``), in layer order."""
    return [
        g for layers in helper.callables_per_chunk for layer in layers for g in layer.cuda_graphs
    ]


@dataclass
class Run:
    """One model of the case: the DDP-wrapped ``GPTModel`` and its optimizer."""

    model: Any
    optimizer: MasterAdam
    losses: list[torch.Tensor] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        loss, ms = _timed(lambda: train_step(self.model, self.optimizer, batch))
        self.losses.append(loss)
        self.step_ms.append(ms)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Per-step losses, then every parameter and its ``main_grad``, by name."""
        out = {f"loss[{i}]": x for i, x in enumerate(self.losses)}
        for name, p in self.model.module.named_parameters():
            out[name] = p.detach()
            out[f"{name}.main_grad"] = p.main_grad
        return out


def _new_run(shape: CaseShape, graphs: bool, like: Any = None) -> tuple[Run, Any]:
    config = transformer_config(shape, graphs=graphs)
    # Float16Module, as Megatron's training wraps a bf16 model: it casts every
    # parameter to bf16 (torch norms of the local spec are made in fp32 otherwise).
    from megatron.core.transformer.module import Float16Module

    # DDP on a side stream, as Megatron's training builds it (megatron/training/
    # training.py, get_model): DDP keeps each parameter's AccumulateGrad node, which
    # records the stream it was made on, and a backward capture cannot make the legacy
    # default stream wait on it (cudaErrorStreamCaptureImplicit); a side stream joins.
    ddp_stream = torch.cuda.Stream()
    ddp_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ddp_stream):
        model = ddp(config, Float16Module(config, gpt_model(config, shape).cuda()))
    torch.cuda.current_stream().wait_stream(ddp_stream)
    if like is not None:
        model.module.load_state_dict(like.module.state_dict())
    return Run(model, MasterAdam(model, shape.lr)), config


def compare(run: Run, ref: Run) -> dict[str, Any]:
    """``equal_to_eager`` (every loss, parameter and ``main_grad`` bit for bit),
    ``max_abs_diff`` over them, and the first few that differ."""
    got, want = run.tensors(), ref.tensors()
    diffs = {
        k: (got[k].double() - want[k].double()).abs().max().item()
        for k in want
        if not torch.equal(got[k], want[k])
    }
    return {
        "equal_to_eager": not diffs,
        "max_abs_diff": max(diffs.values(), default=0.0),
        "differing": dict(list(diffs.items())[:8]),
        "num_differing": len(diffs),
    }


def _capture(
    cg: Any, run: Run, config: Any, shape: CaseShape, recorder: KwargsRecorder, report: dict
) -> Any:
    """Megatron's helper, as its training loop drives it at iteration 0."""
    helper = cg.TECudaGraphHelper(
        model=[run.model],
        config=config,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        optimizers=[run.optimizer],
    )
    try:
        helper.create_cudagraphs()
    finally:
        report["refused"] = list(recorder.refused)
        report["kwargs_passed"] = recorder.kwarg_names
        report["kwargs"] = describe_kwargs(recorder.calls[-1]["kwargs"]) if recorder.calls else {}
        report["make_graphed_callables_calls"] = len(recorder.calls)
    return helper


def _check_stored(helper: Any, report: dict) -> None:
    stored = graphed_results(helper)
    report["graphed_types"] = sorted({type(g).__name__ for g in stored})
    if any(isinstance(g, torch.nn.Module) for g in stored):
        # Megatron's replay calls layer.cuda_graphs[i](...); if that is the layer
        # itself, its __call__ routes back to the replay: infinite recursion.
        raise RuntimeError(
            "make_graphed_callables returned the modules themselves under _order; Megatron "
            "stores them in layer.cuda_graphs and its replay would call each layer "
            "recursively (Transformer Engine returns a graphed function under _order)"
        )


def _train(graphed: Run, eagers: list[Run], shape: CaseShape, steps: int, report: dict) -> None:
    """``steps`` steps, each on the graphed model first, then on each eager one;
    replays counted (``report["replays"]``), and none allowed in an eager step."""
    from cudagraphs.errors import CudaGraphInputError

    with counting_replays() as replays, replay_args_seen() as seen:
        for i, batch in enumerate(batches(shape, steps, "cuda")):
            try:
                graphed.step(batch)
            except CudaGraphInputError as exc:  # a replay call the graphs refuse
                report["refused"].append(f"replay at step {i}: {type(exc).__name__}: {exc}")
                raise
            report["replays"] = replays[0]
            for run in eagers:
                run.step(batch)
            assert replays[0] == report["replays"], "an eager model replayed a graph"
    report["replay_kwargs"] = seen[0] if seen else []


def run_case(
    steps: int,
    init_file: str,
    shape: CaseShape = CaseShape(),
    report: dict | None = None,
    eager_twin: bool = False,
    adapt: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Train a graphed and an eager model the same ``steps``, interleaved step by
    step, and report what happened.

    Args:
        steps: training steps after capture (Megatron's ``cuda_graph_warmup_steps`` is
            0: the helper captures before the first).
        init_file: file for the one-rank NCCL rendezvous.
        report: filled as the case goes (so a caller sees how far a failing run got).
        eager_twin: also train a second eager model and report whether eager is
            bitwise reproducible here (``eager_twin_equal``): the baseline for
            ``equal_to_eager``.
        adapt: called with the helper after capture, before training (a probe may
            emulate a library change there; tests pass nothing).

    Returns:
        ``report``: ``kwargs_passed`` (sorted names Megatron passed), ``kwargs`` (their
        values in a line each), ``refused``, ``graphed_types``, ``te_capture_starts``,
        ``replays`` (``CUDAGraph.replay`` calls while training) and
        ``expected_replays`` (a forward and a backward graph per layer per step),
        ``replay_kwargs`` (the keyword names Megatron passes at replay),
        ``losses`` / ``eager_losses``, ``graphed_step_ms`` / ``eager_step_ms``, and
        :func:`compare`'s fields.
    """
    report = {} if report is None else report
    report.update(steps=steps, shape=dataclasses.asdict(shape), refused=[])
    recorder = KwargsRecorder(target=_ours())
    with (
        one_rank(init_file, "nccl", shape),
        megatron_te_graphs(make_graphed_callables=recorder) as (cg, standin),
    ):
        graphed, config = _new_run(shape, graphs=True)
        eager, _ = _new_run(shape, graphs=False, like=graphed.model)
        twin = _new_run(shape, graphs=False, like=graphed.model)[0] if eager_twin else None
        helper = _capture(cg, graphed, config, shape, recorder, report)
        report["te_capture_starts"] = standin.capture_starts
        trained = False
        try:
            if adapt is not None:
                adapt(helper)
            _check_stored(helper, report)
            _train(graphed, [eager] if twin is None else [eager, twin], shape, steps, report)
            trained = True
        finally:
            try:
                helper.delete_cuda_graphs()  # graph.reset() on each stored result
            except Exception as exc:
                if trained:
                    raise
                report["cleanup_error"] = f"{type(exc).__name__}: {exc}"
        report.update(
            expected_replays=2 * shape.num_layers * steps,
            losses=[x.item() for x in graphed.losses],
            eager_losses=[x.item() for x in eager.losses],
            graphed_step_ms=graphed.step_ms,
            eager_step_ms=eager.step_ms,
            **compare(graphed, eager),
        )
        if twin is not None:
            report["eager_twin_equal"] = compare(twin, eager)["equal_to_eager"]
    return report


def _ours() -> Callable[..., Any]:
    from cudagraphs import make_graphed_callables

    return make_graphed_callables


def helper_kwargs_on_cpu(shape: CaseShape, init_file: str, version: str = TE_VERSION) -> dict:
    """Build the model on the CPU and ask Megatron's helper for what it would pass to
    ``make_graphed_callables`` (its ``_get_cuda_graph_input_data``), capturing
    nothing. ``torch.cuda.current_device`` points at the CPU meanwhile: the helper
    makes its sample tensors there.

    Returns:
        ``{"callables": tuple of layers, "sample_args": list, "kwargs": dict}``.
    """
    with one_rank(init_file, "gloo", shape), megatron_te_graphs(version) as (cg, _):
        config = transformer_config(shape, graphs=True, cpu=True)
        helper = cg.TECudaGraphHelper(
            model=[gpt_model(config, shape)],
            config=config,
            seq_length=shape.seq_length,
            micro_batch_size=shape.micro_batch_size,
            optimizers=[],
        )
        current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            sample_args, kwargs = helper._get_cuda_graph_input_data()
        finally:
            torch.cuda.current_device = current_device
        return {
            "callables": tuple(helper.flattened_callables),
            "sample_args": sample_args,
            "kwargs": kwargs,
        }
