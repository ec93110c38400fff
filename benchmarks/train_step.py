"""Training-step benchmark: a stack of pre-norm transformer blocks, forward + backward.

For each config, in one process, every variant gets its own freshly made stack (same
seed) and its own input (same seed), and runs the same per-step Python:

    out = forward(x); out.float().pow(2).mean().backward()

Variants:

* ``eager``: the blocks one after another.
* ``torch_make_graphed_callables``: ``torch.cuda.make_graphed_callables`` per block.
* ``cudagraphs``: ``cudagraphs.make_graphed_callables``, same arguments (defaults).
* ``cudagraphs_no_clone``: the same with ``clone_param_grads_on_return=False``, which
  is what the torch helper does (it hands out views of its static gradient buffers).
* ``cudagraphs_in_graph``: per block, with ``accumulate_grads_in_graph=True``: the
  backward graphs add the parameter gradients into ``.grad`` themselves.
* ``cudagraphs_stack``: ``cudagraphs.graph_stack`` over all blocks: one forward and
  one backward graph behind one autograd node (gradients handed to autograd).
* ``cudagraphs_stack_in_graph``: the whole stack with in-graph accumulation: a step
  runs no per-parameter kernel outside the graphs.
* ``raw_cuda_graph``: one ``torch.cuda.CUDAGraph`` holding forward, loss and backward
  (gradient accumulation included); a step is one input copy and one replay. The
  launch-free reference.
* ``torch_compile_reduce_overhead``: ``torch.compile(mode="reduce-overhead")`` of the
  forward over the stack (AOTAutograd graphs the backward too). A failure here
  (no Triton, ...) is recorded, not raised.
* ``kernel_busy``: profiler kernel-busy time of the eager step, the physical floor.

There is no optimizer: every parameter gets a zero ``.grad`` before graphing and the
step only accumulates into it, so every variant does the same work (an in-place add
per parameter) and no variant's ``.grad`` can alias a graph's static buffer.

Prints one JSON object; ``--out`` also writes it. Without a CUDA device it says so on
stderr and exits 0 (2 with ``--require-gpu``). Exits 1 after printing when a variant
other than torch.compile failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
from cudagraphs.models import BlockConfig, make_block_stack  # noqa: E402
from cudagraphs.timing import kernel_busy_ms, step_time_ms  # noqa: E402

DEVICE = "cuda"
NUM_LAYERS = 8
DTYPE = torch.bfloat16
STACK_SEED = 0
INPUT_SEED = 1234
WARMUP_STEPS = 10  # before timing; also records torch.compile's cudagraph trees
CHECK_STEPS = 3  # steps from zeroed grads before comparing layer-0 grads with eager
GRAD_REL_TOL = 2e-2  # of the eager gradient's max |value|: bf16 rounding, not a bug
COMPILE_VARIANT = "torch_compile_reduce_overhead"
# Failures of these are recorded and do not change the exit status: neither is ours.
NOT_FATAL = (COMPILE_VARIANT, "kernel_busy")


@dataclass(frozen=True)
class BenchConfig:
    name: str
    block: BlockConfig
    batch: int
    seq: int
    iters: int
    repeats: int

    def describe(self) -> dict:
        b = self.block
        return {
            "layers": NUM_LAYERS,
            "hidden": b.hidden,
            "heads": b.heads,
            "ffn": b.ffn,
            "batch": self.batch,
            "seq": self.seq,
            "dtype": str(DTYPE).removeprefix("torch."),
            "iters": self.iters,
            "repeats": self.repeats,
            "warmup": WARMUP_STEPS,
        }


CONFIGS = {
    "launch_bound": BenchConfig("launch_bound", BlockConfig(512, 8, 2048), 1, 64, 50, 5),
    "compute_bound": BenchConfig("compute_bound", BlockConfig(2048, 16, 8192), 2, 512, 20, 5),
}


@dataclass
class Built:
    """One variant, ready to time: its step, its stack, and how to release it."""

    step: Callable[[], None]
    blocks: nn.ModuleList
    setup_s: float
    release: Callable[[], None] = field(default=lambda: None)


# ---- model, input, step ------------------------------------------------------------


def make_stack(cfg: BenchConfig) -> nn.ModuleList:
    """A fresh stack in training mode, every parameter with a zero ``.grad``."""
    blocks = make_block_stack(NUM_LAYERS, cfg.block, device=DEVICE, dtype=DTYPE, seed=STACK_SEED)
    blocks.train()
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    return blocks


def make_input(cfg: BenchConfig, *, requires_grad: bool = False, seed: int = INPUT_SEED):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (cfg.batch, cfg.seq, cfg.block.hidden)
    x = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    return x.requires_grad_(requires_grad)


def sample_args(cfg: BenchConfig) -> tuple[tuple[torch.Tensor], ...]:
    """Layer 0 reads the (non-differentiable) input, later layers an activation."""
    return tuple((make_input(cfg, requires_grad=i > 0, seed=i),) for i in range(NUM_LAYERS))


def run_stack(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def train_step(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    out = forward(x)
    out.float().pow(2).mean().backward()


def zero_grads(blocks: nn.ModuleList) -> None:
    # In place: the raw graph accumulates into these very tensors.
    for p in blocks.parameters():
        p.grad.zero_()


# ---- variants ----------------------------------------------------------------------


def build_eager(cfg: BenchConfig) -> Built:
    blocks, x = make_stack(cfg), make_input(cfg)

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return run_stack(blocks, inp)

    return Built(lambda: train_step(forward, x), blocks, 0.0)


def _build_per_layer(cfg: BenchConfig, graph_fn: Callable[..., object], **kwargs) -> Built:
    blocks, x = make_stack(cfg), make_input(cfg)
    samples = sample_args(cfg)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    # Both helpers return the modules themselves with ``forward`` swapped, so the step
    # is the eager step, Python for Python.
    graph_fn(tuple(blocks), samples, **kwargs)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    del samples

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return run_stack(blocks, inp)

    def release() -> None:
        for block in blocks:
            graphed = block.__dict__.get("cuda_graph")
            if graphed is not None:
                graphed.reset()

    return Built(lambda: train_step(forward, x), blocks, setup_s, release)


def build_torch_helper(cfg: BenchConfig) -> Built:
    return _build_per_layer(cfg, torch.cuda.make_graphed_callables)


def build_ours(cfg: BenchConfig) -> Built:
    return _build_per_layer(cfg, cudagraphs.make_graphed_callables)


def build_ours_no_clone(cfg: BenchConfig) -> Built:
    return _build_per_layer(
        cfg, cudagraphs.make_graphed_callables, clone_param_grads_on_return=False
    )


def build_ours_in_graph(cfg: BenchConfig) -> Built:
    return _build_per_layer(cfg, cudagraphs.make_graphed_callables, accumulate_grads_in_graph=True)


def _build_stack(cfg: BenchConfig, **kwargs) -> Built:
    blocks, x = make_stack(cfg), make_input(cfg)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stack = cudagraphs.graph_stack(list(blocks), (make_input(cfg, seed=0),), **kwargs)
    torch.cuda.synchronize()
    return Built(lambda: train_step(stack, x), blocks, time.perf_counter() - t0, stack.reset)


def build_stack(cfg: BenchConfig) -> Built:
    return _build_stack(cfg)


def build_stack_in_graph(cfg: BenchConfig) -> Built:
    return _build_stack(cfg, accumulate_grads_in_graph=True)


def build_raw_graph(cfg: BenchConfig) -> Built:
    blocks, x = make_stack(cfg), make_input(cfg)
    static_x = x.clone()

    def body() -> None:
        train_step(lambda inp: run_stack(blocks, inp), static_x)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    # Whole-network capture as in the PyTorch CUDA-graphs notes: warm up on a side
    # stream (cuBLAS workspaces, autograd state), then capture forward + backward.
    # The grads exist already, so the captured AccumulateGrad adds into them in place.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0

    def step() -> None:
        static_x.copy_(x)
        graph.replay()

    return Built(step, blocks, setup_s, graph.reset)


def build_compile(cfg: BenchConfig) -> Built:
    blocks, x = make_stack(cfg), make_input(cfg)

    def stack_forward(inp: torch.Tensor) -> torch.Tensor:
        return run_stack(blocks, inp)

    compiled = torch.compile(stack_forward, mode="reduce-overhead")

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        train_step(compiled, x)

    # Compilation happens on the first steps; setup_s counts it with cudagraph-tree
    # warmup and recording (the first three steps).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    except BaseException:
        torch.compiler.reset()  # drop half-made compiled code and cudagraph trees
        raise
    return Built(step, blocks, time.perf_counter() - t0, torch.compiler.reset)


VARIANTS: dict[str, Callable[[BenchConfig], Built]] = {
    "eager": build_eager,
    "torch_make_graphed_callables": build_torch_helper,
    "cudagraphs": build_ours,
    "cudagraphs_no_clone": build_ours_no_clone,
    "cudagraphs_in_graph": build_ours_in_graph,
    "cudagraphs_stack": build_stack,
    "cudagraphs_stack_in_graph": build_stack_in_graph,
    "raw_cuda_graph": build_raw_graph,
    COMPILE_VARIANT: build_compile,
}


# ---- measurement -------------------------------------------------------------------


def layer0_grad(built: Built) -> torch.Tensor:
    """Layer 0's qkv weight gradient after ``CHECK_STEPS`` steps from zeroed grads."""
    zero_grads(built.blocks)
    for _ in range(CHECK_STEPS):
        built.step()
    torch.cuda.synchronize()
    return built.blocks[0].qkv.weight.grad.detach().float().clone()


