"""Main job: ``python -m cudagraphs``.

Graphs an embedded stack of pre-norm transformer blocks with
:func:`cudagraphs.make_graphed_callables` and prints the eager and graphed training
step times next to the GPU's kernel-busy time (the floor); then a
:class:`CudaGraphProgram` over a nested tree, and greedy decoding of an embedded
Llama-like decoder through the bucketed :class:`~cudagraphs.serving.GraphRunner`
(tokens compared with eager); and, when ``transformers`` is installed (the ``hf``
extra), partial graphs (attention) inside eager training steps of a Hugging Face
Llama built from config, and greedy generation of one through the graphed generator
(tokens per second against HF's eager ``generate``, and its startup). Without a CUDA
device it says so and exits 0, or 2 with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import CudaGraphProgram, make_graphed_callables
from .envinfo import collect, format_report
from .models import BlockConfig, DecoderConfig, TinyDecoder, greedy_decode, make_block_stack
from .serving import GraphRunner, InputSpec
from .timing import interleaved_step_times_ms, kernel_busy_ms


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_DESCRIPTION = """\
Graphs an embedded stack of transformer blocks (training step), a graph program over
a nested tree, greedy decoding of an embedded decoder through the bucketed runner
and, with transformers installed, partial graphs in a Hugging Face Llama and greedy
generation of one through the graphed generator; prints each against eager and the
GPU's kernel-busy time. Without a CUDA device it says so and exits 0 (2 with
--require-gpu).
"""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cudagraphs",
        description=_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "command",
        nargs="?",
        choices=["demo", "env"],
        default="demo",
        help="demo: the measurements below; env: print what a bug report needs "
        "(versions, GPU, driver, optional packages, settings) and exit",
    )
    p.add_argument(
        "--require-gpu", action="store_true", help="exit 2 when no CUDA device is present"
    )
    p.add_argument(
        "--layers", type=_positive_int, default=8, help="transformer blocks in the stack"
    )
    p.add_argument("--hidden", type=_positive_int, default=512, help="hidden size")
    p.add_argument("--heads", type=_positive_int, default=8, help="attention heads")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences per step")
    p.add_argument("--seq", type=_positive_int, default=64, help="tokens per sequence")
    p.add_argument("--iters", type=_positive_int, default=50, help="timed steps per variant")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    return args


def _training_step(layers, x):  # noqa: ANN001 - list of callables, tensor
    def step() -> None:
        h = x
        for layer in layers:
            h = layer(h)
        h.float().pow(2).mean().backward()

    return step


def run_demo(args: argparse.Namespace) -> dict:
    cfg = BlockConfig(hidden=args.hidden, heads=args.heads, ffn=4 * args.hidden)
    shape = (args.batch, args.seq, args.hidden)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    eager = make_block_stack(args.layers, cfg)
    eager_step = _training_step(list(eager), x)
    graphed = make_block_stack(args.layers, cfg)
    samples = tuple(
        (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=i > 0),)
        for i in range(args.layers)
    )
    layers = make_graphed_callables(tuple(graphed), samples)
    graphed_step = _training_step(list(layers), x)
    # One step each from zeroed gradients: the graphs run the eager kernels, so every
    # parameter's gradient must match bit for bit.
    eager.zero_grad(set_to_none=True)
    graphed.zero_grad(set_to_none=True)
    eager_step()
    graphed_step()
    grads_equal = all(
        torch.equal(p.grad, q.grad) for p, q in zip(graphed.parameters(), eager.parameters())
    )
    # Both built first, then timed in turns, so host drift hits both; profiler last.
    ms = interleaved_step_times_ms(
        {"eager": eager_step, "graphed": graphed_step}, iters=args.iters, shuffle_seed=0
    )
    eager_ms, graphed_ms = ms["eager"], ms["graphed"]
    busy_ms = kernel_busy_ms(eager_step)
    return {
        "device": torch.cuda.get_device_name(),
        "model": f"{args.layers} pre-norm blocks, hidden {args.hidden}, batch {args.batch}, seq {args.seq}, bf16",
        "eager_ms": round(eager_ms, 3),
        "graphed_ms": round(graphed_ms, 3),
        "kernel_busy_ms": round(busy_ms, 3),
        "training_grads_equal": grads_equal,
        "speedup_vs_eager": round(eager_ms / graphed_ms, 2),
        "graphed_over_kernel_busy": round(graphed_ms / busy_ms, 2),
    }


def _small_ops(tree: dict) -> dict:
    """Many small kernels over a nested input tree: launch-bound by design."""
    h = tree["x"]
    for w in tree["weights"]:
        h = torch.tanh(h @ w) + h
    return {"out": h, "norm": h.float().norm()}


def run_program_demo(iters: int) -> dict:
    """A fixed function over a nested tree, eager vs :class:`CudaGraphProgram`."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tree = {
        "x": torch.randn(8, 256, device="cuda", generator=gen),
        "weights": [torch.randn(256, 256, device="cuda", generator=gen) / 16 for _ in range(16)],
    }
    program = CudaGraphProgram.capture(_small_ops, example_inputs=(tree,))
    try:
        same = torch.equal(program.replay(tree)["out"], _small_ops(tree)["out"])
        ms = interleaved_step_times_ms(
            {"eager": lambda: _small_ops(tree), "program": lambda: program.replay(tree)},
            iters=iters,
            shuffle_seed=0,
        )
        eager_ms, program_ms = ms["eager"], ms["program"]
    finally:
        program.close()
    return {
        "program": "16 x (matmul + tanh + add) over a tree of 17 tensors, fp32",
        "program_equal_to_eager": same,
        "program_eager_ms": round(eager_ms, 4),
        "program_replay_ms": round(program_ms, 4),
        "program_speedup_vs_eager": round(eager_ms / program_ms, 2),
    }


