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

``--decode`` asks what excluding cuDNN attention from the compiled capture costs and
saves at the benchmark's size: the full Llama of ``serving_hf`` and its six buckets.
For ``default`` and ``no_cudnn`` (in that order, each in a fresh child with an empty
inductor cache, the whole child under the set's ``sdpa_kernel``) it records the
capture's seconds (whole and per bucket), the decode's ms per token at batch 1 and 8
(median of ``DECODE_REPEATS`` requests of ``serving_hf.NEW_TOKENS`` tokens) and the
greedy tokens; :func:`decode_summary` puts them side by side (capture seconds against
the 20 s target, ms per token ``no_cudnn`` over ``default``, whether the tokens are
equal). Writes ``$OUT/probe-serving_compiles-decode.json``.

``--attention`` asks what the compiled decode's attention kernel costs a token. The
generator's default (``layers``: cuDNN excluded, so a one-token query with the static
cache's mask runs the memory-efficient kernel, 16 blocks for a batch of one) against
``math`` (SDPA's math backend alone, which inductor lowers to matmuls and a fused
softmax), in fresh children with empty inductor caches, alternated twice (ABAB, so a
drift of the machine shows); each child also records its kernel-busy ms, launches and
heaviest kernels per token at ``serving_hf.BATCHES`` after its timing.
:func:`attention_summary` gives per batch the median ms per token of each set and
``math`` over ``layers``, and whether the greedy tokens are equal. Writes
``$OUT/probe-serving_compiles-attention.json``.

``--stacked`` asks what one GEMM per projection group saves a token: the generator's
default (``stacked``) against ``stack_projections=False`` (``unstacked``), ABAB in
fresh children with empty inductor caches, profiled like ``--attention``;
:func:`stacked_summary` adds the kernels and kernel-busy ms a token of each. Writes
``$OUT/probe-serving_compiles_stacked.json``.

``--pack-gqa`` asks the same of ``GraphedGenerator(pack_gqa=True)`` (``packed``: each
key/value head's query group read as its rows, no repeated cache) against the default
(``unpacked``), ABAB, profiled; :func:`pack_gqa_summary`. Writes
``$OUT/probe-serving_compiles_pack_gqa.json``.

``--regional`` asks what ``GraphedGenerator(compile_regions=...)`` saves and costs at
the same size: ``layers`` (its default, one compiled body for every decoder layer) and
``whole`` (``compile_regions=False``), each in a fresh child with an empty inductor
cache, both without cuDNN attention; the record keeps what ``--decode`` keeps and the
layer bodies dynamo installed (``TORCH_LOGS=hierarchical_compile``), and
:func:`regions_summary` sets them side by side. Writes
``$OUT/probe-serving_compiles-regions.json``.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import serving_hf  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from cudagraphs.timing import kernel_activity  # noqa: E402
from serving_hf import per_token_activity  # noqa: E402

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


def generator_backends(name: str) -> tuple:
    """The named set as ``GraphedGenerator(sdpa_backends=...)`` takes it: a compiled
    generator leaves cuDNN out by default, so ``default`` (torch's choice) is every
    backend, cuDNN's included."""
    from torch.nn.attention import SDPBackend

    chosen = BACKEND_SETS[name]
    if chosen is None:
        chosen = (*BACKEND_SETS["no_cudnn"], "CUDNN_ATTENTION")
    return tuple(getattr(SDPBackend, b) for b in chosen)


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
            sdpa_backends=generator_backends(backends),
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


def run_child(
    args: list[str], env: dict, timeout: float
) -> tuple[subprocess.CompletedProcess, dict]:
    """This probe in a child process with ``args``; the finished process and the JSON
    record its last output line holds (empty when it failed), with its return code."""
    child = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = child.stdout.strip().splitlines()
    run = json.loads(lines[-1]) if child.returncode == 0 and lines else {}
    run["returncode"] = child.returncode
    return child, run


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
        child, run = run_child(["--child", name], env, timeout=240)
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


DECODE_SETS = ("default", "no_cudnn")
DECODE_REPEATS = 5
CAPTURE_TARGET_S = 20.0


#: --attention's children, in this order: the default and SDPA's math backend alone.
ATTENTION_RUNS = ("layers", "math", "layers", "math")
#: --stacked's children, in this order: the generator's default (its projections
#: stacked, one GEMM per group) and stack_projections=False.
STACK_RUNS = ("stacked", "unstacked", "stacked", "unstacked")
STACK_SETS = {"stacked": None, "unstacked": False}
#: --pack-gqa's children, in this order: pack_gqa=True and the default (off).
PACK_RUNS = ("packed", "unpacked", "packed", "unpacked")
PACK_SETS = {"packed": True, "unpacked": False}
#: A decode child with this set also profiles its requests (kernel-busy time).
PROFILE_ENV = "SERVING_COMPILES_PROFILE"

#: --regional's children: the generator's decoder layers sharing one compiled body (its
#: default) and the whole model compiled as one, both without cuDNN attention.
REGION_SETS = {"layers": True, "whole": False}
# dynamo's line for each compiled layer body it installs (TORCH_LOGS=hierarchical_compile)
INSTALLED = re.compile(r"Installing subgraph with identifier")


def decode_once(backends: str) -> dict:
    """One child of ``--decode``: the benchmark's Llama and buckets, captured compiled
    under the named backends, then timed per token at ``serving_hf.BATCHES``.
    A name of :data:`REGION_SETS` captures without cuDNN attention with
    ``compile_regions`` as that set says."""
    model = serving_hf.build_model("llama")
    out: dict = {"backends": backends, "ms_per_token": {}, "tokens": {}}
    regions = REGION_SETS.get(backends)
    stack = STACK_SETS.get(backends)
    pack = PACK_SETS.get(backends, False)
    if regions is not None or backends in STACK_SETS or backends in PACK_SETS:
        backends = "no_cudnn"
    with torch.no_grad(), backends_scope(backends):
        t0 = time.perf_counter()
        gen = GraphedGenerator(
            model,
            serving_hf.BUCKETS,
            max_cache_len=serving_hf.MAX_CACHE_LEN,
            require_all_buckets=True,
            compile_options=serving_hf.COMPILE_OPTIONS,
            sdpa_backends=generator_backends(backends),
            compile_regions=regions,
            stack_projections=stack,
            pack_gqa=pack,
        )
        gen.capture()
        out["capture_s"] = round(time.perf_counter() - t0, 3)
        from torch._dynamo.utils import counters

        out["unique_graphs"] = counters["stats"]["unique_graphs"]
        out["compile_phases_s"] = compile_phases()
        out["warmup_s"] = {
            k: round(v["warmup"], 3) for k, v in gen.stats()["capture_seconds"].items()
        }
        for batch in serving_hf.BATCHES:
            ids = serving_hf.prompts(batch)
            times, tokens = [], None
            for _ in range(DECODE_REPEATS + 1):  # the first request is thrown away
                torch.cuda.synchronize()
                t = time.perf_counter()
                tokens = gen.generate(ids, max_new_tokens=serving_hf.NEW_TOKENS, eos_token_id=[])
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3 / serving_hf.NEW_TOKENS)
            out["ms_per_token"][str(batch)] = round(statistics.median(times[1:]), 4)
            out["tokens"][str(batch)] = tokens[:, ids.shape[1] :].tolist()
        if os.environ.get(PROFILE_ENV):
            out["activity"] = {
                str(batch): per_token_activity(
                    kernel_activity(
                        partial(
                            gen.generate,
                            serving_hf.prompts(batch),
                            max_new_tokens=serving_hf.NEW_TOKENS,
                            eos_token_id=[],
                        ),
                        iters=3,
                        warmup=1,
                    )
                )
                for batch in serving_hf.BATCHES
            }
        stats = gen.stats()
        out["compile_regions"] = stats.get("compile_regions")
        # Why the layers did not share one compiled body (None: they did).
        out["compile_regions_error"] = gen.compile_regions_error
        out["stacked_projections"] = stats.get("stacked_projections")
        out["pack_gqa"] = stats.get("pack_gqa")
        # The decode replayed (a graphed result that did not replay is not one).
        out["replays"] = stats.get("replays")
        out["eager_runs"] = stats.get("eager_runs")
    gen.close()
    return out


def compile_phases(floor: float = 0.1) -> dict[str, float]:
    """dynamo's seconds per compile phase so far in this process (its own names:
    ``bytecode_tracing``, ``aot_collect_metadata``, ``GraphLowering.codegen``,
    ``async_compile.wait``, ...), each at least ``floor`` seconds; nested phases are
    counted in their parents too."""
    from torch._dynamo.utils import compile_times

    # The CSV form: the string form is a table whose layout depends on whether the
    # tabulate package is installed.
    names, values = compile_times(repr="csv", aggregate=True)
    phases = {name: round(float(value), 3) for name, value in zip(names, values)}
    return {name: seconds for name, seconds in phases.items() if seconds >= floor}


def decode_summary(runs: dict[str, dict]) -> dict:
    """``--decode``'s verdicts from its children's records (by set name): per set the
    capture seconds and whether they meet ``CAPTURE_TARGET_S``; per batch ms per token
    of ``no_cudnn`` over ``default`` and whether the greedy tokens are equal. A set
    whose child failed (no ``capture_s``) gives ``None`` wherever it is needed."""
    summary: dict = {
        "capture_s": {},
        "capture_le_20s": {},
        "per_token_ratio": {},
        "tokens_equal": {},
    }
    for name, run in runs.items():
        seconds = run.get("capture_s")
        summary["capture_s"][name] = seconds
        summary["capture_le_20s"][name] = None if seconds is None else seconds <= CAPTURE_TARGET_S
    base, other = runs.get("default", {}), runs.get("no_cudnn", {})
    for batch in sorted(set(base.get("ms_per_token", {})) | set(other.get("ms_per_token", {}))):
        a = base.get("ms_per_token", {}).get(batch)
        b = other.get("ms_per_token", {}).get(batch)
        summary["per_token_ratio"][batch] = round(b / a, 4) if a and b is not None else None
        ta = base.get("tokens", {}).get(batch)
        tb = other.get("tokens", {}).get(batch)
        summary["tokens_equal"][batch] = None if ta is None or tb is None else ta == tb
    return summary


def by_decode() -> None:
    """Each of ``DECODE_SETS`` in a fresh child with an empty inductor cache."""
    record: dict = {
        "probe": "serving_compiles_decode",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "buckets": list(serving_hf.BUCKETS),
        "new_tokens": serving_hf.NEW_TOKENS,
        "runs": {},
    }
    for name in DECODE_SETS:
        with tempfile.TemporaryDirectory(prefix="serving_compiles_") as cache_dir:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
            child, run = run_child(["--decode-child", name], env, timeout=280)
        if child.returncode != 0:
            run["stderr_tail"] = child.stderr[-2000:]
        record["runs"][name] = run
        print(name, json.dumps({k: v for k, v in run.items() if k != "tokens"})[:1500], flush=True)
    record["summary"] = decode_summary(record["runs"])
    print(json.dumps(record["summary"]), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "probe-serving_compiles-decode.json", "w") as f:
            json.dump(record, f, indent=1)


def pair_summary(runs: list[dict], base: str, other: str) -> dict:
    """An ABAB probe's verdicts from its children's records, in run order: per batch
    the median ms per token of each set over its runs, ``other`` over ``base``
    (``"<other>_over_<base>"``), and whether every ``other`` run's greedy tokens equal
    the first ``base`` run's. A failed child (no ``ms_per_token``) counts for nothing;
    a ratio without both sets is ``None``."""
    per_set: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for batch, ms in run.get("ms_per_token", {}).items():
            per_set.setdefault(run["backends"], {}).setdefault(batch, []).append(ms)
    medians = {
        name: {batch: round(statistics.median(v), 4) for batch, v in by_batch.items()}
        for name, by_batch in per_set.items()
    }
    ratio = f"{other}_over_{base}"
    summary: dict = {"ms_per_token": medians, ratio: {}, "tokens_equal": {}}
    first = next((r for r in runs if r["backends"] == base and "tokens" in r), None)
    for batch in sorted({b for by_batch in medians.values() for b in by_batch}):
        a = medians.get(base, {}).get(batch)
        b = medians.get(other, {}).get(batch)
        summary[ratio][batch] = round(b / a, 4) if a and b is not None else None
        others = [r["tokens"].get(batch) for r in runs if r["backends"] == other and "tokens" in r]
        if first is None or not others:
            summary["tokens_equal"][batch] = None
        else:
            summary["tokens_equal"][batch] = all(t == first["tokens"].get(batch) for t in others)
    return summary


def attention_summary(runs: list[dict]) -> dict:
    """``--attention``'s verdicts: :func:`pair_summary` of ``math`` against ``layers``."""
    return pair_summary(runs, "layers", "math")


def stacked_summary(runs: list[dict]) -> dict:
    """``--stacked``'s verdicts: :func:`profiled_summary` of ``unstacked`` against
    ``stacked``."""
    return profiled_summary(runs, "stacked", "unstacked")


def pack_gqa_summary(runs: list[dict]) -> dict:
    """``--pack-gqa``'s verdicts: :func:`profiled_summary` of ``packed`` against
    ``unpacked``, with each set's capture seconds and the layers that shared one
    compiled body (and why not), per run: packing must not cost the shared body."""
    summary = profiled_summary(runs, "unpacked", "packed")
    for key in ("capture_s", "compile_regions", "compile_regions_error"):
        per_set: dict[str, list] = {}
        for run in runs:
            per_set.setdefault(run["backends"], []).append(run.get(key))
        summary[key] = per_set
    return summary


def profiled_summary(runs: list[dict], base: str, other: str) -> dict:
    """:func:`pair_summary` of ``other`` against ``base``, with each set's median
    kernels and kernel-busy ms a token per batch (from the profiled activity)."""
    summary = pair_summary(runs, base, other)
    for key in ("kernels_per_token", "kernel_busy_ms_per_token"):
        per_set: dict[str, dict[str, list[float]]] = {}
        for run in runs:
            for batch, activity in run.get("activity", {}).items():
                if activity.get(key) is not None:
                    per_set.setdefault(run["backends"], {}).setdefault(batch, [])
                    per_set[run["backends"]][batch].append(activity[key])
        summary[key] = {
            name: {batch: statistics.median(v) for batch, v in by_batch.items()}
            for name, by_batch in per_set.items()
        }
    return summary


def paired(probe: str, names: tuple[str, ...], summarize) -> None:
    """Each of ``names`` in a fresh child with an empty inductor cache, profiled after
    its timing; the record written to ``$OUT/probe-<probe>.json`` after every child
    (a call cut short keeps what ran)."""
    record: dict = {
        "probe": probe,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "buckets": list(serving_hf.BUCKETS),
        "new_tokens": serving_hf.NEW_TOKENS,
        "runs": [],
    }
    for name in names:
        with tempfile.TemporaryDirectory(prefix="serving_compiles_") as cache_dir:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, **{PROFILE_ENV: "1"})
            child, run = run_child(["--decode-child", name], env, timeout=200)
        run.setdefault("backends", name)
        if child.returncode != 0:
            run["stderr_tail"] = child.stderr[-2000:]
        record["runs"].append(run)
        print(name, json.dumps({k: v for k, v in run.items() if k != "tokens"})[:1500], flush=True)
        record["summary"] = summarize(record["runs"])
        if os.environ.get("OUT"):
            with open(Path(os.environ["OUT"]) / f"probe-{probe}.json", "w") as f:
                json.dump(record, f, indent=1)
    print(json.dumps(record["summary"]), flush=True)