def _timed(built: Built, cfg: BenchConfig, profile: bool) -> tuple[dict, torch.Tensor, dict | None]:
    grad = layer0_grad(built)
    ms = step_time_ms(built.step, iters=cfg.iters, warmup=WARMUP_STEPS, repeats=cfg.repeats)
    result = {"ms": ms, "setup_s": round(built.setup_s, 3)}
    busy = None
    if profile:
        try:
            busy = {"ms": kernel_busy_ms(built.step)}
        except Exception as exc:
            busy = describe_error(exc)
    return result, grad, busy


def measure(
    name: str, cfg: BenchConfig, *, profile: bool = False, timed: bool = True
) -> tuple[dict, torch.Tensor | None, dict | None]:
    """Build one variant, take its layer-0 gradient, time it (and with ``profile`` its
    kernel-busy time). Errors are returned as ``{"error": ...}``, never raised."""
    print(f"train_step: {cfg.name}: {name}", file=sys.stderr, flush=True)
    builder = build_eager if name == "eager_repeat" else VARIANTS[name]
    try:
        built = builder(cfg)
    except Exception as exc:
        return describe_error(exc), None, None
    try:
        if not timed:
            return {}, layer0_grad(built), None
        return _timed(built, cfg, profile)
    except Exception as exc:
        return describe_error(exc), None, None
    finally:
        try:
            built.release()
        except Exception as exc:
            describe_error(exc)


