"""The measurements ``python -m cudagraphs`` prints: a graphed training step, a graph
program, greedy decoding through the bucketed runner and, with ``transformers``
installed, partial graphs in a Hugging Face Llama and the graphed generator, each
against eager. Each returns what it measured; :mod:`cudagraphs.__main__` parses the
arguments, calls these on a CUDA device and prints the results.
"""

from __future__ import annotations

import argparse

import torch

from . import CudaGraphProgram, make_graphed_callables
from .memory import MemoryAccount
from .models import BlockConfig, DecoderConfig, TinyDecoder, greedy_decode, make_block_stack
from .serving import GraphRunner, InputSpec
from .timing import interleaved_step_times_ms, kernel_busy_ms

__all__ = [
    "run_demo",
    "run_generate_demo",
    "run_partial_demo",
    "run_program_demo",
    "run_serving_demo",
]


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
        # Where the capture's device memory went (cudagraphs.memory.MemoryAccount).
        "graphed_memory": layers[0].cuda_graph.memory.as_dict(),
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
        memory = runner.stats()["memory"]
    finally:
        runner.close()
    return {
        "decoder": f"{cfg.layers}-layer Llama-like decoder, hidden {cfg.hidden}, fp32, "
        f"{batch} prompts (bucket {bucket.rows if bucket else None})",
        "decode_tokens_equal": same,
        "decode_eager_ms_per_token": round(eager_ms, 4),
        "decode_runner_ms_per_token": round(runner_ms, 4),
        "decode_speedup_vs_eager": round(eager_ms / runner_ms, 2),
        "decode_runner_memory": memory,
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
        "partial_memory": {k: stats.get(k, 0) for k in MemoryAccount().as_dict()},
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
    import time

    from .serving.hf import GraphedGenerator
    from .serving.hf.cache import cache_keyword

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
    keyword = cache_keyword(model)
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
            memory = generator.stats()["memory"]
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
        "generate_memory": memory,
    }
