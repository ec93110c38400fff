"""Which HF decoder families capture with ``GraphedGenerator(compile_regions=None)``
under inductor on the CPU, with their layers as one compiled body, with the whole model
after a fallback, or not at all?

Run from the repository root (any torch and transformers: the record names them):

    PYTHONPATH=src:tests python benchmarks/probes/regions_families_cpu.py --out DIR

Each family is the tests' tiny config at three layers (vocabulary 128), captured at
buckets (2, 4) with ``compile_options={"backend": <inductor, recording its graphs>}``
and every bucket required; then greedy generation of 4 tokens at batch 4, 3, 2 and 1
against HF's static-cache ``generate``. The record keeps per family the capture's
seconds, the graphs compiled, the layer-body calls and distinct bodies per graph,
``stats()["compile_regions"]`` and ``["compile_regions_error"]``, the token checks and
the eager runs. Writes ``probe-regions_families-cpu-torch<version>-<commit>.json``.

``--stacked`` compiles through inductor as users do (``compile_options={}``), so the
generator's default ``stack_projections`` lays each layer's sibling linears back to
back and makes their GEMMs one: the record then keeps ``stacked_projections`` and the
graphs dynamo compiled (its ``unique_graphs``) instead of the layer-body calls, and
is written as ``probe-regions_families_stacked-cpu-...``. ``--pack-gqa`` builds the
generators with ``pack_gqa=True`` (grouped heads read as rows at decode; ``_pack_gqa``
in the name), and the record says per family whether its heads are grouped.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import transformers
from torch._inductor.compile_fx import compile_fx

from helpers.hf_generate import EOS, PAD, captured, hf_generate, prompts
from helpers.hf_models import ARCH_CONFIGS, CONFIGS

FAMILIES = (
    "llama", "qwen3_moe", "mixtral", "deepseek_v3", "mistral", "qwen2", "qwen3", "gemma",
    "phi", "olmoe", "gpt_neox", "falcon", "gpt2", "opt",
)  # fmt: skip


def one(family: str, stacked: bool = False, pack_gqa: bool = False) -> dict:
    torch._dynamo.reset()
    base = CONFIGS.get(family) or ARCH_CONFIGS[family]
    extra = {"num_hidden_layers": 3} if "num_hidden_layers" in base else {}
    if family not in CONFIGS:
        extra["vocab_size"] = 128
    if family == "mistral":
        extra["sliding_window"] = 8
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **{**base, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    from torch._dynamo.utils import counters

    counters.clear()
    options = {} if stacked else {"backend": inductor}
    t0 = time.perf_counter()
    gen = captured(
        model, (2, 4), compile_options=options, require_all_buckets=True, pack_gqa=pack_gqa
    )
    seconds = time.perf_counter() - t0
    hop = torch.ops.higher_order.invoke_subgraph
    calls = [[n.args[0].target for n in g.graph.nodes if n.target is hop] for g in graphs]
    tokens_equal = {}
    for batch in (4, 3, 2, 1):
        ids, mask = prompts(batch, seed=batch)
        ours = gen.generate(ids, mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
        want = hf_generate(model, ids, mask, 4, eos_token_id=EOS, pad_token_id=PAD)
        tokens_equal[str(batch)] = bool(torch.equal(ours, want))
    stats = gen.stats()
    return {
        "capture_s": round(seconds, 2),
        "graphs": counters["stats"]["unique_graphs"] if stacked else len(graphs),
        "stacked_projections": stats["stacked_projections"],
        "body_calls": [len(c) for c in calls],
        "distinct_bodies": [len(set(c)) for c in calls],
        "compile_regions": stats["compile_regions"],
        "compile_regions_error": stats["compile_regions_error"],
        "tokens_equal": tokens_equal,
        "eager_runs": stats["eager_runs"],
        "pack_gqa": stats["pack_gqa"],
        "grouped_heads": getattr(model.config, "num_key_value_heads", None)
        not in (None, getattr(model.config, "num_attention_heads", None)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--stacked", action="store_true", help="compile_options={}")
    parser.add_argument("--pack-gqa", action="store_true", help="pack_gqa=True")
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "probe": "regions_families"
        + ("_stacked" if args.stacked else "")
        + ("_pack_gqa" if args.pack_gqa else ""),
        "device": "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
        "families": {},
    }
    for family in args.families:
        try:
            run = one(family, args.stacked, args.pack_gqa)
        except Exception as exc:  # recorded; the other families still run
            run = {"error": f"{type(exc).__name__}: {str(exc)[:800]}"}
        record["families"][family] = run
        print(family, json.dumps(run), flush=True)
    if args.out:
        version = torch.__version__.split("+")[0]
        path = args.out / f"probe-{record['probe']}-cpu-torch{version}-{commit}.json"
        path.write_text(json.dumps(record, indent=1))
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