def grad_check(grads: dict[str, torch.Tensor]) -> dict:
    """Max |grad - eager grad| of layer 0's qkv weight per variant. ``eager_repeat`` is
    a second eager stack: its difference is the run-to-run noise of the kernels."""
    ref = grads.get("eager")
    if ref is None:
        return {"error": "no eager gradient to compare with"}
    scale = ref.abs().max().item()
    diffs = {n: (g - ref).abs().max().item() for n, g in grads.items() if n != "eager"}
    return {
        "param": "blocks[0].qkv.weight.grad",
        "steps": CHECK_STEPS,
        "ref_max_abs": scale,
        "max_abs_diff": diffs,
        "rel_tol": GRAD_REL_TOL,
        "within_tol": {n: d <= GRAD_REL_TOL * scale for n, d in diffs.items()},
    }


RATIOS = [
    ("cudagraphs", "torch_make_graphed_callables"),
    ("cudagraphs", "eager"),
    ("cudagraphs", "kernel_busy"),
    ("cudagraphs_no_clone", "torch_make_graphed_callables"),
    ("cudagraphs_no_clone", "kernel_busy"),
    ("cudagraphs_in_graph", "torch_make_graphed_callables"),
    ("cudagraphs_in_graph", "kernel_busy"),
    ("cudagraphs_stack", "torch_make_graphed_callables"),
    ("cudagraphs_stack", "kernel_busy"),
    ("cudagraphs_stack_in_graph", "torch_make_graphed_callables"),
    ("cudagraphs_stack_in_graph", "kernel_busy"),
    ("cudagraphs_stack_in_graph", "raw_cuda_graph"),
    ("torch_make_graphed_callables", "kernel_busy"),
    ("eager", "kernel_busy"),
    ("raw_cuda_graph", "kernel_busy"),
    (COMPILE_VARIANT, "kernel_busy"),
]


