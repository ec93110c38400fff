"""How many compiles does a compiled ``GraphedGenerator`` make on the GPU, and why?

Run from the repository root on the GPU machine:

    TORCH_LOGS=recompiles PYTHONPATH=src python benchmarks/probes/serving_compiles.py

The benchmark's Llama (``serving_hf.MODELS["llama"]``) cut to 2 layers, buckets
(1, 2, 4, 8), ``compile_options=serving_hf.COMPILE_OPTIONS``: the capture's seconds
per bucket (``stats()["capture_seconds"]``: a bucket whose warmup took seconds
compiled), and with ``TORCH_LOGS=recompiles`` dynamo's reason for each recompile on
stderr. Writes ``$OUT/probe-serving_compiles.json`` when OUT is set.

``--backends`` asks where the batch-of-one guard comes from. For each set of SDPA
backends (``default``: torch's choice; ``no_cudnn``: flash, mem-efficient and math;
``efficient``: mem-efficient and math; ``math``), a fresh child process captures
under ``torch.nn.attention.sdpa_kernel`` of that set with
``TORCH_LOGS=+dynamic,recompiles``, and the record keeps each bucket's warmup seconds,
every "guard added" line that compares a size with 1, with the frame that added it, and
the guard each recompile failed (``recompiles``). One compile for all four
buckets under a set names the backend whose checks specialize a batch of one.
Writes ``$OUT/probe-serving_compiles-backends.json``.
"""

import json
import os
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import serving_hf  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402

BUCKETS = (1, 2, 4, 8)
LAYERS = 2
BACKEND_SETS = {
    "default": None,
    "no_cudnn": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "efficient": ("EFFICIENT_ATTENTION", "MATH"),
    "math": ("MATH",),
}
# A guard that compares a size with 1: "Ne(s0, 1)", "Eq(s0, 1)", "s0 != 1", ...
_ONE = re.compile(r"(Ne|Eq)\(s\d+, 1\)|s\d+ [!=]= 1\b|!= 1\b")


def backends_scope(name: str):
    """``sdpa_kernel`` over the named set (``nullcontext`` for ``default``)."""
    chosen = BACKEND_SETS[name]
    if chosen is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, b) for b in chosen])


def captured(backends: str = "default") -> tuple[GraphedGenerator, float]:
    """The benchmark's Llama cut to ``LAYERS`` layers, its compiled generator captured
    under the named SDPA backends, and the seconds that took."""
    serving_hf.MODELS["llama"] = dict(serving_hf.MODELS["llama"], num_hidden_layers=LAYERS)
    model = serving_hf.build_model("llama")
    with torch.no_grad(), backends_scope(backends):
        t0 = time.perf_counter()
        gen = GraphedGenerator(
            model,
            BUCKETS,
            max_cache_len=serving_hf.MAX_CACHE_LEN,
            require_all_buckets=True,
            compile_options=serving_hf.COMPILE_OPTIONS,
        )
        gen.capture()
    return gen, time.perf_counter() - t0


def capture_once(backends: str = "default") -> dict:
    gen, seconds = captured(backends)
    out = {
        "backends": backends,
        "capture_s": round(seconds, 3),
        "warmup_s": {k: round(v["warmup"], 3) for k, v in gen.stats()["capture_seconds"].items()},
    }
    gen.close()
    return out


def by_backends() -> None:
    """Each backend set in a child of its own, guards logged; one JSON record."""
    record: dict = {
        "probe": "serving_compiles_backends",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "layers": LAYERS,
        "buckets": list(BUCKETS),
        "runs": {},
    }
    env = dict(os.environ, TORCH_LOGS="+dynamic,recompiles")
    for name in BACKEND_SETS:
        child = subprocess.run(
            [sys.executable, __file__, "--child", name],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = child.stdout.strip().splitlines()
        run = json.loads(lines[-1]) if child.returncode == 0 and lines else {}
        run["returncode"] = child.returncode
        run["guards_on_one"] = [
            line.strip()[-400:]
            for line in child.stderr.splitlines()
            if "guard added" in line and _ONE.search(line)
        ][:20]
        run["recompiles"] = recompile_reasons(child.stderr)[:10]
        if child.returncode != 0:
            run["stderr_tail"] = child.stderr[-2000:]
        record["runs"][name] = run
        print(name, json.dumps(run)[:2000], flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "probe-serving_compiles-backends.json", "w") as f:
            json.dump(record, f, indent=1)


def recompile_reasons(log: str) -> list[str]:
    """The failed guards of each recompile in a ``TORCH_LOGS=recompiles`` log: dynamo
    writes "triggered by the following guard failure(s):" and then one "- <frame>:
    <guard>" line per failed guard, each behind the logger's prefix."""
    reasons, reading = [], False
    for line in log.splitlines():
        text = line.split("[__recompiles]", 1)[-1].strip()
        if "guard failure" in text:
            reading = True
        elif reading and text.startswith("- "):
            reasons.append(text[2:][:400])
        else:
            reading = False
    return reasons


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(capture_once(sys.argv[2])), flush=True)
        return
    if sys.argv[1:2] == ["--backends"]:
        by_backends()
        return
    gen, seconds = captured()
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
