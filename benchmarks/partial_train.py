"""Partial-graph training benchmark: ``PartialCudaGraphManager`` on Hugging Face Llama,
Qwen3-MoE, Mixtral and DeepSeek-V3 training steps, per scope, against eager and
(Llama) whole decoder-layer core graphs.

Models are built from config with random weights, in bf16, training mode, SDPA.
Regime ``accumulate`` (the only one; stated in the report): a step is forward +
backward, no optimizer: ``model(input_ids=ids, use_cache=False)``, then
``logits.float().pow(2).mean().backward()``. Every ``.grad`` starts at zero and steps
add into it. Per config and model, each variant builds its own model and input (same
seeds), in one process:

* ``eager``: the model as built (always run: the reference of the checks).
* ``partial``: ``PartialCudaGraphManager.from_model_parts([model],
  scopes=("attention", "moe_router"))``, ``start_recording()``, one eager step,
  ``capture()``; later steps replay. Its ``stats()`` after timing go into the report.
* ``partial_layers``: the same with every per-layer scope (``SCOPES``): per layer the
  widest graph-safe scope, the whole layer where it can be.
* ``partial_widest``: the same with the ``"model"`` scope as well (``SCOPES`` and
  ``MODEL_SCOPE``): the whole model in one graph where every layer is graph-safe
  whole, the layers otherwise.
* ``partial_widest_compiled``: ``partial_widest`` with ``compile_options={}``: each
  target's graph records its ``torch.compile``d forward and backward. Checked within
  tolerance (inductor's kernels round otherwise), not bit for bit.
* ``eager_experts_loop`` (MoE models): eager with the experts implementation switched
  to transformers' ``eager`` loop: a reference row only. Every other variant of an
  MoE model runs ``grouped_mm`` experts (set explicitly), so speed-ups come from
  graphs, not from switching implementations.
* ``whole_layer`` (Llama only): ``cudagraphs.make_graphed_callables`` over a thin
  module per decoder layer taking ``(hidden_states, cos, sin)``; the layer's other
  arguments are those of a recorded eager call (no mask, fixed position ids), and
  each layer's ``forward`` is swapped for a call of it. MoE expert dispatch has
  data-dependent shapes, so Qwen3-MoE has no such variant.

Method. Per config and model all variants are built first and checked: the loss and
EVERY parameter's gradient after one step from zeroed gradients against eager's (worst
relative error ``max|x - eager| / max|eager|`` per tensor, and the worst tensor's
name). Then they are timed together with ``cudagraphs.timing.interleaved_samples_ms``
(rounds in a seeded shuffled order, GC off and frozen inside rounds) and reported as
``summarize`` (median, min, max, rounds); ratios use medians. Defaults:
``launch_bound`` 20 iters x 7 rounds, ``larger`` 10 iters x 7 rounds, 10 warmup steps
per variant. After every wall-clock timing of the run, each variant is built again and
its OWN kernel-busy time is profiled (CUPTI can slow later launches,
pytorch/pytorch#144455); ratios name their floor (``X/kernel_busy_eager``,
``X/kernel_busy_own``).

Prints one JSON object; ``--out`` also writes it (once more before the profiler runs).
Without a CUDA device it says so on stderr and exits 0 (2 with ``--require-gpu``).
Exits 1 after printing when a variant failed to build, check or time, or a check was
off by more than the tolerance (a failed kernel-busy measurement is recorded only).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import torch  # noqa: E402
from torch import nn  # noqa: E402

import _report  # noqa: E402,F401  (first: puts this checkout's src on sys.path)
import cudagraphs  # noqa: E402

# The training benchmarks share their check and timing helpers (one definition of
# "compare every gradient" and of a guarded interleaved step).
from _checks import compare_tensors, fresh_kernel_busy, guard_steps, ratio, relative_error  # noqa: E402
from _report import (  # noqa: E402
    add_common_arguments,
    add_round_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    kernel_busy_method,
    step_time_method,
    write_report,
)
from cudagraphs.partial import MODEL_SCOPE, SCOPES, PartialCudaGraphManager  # noqa: E402
from cudagraphs.timing import interleaved_samples_ms, summarize  # noqa: E402

NAME = "partial_train"
REGIME = "accumulate"
DEVICE = "cuda"
DTYPE = torch.bfloat16
ATTN = "sdpa"
MODEL_SEED = 0
INPUT_SEED = 1234
SHUFFLE_SEED = 0
WARMUP_STEPS = 10  # per variant before the timed rounds
CHECK_STEPS = 1  # the check's steps from zeroed gradients (they count as replays too)
KERNEL_BUSY_ITERS, KERNEL_BUSY_WARMUP = 10, 3
LOSS_REL_TOL = 1e-3  # of eager's loss
GRAD_REL_TOL = 2e-2  # of eager's gradient max |value| per tensor: bf16 rounding, not a bug
TARGET_SPEEDUP = 1.3  # eager / partial on launch_bound
MODELS = ("llama", "qwen3_moe", "mixtral", "deepseek_v3")
VARIANTS = (
    "eager",
    "partial",
    "partial_layers",
    "partial_widest",
    "partial_widest_compiled",
    "whole_layer",
    "eager_experts_loop",
)
# The widest scopes over compiled targets (compile_options={}): inductor's kernels in
# each graph. Its loss is not eager's bit for bit (fused kernels round otherwise), so
# it is checked within tolerance and left out of eager_equal_losses.
COMPILED = "partial_widest_compiled"
PARTIAL_SCOPES = ("attention", "moe_router")  # the narrow scopes (the first release's)
WIDEST_SCOPES = (*SCOPES, MODEL_SCOPE)
MOE_MODELS = ("qwen3_moe", "mixtral", "deepseek_v3")
EXPERTS = "grouped_mm"  # static shapes: the MoE implementation graphs can hold
# The widest scope against eager on the launch-bound config (issue targets).
WIDEST_TARGET = {"llama": 5.0, "qwen3_moe": 5.0, "mixtral": 3.0, "deepseek_v3": 3.0}


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int  # Llama MLP
    moe_intermediate: int  # per Qwen3-MoE expert
    iters: int
    repeats: int
    layers: int = 8
    experts: int = 8
    top_k: int = 2
    vocab: int = 1024  # small, so the LM head does not dominate


# iters: each sample >= ~20 ms even for whole_layer (~5 ms launch-bound, ~8 ms larger).
CONFIGS = {
    "launch_bound": Shape("launch_bound", 1, 128, 512, 8, 2, 1408, 256, iters=20, repeats=7),
    "larger": Shape("larger", 4, 512, 1024, 16, 4, 2816, 512, iters=10, repeats=7),
}


def hf_config(model: str, shape: Shape):
    import transformers

    head = shape.hidden // shape.heads
    kwargs: dict = dict(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=head,
        vocab_size=shape.vocab,
        tie_word_embeddings=False,
    )
    # Each model's own keys override the common ones above.
    if model == "qwen3_moe":  # every layer MoE; head_dim set, Qwen3's default is 128
        kwargs.update(moe_intermediate_size=shape.moe_intermediate, num_experts=shape.experts)
        kwargs.update(num_experts_per_tok=shape.top_k, decoder_sparse_step=1, mlp_only_layers=[])
    elif model == "mixtral":  # every layer MoE; experts of the MoE intermediate size
        kwargs.update(num_local_experts=shape.experts, num_experts_per_tok=shape.top_k)
        kwargs.update(intermediate_size=shape.moe_intermediate)
    elif model == "deepseek_v3":  # layer 0 dense, the rest MoE with a shared expert
        kwargs.update(n_routed_experts=shape.experts, num_experts_per_tok=shape.top_k)
        kwargs.update(moe_intermediate_size=shape.moe_intermediate, n_shared_experts=1)
        kwargs.update(first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None)
        # Multi-head latent attention has no grouped KV heads (DeepSeek-V3's own config
        # sets them equal): with fewer, transformers' SDPA path repeats the keys 4x when
        # it gets a mask (a graph capture makes one) and the shapes no longer match.
        kwargs.update(num_key_value_heads=shape.heads)
        kwargs.update(kv_lora_rank=head * 2, qk_rope_head_dim=head // 2)
        kwargs.update(qk_nope_head_dim=head // 2, v_head_dim=head)
        # Multi-head latent attention rotates only the rope part of each head: its
        # rotary tables are head_dim wide, so head_dim is the rope width here.
        kwargs.update(head_dim=head // 2)
    return transformers.AutoConfig.for_model(model, **kwargs)


@dataclass
class Built:
    """One variant, ready to time: its step (returns the detached loss), its model,
    and how to release it."""

    step: Callable[[], torch.Tensor]
    model: nn.Module
    setup_s: float
    release: Callable[[], None] = field(default=lambda: None)
    info: dict = field(default_factory=dict)
    stats: Callable[[], dict] | None = None


# ---- model, input, step ------------------------------------------------------------


def build_model(model: str, shape: Shape, experts: str = EXPERTS) -> nn.Module:
    """Random weights from ``MODEL_SEED`` (drawn on the CPU, so every variant gets the
    same ones), moved to the device; training mode, every ``.grad`` zero; MoE models
    run the ``experts`` implementation."""
    import transformers

    torch.manual_seed(MODEL_SEED)
    net = transformers.AutoModelForCausalLM.from_config(
        hf_config(model, shape), dtype=DTYPE, attn_implementation=ATTN
    )
    if model in MOE_MODELS:
        net.set_experts_implementation(experts)
    net = net.to(DEVICE).train()
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    return net


def make_ids(shape: Shape) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(INPUT_SEED)
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen, device=DEVICE)


def train_step(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss = net(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
    loss.backward()
    return loss.detach()


# ---- variants ----------------------------------------------------------------------


def build_eager(model: str, shape: Shape) -> Built:
    net, ids = build_model(model, shape), make_ids(shape)
    return Built(lambda: train_step(net, ids), net, 0.0)


def build_eager_experts_loop(model: str, shape: Shape) -> Built:
    if model not in MOE_MODELS:
        raise ValueError(f"{model} has no MoE experts")
    net, ids = build_model(model, shape, experts="eager"), make_ids(shape)
    return Built(lambda: train_step(net, ids), net, 0.0, info={"experts": "eager"})


def build_partial(
    model: str,
    shape: Shape,
    scopes: tuple[str, ...] = PARTIAL_SCOPES,
    compile_options: dict | None = None,
) -> Built:
    net, ids = build_model(model, shape), make_ids(shape)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mgr = PartialCudaGraphManager.from_model_parts(
        [net], scopes=scopes, compile_options=compile_options
    )
    if mgr is None:
        raise RuntimeError(f"PartialCudaGraphManager found nothing to graph in {model}")
    try:
        mgr.start_recording()
        train_step(net, ids)
        mgr.capture()
        torch.cuda.synchronize()
    except BaseException:
        mgr.close()
        raise
    kinds = Counter(d.target.kind for d in mgr.dispatchers)
    info = {"scopes": list(scopes), "graphed_targets": dict(kinds)}
    if compile_options is not None:
        info["compile_options"] = dict(compile_options)
    if model in MOE_MODELS:
        info["experts"] = EXPERTS
    narrowed = getattr(mgr, "narrowed", [])
    if narrowed:
        info["narrowed"] = [f"{b.name}: {b.reason}" for b in narrowed]
    setup_s = time.perf_counter() - t0
    return Built(lambda: train_step(net, ids), net, setup_s, mgr.close, info, mgr.stats)


class LayerAsFunction(nn.Module):
    """One decoder layer as a function of ``(hidden_states, cos, sin)``; the layer's
    other arguments are fixed (those of one recorded eager call)."""

    def __init__(self, layer: nn.Module, fixed: dict) -> None:
        super().__init__()
        self.layer = layer
        self.fixed = fixed

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        forward = type(self.layer).forward  # the class's: the instance's calls this one
        return forward(self.layer, hidden_states, position_embeddings=(cos, sin), **self.fixed)


def record_layer_call(net: nn.Module, ids: torch.Tensor) -> tuple[dict, tuple]:
    """Layer 0's keyword arguments in one eager forward: the fixed ones, (cos, sin)."""
    seen: dict = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.update(kwargs)

    handle = net.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            net(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    cos, sin = seen.pop("position_embeddings")
    if seen.get("attention_mask") is not None:
        raise RuntimeError("whole_layer: the layers get a mask tensor; the wrapper takes none")
    fixed = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in seen.items()}
    return fixed, (cos.clone(), sin.clone())


