"""Partial-graph training benchmark: ``PartialCudaGraphManager`` on Hugging Face Llama
and Qwen3-MoE training steps, against eager and (Llama) whole decoder-layer graphs.

Models are built from config with random weights, in bf16, training mode, SDPA. A step
is forward + backward, no optimizer: ``model(input_ids=ids, use_cache=False)``, then
``logits.float().pow(2).mean().backward()``. Every ``.grad`` starts at zero and steps
add into it. Per config and model, each variant builds its own model and input (same
seeds), in one process:

* ``eager``: the model as built (always run: the reference of the checks).
* ``partial``: ``PartialCudaGraphManager.from_model_parts([model])``,
  ``start_recording()``, one eager step, ``capture()``; later steps replay. Its
  ``stats()`` after timing go into the report.
* ``whole_layer`` (Llama only): ``cudagraphs.make_graphed_callables`` over a thin
  module per decoder layer taking ``(hidden_states, cos, sin)``; the layer's other
  arguments are those of a recorded eager call (no mask, fixed position ids), and
  each layer's ``forward`` is swapped for a call of it. MoE expert dispatch has
  data-dependent shapes, so Qwen3-MoE has no such variant.
* ``kernel_busy``: profiler kernel-busy time of the eager step, after every wall-clock
  timing of the run (CUPTI can slow later launches, pytorch/pytorch#144455).

Before timing, each variant's loss and probe gradients after one step from zeroed
gradients are compared with eager's. Prints one JSON object; ``--out`` also writes it.
Without a CUDA device it says so on stderr and exits 0 (2 with ``--require-gpu``).
Exits 1 after printing when a variant other than ``kernel_busy`` failed or a check
was off by more than the tolerance.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO / "src") not in sys.path:
    # Run against this checkout's sources, also without PYTHONPATH=src.
    sys.path.insert(0, str(_REPO / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphs  # noqa: E402
from _report import (  # noqa: E402
    add_common_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    write_report,
)
from cudagraphs.partial import PartialCudaGraphManager  # noqa: E402
from cudagraphs.timing import kernel_busy_ms, step_time_ms  # noqa: E402

NAME = "partial_train"
DEVICE = "cuda"
DTYPE = torch.bfloat16
ATTN = "sdpa"
MODEL_SEED = 0
INPUT_SEED = 1234
WARMUP_STEPS = 10  # per step_time_ms call
LOSS_REL_TOL = 1e-3  # of eager's loss
GRAD_REL_TOL = 2e-2  # of eager's gradient max |value|: bf16 rounding, not a bug
TARGET_SPEEDUP = 1.3  # eager / partial on launch_bound
MODELS = ("llama", "qwen3_moe")
VARIANTS = ("eager", "partial", "whole_layer")
NOT_FATAL = ("kernel_busy",)


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


CONFIGS = {
    "launch_bound": Shape("launch_bound", 1, 128, 512, 8, 2, 1408, 256, iters=50, repeats=5),
    "larger": Shape("larger", 4, 512, 1024, 16, 4, 2816, 512, iters=20, repeats=5),
}


def hf_config(model: str, shape: Shape):
    import transformers

    extra = {}
    if model == "qwen3_moe":  # every layer MoE; head_dim set, Qwen3's default is 128
        extra = dict(moe_intermediate_size=shape.moe_intermediate, num_experts=shape.experts)
        extra.update(num_experts_per_tok=shape.top_k, decoder_sparse_step=1, mlp_only_layers=[])
    return transformers.AutoConfig.for_model(
        model,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        vocab_size=shape.vocab,
        tie_word_embeddings=False,
        **extra,
    )


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


def build_model(model: str, shape: Shape) -> nn.Module:
    """Random weights from ``MODEL_SEED`` (drawn on the CPU, so every variant gets the
    same ones), moved to the device; training mode, every ``.grad`` zero."""
    import transformers

    torch.manual_seed(MODEL_SEED)
    net = transformers.AutoModelForCausalLM.from_config(
        hf_config(model, shape), dtype=DTYPE, attn_implementation=ATTN
    )
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


def probes(net: nn.Module) -> dict[str, nn.Parameter]:
    """Gradients compared with eager: layer 0's query projection, and the router."""
    layer = net.model.layers[0]
    out = {"model.layers.0.self_attn.q_proj.weight": layer.self_attn.q_proj.weight}
    gate = getattr(layer.mlp, "gate", None)
    if isinstance(getattr(gate, "weight", None), nn.Parameter):
        out["model.layers.0.mlp.gate.weight"] = gate.weight
    return out


# ---- variants ----------------------------------------------------------------------


def build_eager(model: str, shape: Shape) -> Built:
    net, ids = build_model(model, shape), make_ids(shape)
    return Built(lambda: train_step(net, ids), net, 0.0)


def build_partial(model: str, shape: Shape) -> Built:
    net, ids = build_model(model, shape), make_ids(shape)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mgr = PartialCudaGraphManager.from_model_parts([net])
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
    kinds = Counter(entry.target.kind for entry in mgr.entries)
    info = {"graphed_targets": dict(kinds)}
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
    "whole_layer": build_whole_layer,
}


# ---- measurement -------------------------------------------------------------------