@torch.no_grad()
def run_serving_demo(batch: int = 5, prompt_len: int = 8, new_tokens: int = 24) -> dict:
    """Greedy decoding of ``batch`` prompts, eager vs the bucketed graph runner (the
    batch is padded to the next captured bucket); tokens must be identical."""
    cfg = DecoderConfig(vocab=1024, hidden=512, heads=8, kv_heads=2, ffn=1408, layers=8)
    torch.manual_seed(0)
    model = TinyDecoder(cfg).cuda().eval()
    specs = [
        InputSpec("tokens", (cfg.max_batch,), torch.long),
        InputSpec("positions", (cfg.max_batch,), torch.long),
    ]
    runner = GraphRunner(lambda tokens, positions: model(tokens, positions), specs)

    def dummy(bucket):  # noqa: ANN001, ANN202 - a Bucket -> its dummy inputs
        zeros = torch.zeros(bucket.rows, dtype=torch.long, device="cuda")
        return {"tokens": zeros, "positions": zeros.clone()}

    gen = torch.Generator(device="cuda").manual_seed(0)
    prompts = torch.randint(0, cfg.vocab, (batch, prompt_len), device="cuda", generator=gen)
    steps = prompt_len + new_tokens - 1

    def decode(step):  # noqa: ANN001, ANN202 - one decode step -> generated tokens
        model.k_cache.zero_()
        model.v_cache.zero_()
        return greedy_decode(step, prompts, new_tokens)

    try:
        runner.capture(dummy)
        graphed = lambda t, p: runner.run({"tokens": t, "positions": p})  # noqa: E731
        same = torch.equal(decode(model), decode(graphed))
        ms = interleaved_step_times_ms(
            {"eager": lambda: decode(model), "runner": lambda: decode(graphed)},
            iters=3,
            warmup=1,
            shuffle_seed=0,
        )
        eager_ms, runner_ms = ms["eager"] / steps, ms["runner"] / steps
        bucket = runner.select(batch)
    finally:
        runner.close()
    return {
        "decoder": f"{cfg.layers}-layer Llama-like decoder, hidden {cfg.hidden}, fp32, "
        f"{batch} prompts (bucket {bucket.rows if bucket else None})",
        "decode_tokens_equal": same,
        "decode_eager_ms_per_token": round(eager_ms, 4),
        "decode_runner_ms_per_token": round(runner_ms, 4),
        "decode_speedup_vs_eager": round(eager_ms / runner_ms, 2),
    }


