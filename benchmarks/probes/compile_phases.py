"""Where the compiled generator's cold capture spends its seconds, and what the two
compile-time measures of ``GraphedGenerator.capture`` save.

Run from the repository root on the GPU machine:

    PYTHONPATH=src python benchmarks/probes/compile_phases.py --out benchmarks/results/ \
        --commit <short sha>

The benchmark's Llama (``serving_hf.MODELS["llama"]``, 16 layers, bf16), its six
buckets and ``serving_hf.COMPILE_OPTIONS``: each mode captures in a fresh child process
with an empty inductor cache, as ``serving_hf``'s ``compiled_capture_le_20s`` does.

* ``both``: the generator as it is;
* ``no_workers``: without starting inductor's compile workers at the capture's start
  (``torch_private.start_compile_workers``): they start at inductor's first call;
* ``neither``: that, and without the decoder layers' region schema memo
  (``torch_private.memoized_subgraph_schemas``).

Each run keeps the capture's seconds, the memo's counts (``stats()["subgraph_schemas"]``)
and dynamo's seconds per compile phase (at least 0.05 s; nested phases count in their
parents too): ``aot_collect_metadata`` is where a torch without its own schema cache
traced the layer again per layer, ``async_compile.precompile`` the Triton kernels built
in the calling process while the worker pool was not ready. Writes
``probe-compile_phases-<device>-<commit>.json`` under ``--out``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("both", "no_workers", "neither")


def child(mode: str) -> dict:
    import torch
    import transformers

    import serving_hf
    from cudagraphs import torch_private
    from cudagraphs.serving.hf import GraphedGenerator
    from cudagraphs.serving.hf import generator as generator_module

    if mode in ("no_workers", "neither"):
        generator_module.start_compile_workers = lambda: False
    if mode == "neither":
        torch_private.upstream_caches_subgraph_schemas = lambda: True
    model = serving_hf.build_model("llama")
    with torch.no_grad():
        gen = GraphedGenerator(
            model,
            serving_hf.BUCKETS,
            max_cache_len=serving_hf.MAX_CACHE_LEN,
            compile_options=serving_hf.COMPILE_OPTIONS,
        )
        t0 = time.perf_counter()
        gen.capture(progress=False)
        seconds = time.perf_counter() - t0
    from torch._dynamo.utils import compilation_time_metrics

    phases = {name: sum(values) for name, values in compilation_time_metrics.items()}
    return {
        "mode": mode,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "capture_s": round(seconds, 3),
        "subgraph_schemas": gen.stats()["subgraph_schemas"],
        "compile_phases_s": {
            name: round(s, 3)
            for name, s in sorted(phases.items(), key=lambda kv: -kv[1])
            if s >= 0.05
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    import torch

    runs = {}
    for mode in args.modes:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
        done = subprocess.run(
            [sys.executable, __file__, "--child", mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = done.stdout.strip().splitlines()
        runs[mode] = (
            json.loads(lines[-1])
            if done.returncode == 0 and lines
            else {
                "returncode": done.returncode,
                "stderr_tail": done.stderr[-2000:],
            }
        )
        print(mode, runs[mode].get("capture_s"), file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name().lower().replace(" ", "-")
    record = {"probe": "compile_phases", "device": device, "commit": args.commit, "runs": runs}
    out = Path(args.out) / f"probe-compile_phases-{device}-{args.commit}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