def one_step(built: Built) -> dict[str, torch.Tensor]:
    """Loss and probe gradients of one step from zeroed gradients (owned copies)."""
    for p in built.model.parameters():
        p.grad.zero_()  # in place: graphs may add into these very tensors
    out = {"loss": built.step().float().clone()}
    out.update({n: p.grad.detach().float().clone() for n, p in probes(built.model).items()})
    torch.cuda.synchronize()
    return out


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict:
    out: dict = {"equal": all(torch.equal(got[k], want[k]) for k in want), "max_abs_diff": {}}
    ok = True
    for key, ref in want.items():
        diff = (got[key] - ref).abs().max().item()
        tol = (LOSS_REL_TOL if key == "loss" else GRAD_REL_TOL) * ref.abs().max().item()
        out["max_abs_diff"][key] = diff
        ok = ok and diff <= tol
    out["loss"], out["eager_loss"] = got["loss"].item(), want["loss"].item()
    out["within_tol"] = ok
    return out


def measure(
    variant: str, model: str, shape: Shape, ref: dict | None
) -> tuple[dict, dict | None, dict | None]:
    """Build, check against ``ref`` (eager's step), time and release one variant:
    ``(result, its step values, check)``. Errors are returned, never raised."""
    print(f"{NAME}: {shape.name}/{model}: {variant}", file=sys.stderr, flush=True)
    try:
        built = BUILDERS[variant](model, shape)
    except Exception as exc:
        return describe_error(exc), None, None
    values = check = None
    try:
        values = one_step(built)
        if variant != "eager":
            check = compare(values, ref) if ref else {"error": "no eager step to compare with"}
        ms = step_time_ms(built.step, iters=shape.iters, warmup=WARMUP_STEPS, repeats=shape.repeats)
        result = {"ms": ms, "setup_s": round(built.setup_s, 3), **built.info}
        if built.stats is not None:  # every step so far ran after capture
            steps = 1 + WARMUP_STEPS + shape.iters * shape.repeats
            result["stats"] = stats = built.stats()
            result["replays_per_step"] = round(stats["replayed"] / steps, 3)
        return result, values, check
    except Exception as exc:
        return describe_error(exc), values, check
    finally:
        try:
            built.release()
        except Exception as exc:
            describe_error(exc)


def measure_kernel_busy(model: str, shape: Shape) -> dict:
    print(f"{NAME}: {shape.name}/{model}: kernel_busy", file=sys.stderr, flush=True)
    try:
        step = build_eager(model, shape).step
        return {"ms": kernel_busy_ms(step)}
    except Exception as exc:
        return describe_error(exc)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


RATIOS = [("eager", "partial"), ("eager", "whole_layer"), ("partial", "whole_layer")]
RATIOS += [(v, "kernel_busy") for v in ("partial", "whole_layer", "eager")]


def summarize(result: dict, shape: Shape) -> None:
    """Fill ``ms``, ``ratios`` and ``targets`` of one (config, model) result."""
    ms = {v: r["ms"] for v, r in result["variants"].items() if "ms" in r}
    result["ms"] = ms
    result["ratios"] = {f"{a}/{b}": ratio(ms.get(a), ms.get(b)) for a, b in RATIOS}
    stats = result["variants"].get("partial", {}).get("stats")
    targets: dict[str, bool | None] = {}
    if shape.name == "launch_bound":
        speedup = result["ratios"]["eager/partial"]
        key = f"partial_speedup_ge_{TARGET_SPEEDUP}x_launch_bound"
        targets[key] = None if speedup is None else speedup >= TARGET_SPEEDUP
    targets["zero_fallbacks_steady_state"] = (
        None if stats is None else stats["fallbacks"] == 0 and stats["replayed"] > 0
    )
    result["targets"] = targets


def run_model(model: str, shape: Shape, variants: list[str]) -> dict:
    result: dict = {"variants": {}, "check": {}}
    ref = None
    for variant in variants:
        if variant == "whole_layer" and model != "llama":
            continue
        out, values, check = measure(variant, model, shape, ref)
        result["variants"][variant] = out
        if variant == "eager":
            ref = values
        elif check is not None:
            result["check"][variant] = check
        del values
        free_memory()
    summarize(result, shape)
    return result


# ---- report and CLI ----------------------------------------------------------------


def failures(report: dict) -> list[str]:
    failed = []
    for cname, cres in report["configs"].items():
        for model, res in cres["models"].items():
            where = f"{cname}/{model}"
            errors = [v for v, r in res["variants"].items() if "error" in r]
            failed += [f"{where}/{v}" for v in errors if v not in NOT_FATAL]
            for v, check in res["check"].items():
                if not check.get("within_tol", False):
                    failed.append(f"{where}/{v}: check " + check.get("error", "beyond tolerance"))
    return failed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--iters", type=int, help="timed steps per repeat (default: per config)")
    p.add_argument("--repeats", type=int, help="repeats, median taken (default: per config)")
    p.add_argument("--skip-kernel-busy", action="store_true")
    add_common_arguments(p)
    return p.parse_args(argv)


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
    report["settings"] = {
        "models": args.models,
        "variants": variants,
        "dtype": str(DTYPE).removeprefix("torch."),
        "attn_implementation": ATTN,
        "warmup": WARMUP_STEPS,
        "step_time": "median over repeats of the mean wall time of iters steps",
        "kernel_busy": "kernel_busy_ms defaults of the eager step, after all timings",
        "loss_rel_tol": LOSS_REL_TOL,
        "grad_rel_tol": GRAD_REL_TOL,
    }
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
        for shape in shapes:
            for model, res in report["configs"][shape.name]["models"].items():
                res["variants"]["kernel_busy"] = measure_kernel_busy(model, shape)
                summarize(res, shape)
                free_memory()
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(NAME, report, args.out, final=True)
    failed = failures(report)
    if failed:
        print(f"{NAME}: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