def by_attention() -> None:
    """Each of :data:`ATTENTION_RUNS` in a fresh child (:func:`paired`)."""
    paired("serving_compiles_attention", ATTENTION_RUNS, attention_summary)


def by_stacked() -> None:
    """Each of :data:`STACK_RUNS` in a fresh child (:func:`paired`)."""
    paired("serving_compiles_stacked", STACK_RUNS, stacked_summary)


def by_pack_gqa() -> None:
    """Each of :data:`PACK_RUNS` in a fresh child (:func:`paired`)."""
    paired("serving_compiles_pack_gqa", PACK_RUNS, pack_gqa_summary)


def by_regional() -> None:
    """Each of :data:`REGION_SETS` in a fresh child with an empty inductor cache: what
    one compiled body for every decoder layer saves at capture and costs per token
    against the whole model compiled as one."""
    record: dict = {
        "probe": "serving_compiles_regions",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "buckets": list(serving_hf.BUCKETS),
        "new_tokens": serving_hf.NEW_TOKENS,
        "runs": {},
    }
    for name in REGION_SETS:
        with tempfile.TemporaryDirectory(prefix="serving_compiles_") as cache_dir:
            logs = "recompiles,hierarchical_compile"
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCH_LOGS=logs)
            child, run = run_child(["--decode-child", name], env, timeout=200)
        run["recompiles"] = recompile_reasons(child.stderr)[:20]
        run["layer_bodies_installed"] = len(INSTALLED.findall(child.stderr))
        if child.returncode != 0:
            run["stderr_tail"] = child.stderr[-2000:]
        record["runs"][name] = run
        print(name, json.dumps({k: v for k, v in run.items() if k != "tokens"})[:2500], flush=True)
    record["summary"] = regions_summary(record["runs"])
    print(json.dumps(record["summary"]), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "probe-serving_compiles-regions.json", "w") as f:
            json.dump(record, f, indent=1)