def build_whole_layer(model: str, shape: Shape) -> Built:
    net, ids = build_model(model, shape), make_ids(shape)
    layers = list(net.model.layers)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fixed, (cos, sin) = record_layer_call(net, ids)
    wrappers = tuple(LayerAsFunction(layer, fixed) for layer in layers)
    gen = torch.Generator(device=DEVICE).manual_seed(INPUT_SEED + 1)
    hidden = (shape.batch, shape.seq, shape.hidden)
    samples = tuple(
        (torch.randn(hidden, generator=gen, device=DEVICE, dtype=DTYPE).requires_grad_(),)
        + (cos.clone(), sin.clone())
        for _ in layers
    )
    # Returns the wrappers themselves, their forward swapped for the replay.
    cudagraphs.make_graphed_callables(wrappers, samples)
    del samples

    def release() -> None:
        for layer, wrapper in zip(layers, wrappers):
            layer.__dict__.pop("forward", None)
            graphed = wrapper.__dict__.get("cuda_graph")
            if graphed is not None:
                graphed.reset()

    def swapped(wrapper: LayerAsFunction) -> Callable[..., torch.Tensor]:
        def forward(hidden_states, *, position_embeddings, attention_mask=None, **_):
            if attention_mask is not None:
                raise RuntimeError("whole_layer: graphed without an attention mask")
            return wrapper(hidden_states, *position_embeddings)

        return forward

    for layer, wrapper in zip(layers, wrappers):
        layer.forward = swapped(wrapper)
    torch.cuda.synchronize()
    info = {"graphed_layers": len(layers), "fixed_kwargs": sorted(fixed)}
    return Built(lambda: train_step(net, ids), net, time.perf_counter() - t0, release, info)


