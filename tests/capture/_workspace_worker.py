"""One scenario of test_cuda_cublas_workspace.py per process (a replay into freed
memory can poison the CUDA context, so each runs alone): capture, let torch drop every
cuBLAS workspace, return freed memory to the driver, fill new tensors, replay, and
print one JSON line: whether the replay equals eager and the new tensors are intact.

The matmuls are split-K shaped (few rows, a long reduction), which cuBLAS runs with its
workspace on the H200.
"""

import json
import sys

import torch

import cudagraphs

ROWS, DEPTH, COLS = 64, 65536, 64
FILL = 7.0


def drop_workspaces() -> list[torch.Tensor]:
    """What torch.compile's CUDA-graph trees do when they record, then the driver gets
    the memory back, then new tensors take whatever is free."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return [torch.full((16 * 2**20,), FILL, device="cuda", dtype=torch.bfloat16) for _ in range(8)]


def intact(fillers: list[torch.Tensor]) -> bool:
    torch.cuda.synchronize()
    return all(bool((f == FILL).all()) for f in fillers)


def operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(ROWS, DEPTH, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(DEPTH, COLS, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
    return a, b


def raw_graph_warmed_on_its_capture_stream() -> dict:
    """The control: what our captures did before (warmup on the capture stream)."""
    a, b = operands()
    expected = a @ b
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            a @ b
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = a @ b
    fillers = drop_workspaces()
    for _ in range(10):
        graph.replay()
    return {"equal": bool(torch.equal(out, expected)), "intact": intact(fillers)}


def core() -> dict:
    torch.manual_seed(0)
    layer = torch.nn.Linear(DEPTH, COLS, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ROWS, DEPTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # The eager reference on an alias of x, its autograd graph gone before capture (a
    # live eager graph would bind x's AccumulateGrad to the default stream).
    ref = x.detach().requires_grad_()
    expected_out = layer(ref)
    expected_grad = torch.autograd.grad(expected_out.sum(), ref)[0]
    expected = expected_out.detach()
    del expected_out, ref
    graphed = cudagraphs.make_graphed_callables(layer, (x,))
    fillers = drop_workspaces()
    out = grad = None
    for _ in range(5):
        out = graphed(x)
        grad = torch.autograd.grad(out.sum(), x)[0]
    return {
        "equal": bool(torch.equal(out, expected)) and bool(torch.equal(grad, expected_grad)),
        "max_diff": [
            float((out - expected).abs().max()),
            float((grad - expected_grad).abs().max()),
        ],
        "intact": intact(fillers),
    }


def program() -> dict:
    a, b = operands()
    expected = a @ b
    prog = cudagraphs.CudaGraphProgram.capture(lambda x, y: x @ y, example_inputs=(a, b))
    fillers = drop_workspaces()
    out = None
    for _ in range(5):
        out = prog.replay(a, b)
    return {"equal": bool(torch.equal(out, expected)), "intact": intact(fillers)}


def runner() -> dict:
    from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec

    _, b = operands()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x @ b

    run = GraphRunner(forward, [InputSpec("x", (8, DEPTH), torch.bfloat16)], BucketConfig((2, 8)))
    run.capture(
        lambda bucket: {"x": torch.zeros(bucket.rows, DEPTH, device="cuda", dtype=torch.bfloat16)}
    )
    x = operands(seed=1)[0][:8]
    expected = x @ b
    fillers = drop_workspaces()
    out = None
    for _ in range(5):
        out = run.run({"x": x}, copy_output=True)
    return {
        "equal": bool(torch.equal(out, expected)),
        "intact": intact(fillers),
        "replays": sum(run.stats()["replays"].values()),
    }


def use_every_pooled_stream() -> None:
    """An eager split-K matmul on each of the streams torch hands out in turn (32 per
    device and priority): torch then holds an eager workspace for whichever stream the
    next ``torch.cuda.Stream()`` returns."""
    a, b = operands(seed=3)
    for _ in range(32):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            a @ b
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def runner_on_a_reused_stream() -> dict:
    """The runner, after eager matmuls ran on every stream torch hands out."""
    use_every_pooled_stream()
    return runner()


def control_reused_stream_without_the_clear() -> dict:
    """The same with the pool's clear of torch's workspaces left out: the capture
    stream's workspace is then the eager one, which the drop frees."""
    import cudagraphs.graph_pool as graph_pool

    graph_pool.clear_cublas_workspaces = lambda: None
    return runner_on_a_reused_stream()


def generator_beside_torch_compile() -> dict:
    """A GraphedGenerator captured first, then torch.compile(mode="reduce-overhead")
    records its graphs (the real clear), then the generator decodes."""

    import transformers

    from cudagraphs.serving.hf import GraphedGenerator
    from cudagraphs.serving.hf.cache import cache_keyword

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=256,
        intermediate_size=16384,  # a long reduction in down_proj: split-K
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        eos_token_id=None,  # every variant makes every token
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(
        3, 1024, (4, 10), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    keyword = cache_keyword(model)
    with torch.no_grad():
        cache = transformers.StaticCache(config=model.config, max_cache_len=64)
        expected = model.generate(
            ids,
            max_new_tokens=16,
            do_sample=False,
            disable_compile=True,
            **{keyword: cache},
        )
    gen = GraphedGenerator(model, (1, 2, 4), max_cache_len=64)
    gen.capture()
    a, b = operands(seed=2)
    compiled = torch.compile(lambda x, y: (x @ y).relu(), mode="reduce-overhead")
    for _ in range(4):  # the trees record on a later call, clearing the workspaces
        compiled(a, b)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    fillers = [
        torch.full((16 * 2**20,), FILL, device="cuda", dtype=torch.bfloat16) for _ in range(8)
    ]
    out = None
    for _ in range(3):
        out = gen.generate(ids, max_new_tokens=16, eos_token_id=[])
    return {
        "equal": bool(torch.equal(out, expected)),
        "intact": intact(fillers),
        "graph_requests": gen.stats()["requests"].get("graphs", 0),
    }


SCENARIOS = {
    f.__name__: f
    for f in (
        raw_graph_warmed_on_its_capture_stream,
        core,
        program,
        runner,
        runner_on_a_reused_stream,
        control_reused_stream_without_the_clear,
        generator_beside_torch_compile,
    )
}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]]()
    torch.cuda.synchronize()
    print(json.dumps(result))