def regions_summary(runs: dict[str, dict]) -> dict:
    """``--regional``'s verdicts: each set's capture seconds against
    ``CAPTURE_TARGET_S``, per batch ms per token of ``layers`` over ``whole``, and
    whether their greedy tokens are equal (``None`` where a child failed)."""
    a, b = runs.get("layers", {}), runs.get("whole", {})
    summary: dict = {"capture_s": {}, "capture_le_20s": {}}
    for name, run in runs.items():
        seconds = run.get("capture_s")
        summary["capture_s"][name] = seconds
        summary["capture_le_20s"][name] = None if seconds is None else seconds <= CAPTURE_TARGET_S
    times_a, times_b = a.get("ms_per_token", {}), b.get("ms_per_token", {})
    summary["layers_per_token_ratio"] = {
        k: round(v / times_b[k], 4) if times_b.get(k) else None for k, v in times_a.items()
    }
    summary["tokens_equal"] = {
        k: v == b["tokens"][k] if k in b.get("tokens", {}) else None
        for k, v in a.get("tokens", {}).items()
    }
    return summary


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
    children = {"--child": capture_once, "--decode-child": decode_once}
    modes = {
        "--backends": by_backends,
        "--regional": by_regional,
        "--decode": by_decode,
        "--attention": by_attention,
        "--stacked": by_stacked,
        "--pack-gqa": by_pack_gqa,
    }
    flag = sys.argv[1] if len(sys.argv) > 1 else None
    if flag in children:
        print(json.dumps(children[flag](sys.argv[2])), flush=True)
        return
    if flag in modes:
        modes[flag]()
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