BUILDERS: dict[str, Callable[[str, Shape], Built]] = {
    "eager": build_eager,
    "partial": build_partial,
    "partial_layers": partial(build_partial, scopes=SCOPES),
    "partial_widest": partial(build_partial, scopes=WIDEST_SCOPES),
    COMPILED: partial(build_partial, scopes=WIDEST_SCOPES, compile_options={}),
    "whole_layer": build_whole_layer,
    "eager_experts_loop": build_eager_experts_loop,
}


# ---- pure logic (tested on the CPU) --------------------------------------------------


def compare_step(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict:
    """A variant's step values (``loss`` and every gradient, by name) against eager's:
    the loss within ``LOSS_REL_TOL`` of eager's, every gradient within
    ``GRAD_REL_TOL`` of eager's max |value| (see ``train_step.compare_tensors``)."""
    loss_err = relative_error(got["loss"], want["loss"])
    grads = compare_tensors(
        {k: v for k, v in got.items() if k != "loss"},
        {k: v for k, v in want.items() if k != "loss"},
        GRAD_REL_TOL,
    )
    return {
        "loss": got["loss"].item(),
        "eager_loss": want["loss"].item(),
        "loss_rel_err": loss_err if math.isfinite(loss_err) else None,
        "grads": grads,
        "loss_equal": torch.equal(got["loss"], want["loss"]),
        "equal": grads["equal"] and torch.equal(got["loss"], want["loss"]),
        "within_tol": loss_err <= LOSS_REL_TOL and grads["within_tol"],
    }


RATIOS = [
    ("eager", "partial"),
    ("eager", "partial_layers"),
    ("eager", "partial_widest"),
    ("partial_layers", "partial_widest"),
    ("eager", "whole_layer"),
    ("partial", "whole_layer"),
    ("eager_experts_loop", "partial_widest"),
    ("eager", COMPILED),
    (COMPILED, "partial_widest"),
]
PARTIAL_VARIANTS = ("partial", "partial_layers", "partial_widest", COMPILED)
# Rows that show what another implementation costs, not a graphing of eager's work.
REFERENCE_VARIANTS = ("eager_experts_loop",)


def summarize_model(result: dict, shape: Shape, model: str = "llama") -> None:
    """Fill ``ms``, ``kernel_busy_ms``, ``ratios`` and ``targets`` of one (config,
    model) result from its variants' entries; ratios of medians, and each
    kernel-busy ratio names its floor (eager's, or the variant's own).

    Targets (None where a variant did not run): on ``launch_bound``,
    ``partial_speedup_ge_1.3x_launch_bound`` (the narrow scopes) and
    ``{model}_launch_bound_ge_{N}x_eager`` (the widest scope; N from
    ``WIDEST_TARGET``); on every config, ``zero_fallbacks`` (every partial row replays
    and falls back never) and ``eager_equal_losses`` (every graphed row's loss equals
    eager's bitwise; the experts-loop reference row runs other kernels and is not
    one).
    """
    variants = result["variants"]
    ms = {v: r["ms"]["median"] for v, r in variants.items() if "ms" in r}
    busy = {v: r["kernel_busy_ms"] for v, r in variants.items() if "kernel_busy_ms" in r}
    result["ms"], result["kernel_busy_ms"] = ms, busy
    ratios = {f"{a}/{b}": ratio(ms.get(a), ms.get(b)) for a, b in RATIOS}
    for v in variants:
        ratios[f"{v}/kernel_busy_eager"] = ratio(ms.get(v), busy.get("eager"))
        ratios[f"{v}/kernel_busy_own"] = ratio(ms.get(v), busy.get(v))
    result["ratios"] = ratios
    targets: dict[str, bool | None] = {}
    if shape.name == "launch_bound":
        speedup = ratios["eager/partial"]
        key = f"partial_speedup_ge_{TARGET_SPEEDUP}x_launch_bound"
        targets[key] = None if speedup is None else speedup >= TARGET_SPEEDUP
        widest, need = ratios["eager/partial_widest"], WIDEST_TARGET.get(model)
        if need is not None:
            key = f"{model}_launch_bound_ge_{need:g}x_eager"
            targets[key] = None if widest is None else widest >= need
    stats = [variants[v]["stats"] for v in PARTIAL_VARIANTS if "stats" in variants.get(v, {})]
    targets["zero_fallbacks"] = (
        None if not stats else all(s["fallbacks"] == 0 and s["replayed"] > 0 for s in stats)
    )
    checks = [
        c
        for v, c in result.get("check", {}).items()
        if v not in REFERENCE_VARIANTS and v != COMPILED
    ]
    targets["eager_equal_losses"] = (
        None if not checks else all(c.get("loss_equal", False) for c in checks)
    )
    result["targets"] = targets


def flat_targets(report: dict) -> dict[str, bool | None]:
    """Every (config, model) target under one name: a key that already names its model
    and config (``llama_launch_bound_ge_5x_eager``) as it is, others as
    ``{model}_{config}_{key}``."""
    flat: dict[str, bool | None] = {}
    for cname, cres in report["configs"].items():
        for model, res in cres["models"].items():
            for key, value in res.get("targets", {}).items():
                named = key.startswith(f"{model}_{cname}_")
                flat[key if named else f"{model}_{cname}_{key}"] = value
    return flat


def failures(report: dict) -> list[str]:
    """Every failed variant (build, check or timing) and every check beyond tolerance
    but those of :data:`REFERENCE_VARIANTS`; a failed kernel-busy measurement is not
    one."""
    failed = []
    for cname, cres in report["configs"].items():
        for model, res in cres["models"].items():
            where = f"{cname}/{model}"
            failed += [f"{where}/{v}" for v, r in res["variants"].items() if "error" in r]
            for v, check in res["check"].items():
                # A reference row runs other math (eager experts): its check is
                # recorded, not required.
                if v not in REFERENCE_VARIANTS and not check.get("within_tol", False):
                    failed.append(f"{where}/{v}: check " + check.get("error", "beyond tolerance"))
    return failed


# ---- measurement ---------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def one_step(built: Built) -> dict[str, torch.Tensor]:
    """Loss and every gradient (by parameter name) of one step from zeroed gradients,
    as owned copies."""
    for p in built.model.parameters():
        if p.grad is not None:
            p.grad.zero_()  # in place: graphs may add into these very tensors
    out = {"loss": built.step().float().clone()}
    for name, p in built.model.named_parameters():
        if p.grad is not None:
            out[name] = p.grad.detach().clone()
    torch.cuda.synchronize()
    return out


def release(built: Built) -> None:
    """Release one variant's graphs; an error is printed, never raised."""
    try:
        built.release()
    except Exception as exc:
        describe_error(exc)


def build_and_check(model: str, shape: Shape, names: list[str]) -> tuple[dict, dict, dict]:
    """Build every variant, then check each against eager's step: ``(built, results,
    checks)``. A variant that fails is recorded in ``results`` and not kept."""
    built: dict[str, Built] = {}
    results: dict[str, dict] = {}
    for name in names:
        log(f"{shape.name}/{model}: build {name}")
        try:
            built[name] = b = BUILDERS[name](model, shape)
        except Exception as exc:
            results[name] = describe_error(exc)
            continue
        results[name] = {"setup_s": round(b.setup_s, 3), **b.info}
    checks: dict[str, dict] = {}
    ref = None
    for name in list(built):
        try:
            values = one_step(built[name])
        except Exception as exc:
            results[name].update(describe_error(exc))
            release(built.pop(name))
            continue
        if name == "eager":
            ref = values
        elif ref is None:
            checks[name] = {"error": "no eager step to compare with"}
        else:
            checks[name] = compare_step(values, ref)
        del values
    return built, results, checks


def time_all(built: dict[str, Built], shape: Shape, results: dict) -> None:
    errors: dict[str, dict] = {}
    steps = guard_steps({name: b.step for name, b in built.items()}, errors)
    try:
        samples = interleaved_samples_ms(
            steps,
            iters=shape.iters,
            warmup=WARMUP_STEPS,
            repeats=shape.repeats,
            shuffle_seed=SHUFFLE_SEED,
        )
    except Exception as exc:  # a sticky CUDA error surfaces at the round's synchronize
        error = describe_error(exc)
        for name in steps:
            results[name].update(error)
        return
    steps_run = CHECK_STEPS + WARMUP_STEPS + shape.iters * shape.repeats
    for name, times in samples.items():
        if name in errors:
            results[name].update(errors[name])
            continue
        results[name]["ms"] = summarize(times)
        if built[name].stats is not None:  # every step so far ran after capture
            results[name]["stats"] = stats = built[name].stats()
            results[name]["replays_per_step"] = round(stats["replayed"] / steps_run, 3)


def run_model(model: str, shape: Shape, variants: list[str]) -> dict:
    started = time.perf_counter()
    names = [
        v
        for v in variants
        if (v != "whole_layer" or model == "llama")
        and (v != "eager_experts_loop" or model in MOE_MODELS)
    ]
    built, results, checks = build_and_check(model, shape, names)
    try:
        log(f"{shape.name}/{model}: timing {len(built)} variants")
        time_all(built, shape, results)
    finally:
        for b in built.values():
            release(b)
        built.clear()
        free_memory()
    result = {"regime": REGIME, "variants": results, "check": checks}
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    summarize_model(result, shape, model)
    return result


def profile_variant(variant: str, model: str, shape: Shape) -> dict:
    """The variant's own kernel-busy time, on a fresh build: ``{"kernel_busy_ms"}``
    or ``{"kernel_busy_error", ...}``."""
    log(f"{shape.name}/{model}: kernel busy of {variant}")
    return fresh_kernel_busy(
        lambda: BUILDERS[variant](model, shape),
        release,
        iters=KERNEL_BUSY_ITERS,
        warmup=KERNEL_BUSY_WARMUP,
    )


def profile_all(shapes: list[Shape], report: dict) -> None:
    for shape in shapes:
        for model, res in report["configs"][shape.name]["models"].items():
            for variant, entry in res["variants"].items():
                if "ms" in entry:
                    entry.update(profile_variant(variant, model, shape))
            summarize_model(res, shape, model)


# ---- report and CLI ------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="eager always runs (the reference)",
    )
    add_round_arguments(p)
    add_common_arguments(p)
    return p.parse_args(argv)


