"""How many compiles does a compiled ``GraphedGenerator`` make on the GPU, and why?

Run from the repository root on the GPU machine:

    TORCH_LOGS=recompiles PYTHONPATH=src python benchmarks/probes/serving_compiles.py

The benchmark's Llama (``serving_hf.MODELS["llama"]``) cut to 2 layers, buckets
(1, 2, 4, 8), ``compile_options=serving_hf.COMPILE_OPTIONS``: the capture's seconds
per bucket (``stats()["capture_seconds"]``: a bucket whose warmup took seconds
compiled), and with ``TORCH_LOGS=recompiles`` dynamo's reason for each recompile on
stderr. Writes ``$OUT/probe-serving_compiles.json`` when OUT is set.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import serving_hf  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402

BUCKETS = (1, 2, 4, 8)
LAYERS = 2


def main() -> None:
    serving_hf.MODELS["llama"] = dict(serving_hf.MODELS["llama"], num_hidden_layers=LAYERS)
    model = serving_hf.build_model("llama")
    with torch.no_grad():
        t0 = time.perf_counter()
        gen = GraphedGenerator(
            model,
            BUCKETS,
            max_cache_len=serving_hf.MAX_CACHE_LEN,
            require_all_buckets=True,
            compile_options=serving_hf.COMPILE_OPTIONS,
        )
        gen.capture()
        seconds = time.perf_counter() - t0
    record = {
        "probe": "serving_compiles",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "layers": LAYERS,
        "buckets": list(BUCKETS),
        "capture_s": round(seconds, 3),
        "capture_seconds": gen.stats()["capture_seconds"],
    }
    print(json.dumps(record), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "probe-serving_compiles.json", "w") as f:
            json.dump(record, f, indent=1)
    gen.close()


if __name__ == "__main__":
    main()
