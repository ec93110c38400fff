"""Does ``cudagraphs.compile_stacked`` train every HF decoder family like the plain
``torch.compile``, and how many GEMMs does it take out of each one's graphs?

Run from the repository root (any torch and transformers: the record names them):

    PYTHONPATH=src:tests python benchmarks/probes/stacked_train_families_cpu.py --out DIR

Each family is the tests' tiny config at two layers (vocabulary 128), in float32 and in
training mode. One copy goes through ``compile_stacked``, another through
``torch.compile``; each takes three AdamW steps on the same batch (the model's own
loss, ``labels=input_ids``). The record keeps per family the projection groups laid
back to back, the GEMMs the pass removed from each graph inductor compiled (forward and
backward apart), every step's two losses, the largest difference of any gradient (first
step) relative to that gradient's largest value (floored at a thousandth of the largest
gradient anywhere), and the largest difference of any parameter after the last step in
units of the learning rate.
Each forward starts from the same seed, so dropout (GPT-2, OPT) draws alike in both.
Stacking changes only the order of sums, so these are float32 rounding. Writes
``probe-stacked_train_families-cpu-torch<version>-<commit>.json``.
"""

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import transformers

import cudagraphs
from cudagraphs.stacking import gemms
from helpers.hf_models import ARCH_CONFIGS, CONFIGS

FAMILIES = (
    "llama", "qwen3_moe", "mixtral", "deepseek_v3", "mistral", "qwen2", "qwen3", "gemma",
    "phi", "olmoe", "gpt_neox", "falcon", "gpt2", "opt",
)  # fmt: skip
STEPS = 3


LR = 1e-3


def _gradient_difference(model: torch.nn.Module, plain: torch.nn.Module) -> float:
    """The largest difference of a gradient, relative to that gradient's largest
    value, or to a thousandth of the largest gradient anywhere when that is more: a
    gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores
    it) holds only rounding, whose relative difference means nothing."""
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters())]
    pairs = [(a, b) for a, b in pairs if b is not None]
    floor = 1e-3 * max(b.abs().max().item() for _, b in pairs)
    return max((a - b).abs().max().item() / max(b.abs().max().item(), floor) for a, b in pairs)


def one(family: str) -> dict:
    torch._dynamo.reset()
    base = CONFIGS.get(family) or ARCH_CONFIGS[family]
    extra = {"num_hidden_layers": 2} if "num_hidden_layers" in base else {}
    if family not in CONFIGS:
        extra["vocab_size"] = 128
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **{**base, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    plain = copy.deepcopy(model)
    removed: list[int] = []
    real = gemms.stack_graph

    def counting(graph):
        removed.append(real(graph))
        return removed[-1]

    gemms.stack_graph = counting
    t0 = time.perf_counter()
    try:
        stacked = cudagraphs.compile_stacked(model)
        plain_compiled = torch.compile(plain)
        opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, plain)]
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        losses, grads = [], None
        for step in range(STEPS):
            pair = []
            for m in (stacked, plain_compiled):
                torch.manual_seed(step)  # dropout (GPT-2, OPT) draws alike in both
                loss = m(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                pair.append(loss.item())
            if step == 0:
                grads = _gradient_difference(model, plain)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            losses.append(pair)
        params = max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters())
        )
        moved = stacked.groups.moved()
    finally:
        gemms.stack_graph = real
    return {
        "groups": [list(g) for g in stacked.groups.names],
        "removed_per_graph": removed,
        "losses": losses,
        "loss_max_abs_diff": max(abs(a - b) for a, b in losses),
        "grad_max_rel_diff": grads,
        # AdamW moves every element by about the learning rate whatever its gradient's
        # size, so rounding in a gradient that is zero in exact arithmetic can move a
        # parameter by up to 2 x LR a step apart.
        "param_max_abs_diff_in_lr": params / LR,
        "moved_after": moved,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    # The pass runs only when inductor compiles: a cached graph would skip it.
    inductor_config.force_disable_caches = True
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "probe": "stacked_train_families_cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
        "steps": STEPS,
        "families": {},
    }
    for family in args.families:
        try:
            record["families"][family] = one(family)
        except Exception as e:  # a family that fails is a finding, not the end
            record["families"][family] = {"error": f"{type(e).__name__}: {e}"[:800]}
        print(family, json.dumps(record["families"][family])[:300], file=sys.stderr, flush=True)
    path = Path(args.out) / (
        f"probe-stacked_train_families-cpu-torch{torch.__version__.split('+')[0]}-{commit}.json"
    )
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