def settings(models: list[str], variants: list[str]) -> dict:
    return {
        "models": models,
        "variants": variants,
        "regime": f"{REGIME}: forward + backward, no optimizer; every .grad zeroed once, "
        "every step adds into it",
        "dtype": str(DTYPE).removeprefix("torch."),
        "attn_implementation": ATTN,
        "experts_implementation": f"{EXPERTS} in every MoE variant but eager_experts_loop",
        "scopes": {
            "partial": list(PARTIAL_SCOPES),
            "partial_layers": list(SCOPES),
            "partial_widest": list(WIDEST_SCOPES),
            COMPILED: f"{list(WIDEST_SCOPES)}, compile_options={{}}",
        },
        "warmup": WARMUP_STEPS,
        "step_time": step_time_method(SHUFFLE_SEED),
        "kernel_busy": kernel_busy_method(KERNEL_BUSY_ITERS, KERNEL_BUSY_WARMUP),
        "check": f"{CHECK_STEPS} step from zeroed grads: loss and every gradient vs eager",
        "loss_rel_tol": LOSS_REL_TOL,
        "grad_rel_tol": GRAD_REL_TOL,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = exit_code_without_gpu(NAME, args.require_gpu)
    if code is not None:
        return code
    try:
        import transformers
    except ImportError:
        print(f"{NAME}: needs transformers (pip install -e '.[hf]').", file=sys.stderr)
        return 1
    started = time.perf_counter()
    overrides = {k: v for k, v in {"iters": args.iters, "repeats": args.repeats}.items() if v}
    shapes = [replace(CONFIGS[name], **overrides) for name in args.configs]
    variants = ["eager", *(v for v in VARIANTS if v in args.variants and v != "eager")]
    report = environment(NAME, args.commit, args.run_label)
    report["transformers"] = transformers.__version__
    report["settings"] = settings(args.models, variants)
    report["configs"] = {
        s.name: {
            "settings": asdict(s),
            "models": {m: run_model(m, s, variants) for m in args.models},
        }
        for s in shapes
    }
    # Written once before the profiler too, so a crash there keeps the timings.
    write_report(NAME, report, args.out, final=False)
    if not args.skip_kernel_busy:
        profiling = time.perf_counter()
        profile_all(shapes, report)
        report["kernel_busy_elapsed_s"] = round(time.perf_counter() - profiling, 1)
    report["targets"] = flat_targets(report)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(NAME, report, args.out, final=True)
    failed = failures(report)
    if failed:
        print(f"{NAME}: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