def run_partial_demo(iters: int) -> dict:
    """Training steps of a random-init Hugging Face Llama (8 layers, hidden 512, batch 1,
    seq 128, bf16), eager vs :class:`~cudagraphs.partial.PartialCudaGraphManager`
    graphing every attention module; the loss of one step is compared first."""
    try:
        import transformers
    except ImportError:
        return {"partial": "skipped: transformers is not installed (pip install -e '.[hf]')"}
    from .partial import PartialCudaGraphManager

    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1024,
    )

    def make_model():  # noqa: ANN202 - the same random-init model every call
        torch.manual_seed(0)
        made = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        return made.cuda().train()

    ids = torch.randint(0, config.vocab_size, (1, 128), device="cuda")

    def step_of(model):  # noqa: ANN001, ANN202 - a model -> its training step
        def step() -> torch.Tensor:
            loss = model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
            loss.backward()
            return loss.detach()

        return step

    eager_step = step_of(make_model())
    graphed_model = make_model()
    graphed_step = step_of(graphed_model)
    mgr = PartialCudaGraphManager.from_model_parts([graphed_model])
    if mgr is None:
        return {"partial": "skipped: no graphable attention found"}
    try:
        mgr.start_recording()
        graphed_step()
        mgr.capture()
        same = torch.equal(graphed_step(), eager_step())
        # Both built first, then timed in turns, so host drift hits both.
        ms = interleaved_step_times_ms(
            {"eager": eager_step, "partial": graphed_step}, iters=iters, shuffle_seed=0
        )
        eager_ms, partial_ms = ms["eager"], ms["partial"]
        stats = mgr.stats()
    finally:
        mgr.close()
    return {
        "partial": f"HF Llama, 8 layers, hidden 512, batch 1, seq 128, bf16: "
        f"{stats['captured']} attention graphs",
        "partial_loss_equal": same,
        "partial_eager_ms": round(eager_ms, 3),
        "partial_graphed_ms": round(partial_ms, 3),
        "partial_speedup_vs_eager": round(eager_ms / partial_ms, 2),
        "partial_fallbacks": stats["fallbacks"],
    }


