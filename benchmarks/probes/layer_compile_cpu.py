"""How does inductor's compile of an HF decoder grow with its layers, and what does one
compiled body for every layer (``torch.compiler.nested_compile_region``) save? On the
CPU, so it runs where no GPU is.

Run from the repository root:

    PYTHONPATH=src python benchmarks/probes/layer_compile_cpu.py --out benchmarks/results/

For each number of layers in ``LAYERS`` and each mode (``whole``: the model compiled as
one; ``regions``: each decoder layer's forward one nested compile region), a fresh
child process with an empty inductor cache builds HF Llama (hidden 256, fp32, random
weights), prefills a static cache eagerly, and times the first compiled decode step at
batch 4 (static shapes): the compile. dynamo's own split of that time is kept for
inductor's scheduling (``Scheduler.__init__`` and ``Scheduler.fused_nodes``), with the
number of layer bodies the compiled graph calls and the largest logit difference from
the eager step. Writes ``probe-layer_compile-cpu-<commit>.json`` under ``--out``.
"""

import argparse
import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYERS = (4, 16)
MODES = ("whole", "regions")
BATCH, PROMPT, CACHE = 4, 8, 64


def _layer_forward(layer, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


def child(layers: int, mode: str) -> dict:
    import transformers
    from torch._dynamo.utils import compile_times

    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=32000,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    params = inspect.signature(model.forward).parameters
    keyword = "cache" if "cache" in params else "past_key_values"
    graphs = []

    def inductor(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def step(cache):
        ids = torch.full((BATCH, 1), 5)
        position = torch.full((BATCH, 1), PROMPT)
        return compiled(input_ids=ids, position_ids=position, use_cache=True, **{keyword: cache})

    with torch.no_grad():
        caches = [transformers.StaticCache(config=config, max_cache_len=CACHE) for _ in "ab"]
        prompt = torch.randint(3, 1000, (BATCH, PROMPT))
        for cache in caches:
            model(input_ids=prompt, use_cache=True, **{keyword: cache})
        eager = model(
            input_ids=torch.full((BATCH, 1), 5),
            position_ids=torch.full((BATCH, 1), PROMPT),
            use_cache=True,
            **{keyword: caches[0]},
        ).logits
        if mode == "regions":
            region = torch.compiler.nested_compile_region(_layer_forward)
            for layer in model.model.layers:
                layer.forward = functools.partial(region, layer)
        compiled = torch.compile(model, fullgraph=True, backend=inductor)
        t0 = time.perf_counter()
        out = step(caches[1]).logits
        seconds = time.perf_counter() - t0
    hop = torch.ops.higher_order.invoke_subgraph
    bodies = [n.args[0].target for g in graphs for n in g.graph.nodes if n.target is hop]
    times = {}
    for line in compile_times(repr="str", aggregate=True).splitlines():
        name, _, value = line.partition(", ")
        if name in ("Scheduler.__init__", "Scheduler.fused_nodes"):
            times[name] = round(float(value), 3)
    return {
        "layers": layers,
        "mode": mode,
        "compile_s": round(seconds, 3),
        "scheduler_s": times,
        "graphs": len(graphs),
        "body_calls": len(bodies),
        "distinct_bodies": len(set(bodies)),
        "max_abs_logit_diff": float((out - eager).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--child", nargs=2, metavar=("LAYERS", "MODE"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1])), flush=True)
        return
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    import transformers

    record = {
        "probe": "layer_compile",
        "device": "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
        "batch": BATCH,
        "runs": [],
    }
    for layers in LAYERS:
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="layer_compile_") as cache_dir:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", str(layers), mode],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=900,
                )
            lines = proc.stdout.strip().splitlines()
            run = json.loads(lines[-1]) if proc.returncode == 0 and lines else {}
            run.update(returncode=proc.returncode, layers=layers, mode=mode)
            if proc.returncode:
                run["stderr_tail"] = proc.stderr[-1500:]
            record["runs"].append(run)
            print(json.dumps(run), flush=True)
    if args.out:
        path = args.out / f"probe-layer_compile-cpu-{commit}.json"
        path.write_text(json.dumps(record, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