def ratios(ms: dict[str, float]) -> dict[str, float | None]:
    out = {}
    for a, b in RATIOS:
        ok = a in ms and b in ms and ms[b] > 0
        out[f"{a}/{b}"] = round(ms[a] / ms[b], 4) if ok else None
    return out


def targets(cfg: BenchConfig, ms: dict[str, float]) -> dict[str, bool | None]:
    """The core issue's target (per-layer graphs no slower than torch's helper) and the
    fast-path issue's: launch-bound, the whole stack with in-graph accumulation within
    1.5x kernel-busy time and 0.35x torch's helper; compute-bound, no slower than it."""

    def at_most(a: str, b: str, factor: float = 1.0) -> bool | None:
        return None if a not in ms or b not in ms else ms[a] <= factor * ms[b]

    helper, fast = "torch_make_graphed_callables", "cudagraphs_stack_in_graph"
    out = {"cudagraphs_le_torch_make_graphed_callables": at_most("cudagraphs", helper)}
    if cfg.name == "launch_bound":
        out[f"{fast}_le_1.5x_kernel_busy"] = at_most(fast, "kernel_busy", 1.5)
        out[f"{fast}_le_0.35x_{helper}"] = at_most(fast, helper, 0.35)
    else:
        out[f"{fast}_le_{helper}"] = at_most(fast, helper)
    return out


def run_config(cfg: BenchConfig, variants: list[str]) -> dict:
    results: dict[str, dict] = {}
    grads: dict[str, torch.Tensor] = {}
    for name in variants:
        result, grad, busy = measure(name, cfg, profile=name == "eager")
        results[name] = result
        if busy is not None:
            results["kernel_busy"] = busy
        if grad is not None:
            grads[name] = grad
        free_memory()
    if "eager" in grads:
        _, grad, _ = measure("eager_repeat", cfg, timed=False)
        if grad is not None:
            grads["eager_repeat"] = grad
        free_memory()
    ms = {n: r["ms"] for n, r in results.items() if "ms" in r}
    report = {
        "settings": cfg.describe(),
        "ms": ms,
        "variants": results,
        "ratios": ratios(ms),
        "targets": targets(cfg, ms),
        "grad_check": grad_check(grads),
    }
    del grads
    free_memory()
    return report


# ---- report and CLI ----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--iters", type=int, help="timed steps per repeat (default: per config)")
    p.add_argument("--repeats", type=int, help="repeats, median taken (default: per config)")
    add_common_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = exit_code_without_gpu("train_step", args.require_gpu)
    if code is not None:
        return code
    overrides = {k: v for k, v in {"iters": args.iters, "repeats": args.repeats}.items() if v}
    configs = [replace(CONFIGS[name], **overrides) for name in args.configs]
    report = environment("train_step", args.commit, args.run_label)
    report["settings"] = {
        "variants": args.variants,
        "warmup": WARMUP_STEPS,
        "check_steps": CHECK_STEPS,
        "kernel_busy": "cudagraphs.timing.kernel_busy_ms defaults (iters=20, warmup=5)",
        "iters": {c.name: c.iters for c in configs},
        "repeats": {c.name: c.repeats for c in configs},
        "step_time": "median over repeats of the mean wall time of iters steps",
    }
    report["configs"] = {c.name: run_config(c, args.variants) for c in configs}
    write_report("train_step", report, args.out, final=True)
    failed = [
        f"{c}/{v}"
        for c, res in report["configs"].items()
        for v, r in res["variants"].items()
        if "error" in r and v not in NOT_FATAL
    ]
    if failed:
        print(f"train_step: failed variants: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