def run_generate_demo(batch: int = 4, new_tokens: int = 32) -> dict:
    """Greedy generation of a random-init Hugging Face Llama (8 layers, hidden 1024,
    bf16): HF's eager ``generate`` against :class:`~cudagraphs.serving.hf.
    GraphedGenerator`, whose tokens are compared with HF's static-cache ``generate``
    (compilation off: the same kernels); startup is the generator's capture of six
    buckets plus its first request."""
    try:
        import transformers
    except ImportError:
        return {"generate": "skipped: transformers is not installed (pip install -e '.[hf]')"}
    import inspect
    import time

    from .serving.hf import GraphedGenerator

    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=8192,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None  # every request makes every token
    model.generation_config.pad_token_id = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompts = torch.randint(3, config.vocab_size, (batch, 16), device="cuda", generator=gen)
    max_cache_len = 64
    keyword = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generator = GraphedGenerator(model, max_cache_len=max_cache_len)
        generator.capture(progress=False)
        ours = generator.generate(prompts, max_new_tokens=new_tokens)
        torch.cuda.synchronize()
        startup_s = time.perf_counter() - t0
        try:
            static = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
            want = model.generate(
                prompts,
                max_new_tokens=new_tokens,
                do_sample=False,
                disable_compile=True,
                **{keyword: static},
            )
            ms = interleaved_step_times_ms(
                {
                    "eager": lambda: model.generate(
                        prompts, max_new_tokens=new_tokens, do_sample=False
                    ),
                    "graphed": lambda: generator.generate(prompts, max_new_tokens=new_tokens),
                },
                iters=1,
                warmup=1,
                repeats=3,
                shuffle_seed=0,
            )
        finally:
            generator.close()
    tokens = batch * new_tokens
    return {
        "generate": f"HF Llama, 8 layers, hidden 1024, bf16, {batch} prompts of 16 tokens, "
        f"{new_tokens} new tokens, greedy",
        "generate_tokens_equal": bool(torch.equal(ours, want)),
        "generate_eager_tokens_per_s": round(tokens / ms["eager"] * 1e3, 1),
        "generate_graphed_tokens_per_s": round(tokens / ms["graphed"] * 1e3, 1),
        "generate_speedup_vs_eager": round(ms["eager"] / ms["graphed"], 2),
        "generate_startup_s": round(startup_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command == "env":
        report = collect()
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return 0
    if not torch.cuda.is_available():
        print(
            "cudagraphs: no CUDA device is present, so there is nothing to graph here. "
            "Run this on a machine with an NVIDIA GPU (the tests run anywhere: see README).",
            file=sys.stderr,
        )
        return 2 if args.require_gpu else 0
    result = run_demo(args)
    result.update(run_program_demo(args.iters))
    result.update(run_serving_demo())
    result.update(run_partial_demo(args.iters))
    result.update(run_generate_demo())
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['model']} on {result['device']}, forward+backward per step")
        print(f"  eager            {result['eager_ms']:8.3f} ms")
        print(
            f"  cudagraphs       {result['graphed_ms']:8.3f} ms  "
            f"({result['speedup_vs_eager']}x eager, same gradients: {result['training_grads_equal']})"
        )
        print(f"  kernel-busy time {result['kernel_busy_ms']:8.3f} ms  (the floor)")
        print(f"{result['program']}, per call")
        print(f"  eager            {result['program_eager_ms']:8.3f} ms")
        print(
            f"  CudaGraphProgram {result['program_replay_ms']:8.3f} ms  "
            f"({result['program_speedup_vs_eager']}x eager, equal: {result['program_equal_to_eager']})"
        )
        print(f"{result['decoder']}, greedy decoding per token")
        print(f"  eager            {result['decode_eager_ms_per_token']:8.3f} ms")
        print(
            f"  GraphRunner      {result['decode_runner_ms_per_token']:8.3f} ms  "
            f"({result['decode_speedup_vs_eager']}x eager, same tokens: "
            f"{result['decode_tokens_equal']})"
        )
        print(result["partial"] + ("" if "partial_loss_equal" not in result else ", per step"))
        if "partial_loss_equal" in result:
            print(f"  eager            {result['partial_eager_ms']:8.3f} ms")
            print(
                f"  partial graphs   {result['partial_graphed_ms']:8.3f} ms  "
                f"({result['partial_speedup_vs_eager']}x eager, same loss: "
                f"{result['partial_loss_equal']}, fallbacks: {result['partial_fallbacks']})"
            )
        print(result["generate"])
        if "generate_tokens_equal" in result:
            print(f"  HF eager generate {result['generate_eager_tokens_per_s']:9.1f} tokens/s")
            print(
                f"  GraphedGenerator  {result['generate_graphed_tokens_per_s']:9.1f} tokens/s  "
                f"({result['generate_speedup_vs_eager']}x eager, same tokens as HF's static "
                f"cache: {result['generate_tokens_equal']}; capture + first request "
                f"{result['generate_startup_s']} s)"
            )
    ok = (
        result["training_grads_equal"]
        and result["program_equal_to_eager"]
        and result["decode_tokens_equal"]
        and result.get("partial_loss_equal", True)
        and result.get("generate_tokens_equal", True)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
