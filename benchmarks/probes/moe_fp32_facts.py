"""GPU facts behind the float32 grouped_mm MoE handling (issue 35 item 5), one JSON
object on stdout (and $OUT/moe_fp32_facts.json when $OUT is set).

Run from the repo root: PYTHONPATH=src:tests python benchmarks/probes/moe_fp32_facts.py

Facts (in this order; the deliberately failed capture last):
  probe            GroupedMMProbe's answer per dtype (float32 False on torch 2.11 / H200)
  hf_decode_switch what HF's generate runs per experts call: the prefill grouped_mm, each
                   decode step batched_mm (transformers' _optimize_model_for_decode)
  batched_vs_grouped  float32 decode logits of batched_mm vs grouped_mm (max abs diff)
                   and whether greedy tokens decoded all-grouped_mm equal HF's: why the
                   generator only switches where HF's generate does
  batched_train_capture  a float32 batched_mm layer's forward+backward captures (fix 2
                   for training layers)
  generator        GraphedGenerator on float32 grouped_mm: buckets captured, decode
                   experts, tokens equal HF's at batches 1, 3 (padded) and 4
  capture_fails    a float32 grouped_mm MoE block fails to capture, with which error
"""

import contextlib
import json
import os
import sys
import traceback

import torch

sys.path[:0] = ["src", "tests"]

import transformers  # noqa: E402

from cudagraphs.capture import capture_into_graph  # noqa: E402
from cudagraphs.moe_kernels import GroupedMMProbe  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from cudagraphs.serving.hf.cache import cache_keyword  # noqa: E402
from helpers.moe_models import moe, roped_layers  # noqa: E402

MAX_CACHE_LEN, NEW, PAD = 64, 16, 1
facts: dict = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "gpu": torch.cuda.get_device_name(),
    "capability": torch.cuda.get_device_capability(),
}
torch.backends.cuda.matmul.allow_tf32 = False


def fact(name):
    def wrap(fn):
        try:
            facts[name] = fn()
        except Exception as exc:  # a fact that cannot be read says why
            facts[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            traceback.print_exc()
        return fn

    return wrap


def prompts(batch, longest=10):
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, 128, (batch, longest), generator=g)
    mask = torch.ones(batch, longest, dtype=torch.long)
    for row in range(batch):
        ids[row, : row % 3] = PAD
        mask[row, : row % 3] = 0
    return ids.cuda(), mask.cuda()


def hf_static(model, ids, mask):
    keyword = cache_keyword(model)
    cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            disable_compile=True,
            eos_token_id=[],
            pad_token_id=PAD,
            **{keyword: cache},
        )


def recording(model):
    seen = []
    experts = model.model.layers[0].mlp.experts
    handle = experts.register_forward_pre_hook(
        lambda m, args: seen.append((m.config._experts_implementation, args[0].shape[0]))
    )
    return seen, handle


@fact("probe")
def _():
    probe = GroupedMMProbe()
    return {
        str(d): probe.on_device(torch.zeros(1, device="cuda", dtype=d))
        for d in (torch.float32, torch.bfloat16, torch.float16)
    }


@fact("hf_decode_switch")
def _():
    model = moe("olmoe", device="cuda").eval()
    seen, handle = recording(model)
    ids, mask = prompts(2)
    hf_static(model, ids, mask)
    handle.remove()
    prefill, *decode = seen
    return {
        "prefill": prefill,
        "decode_implementations": sorted({impl for impl, _ in decode}),
        "decode_calls": len(decode),
        "after": model.get_experts_implementation(),
    }


@fact("batched_vs_grouped")
def _():
    model = moe("olmoe", device="cuda").eval()
    ids, mask = prompts(4)
    want = hf_static(model, ids, mask)  # prefill grouped_mm, decode batched_mm

    @contextlib.contextmanager
    def no_switch(self):
        yield

    real = transformers.GenerationMixin._optimize_model_for_decode
    transformers.GenerationMixin._optimize_model_for_decode = no_switch
    try:
        grouped = hf_static(model, ids, mask)  # every step grouped_mm
    finally:
        transformers.GenerationMixin._optimize_model_for_decode = real
    x = torch.randn(8, 64, device="cuda")
    block = model.model.layers[0].mlp
    with torch.no_grad():
        a = block(x[None])
        model.set_experts_implementation("batched_mm")
        b = block(x[None])
        model.set_experts_implementation("grouped_mm")
    return {
        "block_max_abs_diff": float((a - b).abs().max()),
        "block_bitwise_equal": bool(torch.equal(a, b)),
        "tokens_all_grouped_equal_hf": bool(torch.equal(grouped, want)),
    }


@fact("batched_train_capture")
def _():
    model = moe("olmoe", implementation="batched_mm", device="cuda").train()
    hidden = torch.randn(2, 16, 64, device="cuda", requires_grad=True)
    layer = roped_layers(model, hidden)[0]

    def step():
        out = layer(hidden)
        out.float().pow(2).mean().backward()
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        return {"captured": True}
    except Exception as exc:
        return {"captured": False, "error": str(exc)[:600]}


@fact("generator")
def _():
    model = moe("olmoe", device="cuda").eval()
    gen = GraphedGenerator(model, (1, 2, 4, 8), max_cache_len=MAX_CACHE_LEN)
    gen.capture(progress=False)
    out = {"captured": gen.stats()["captured"], "dropped": gen.stats()["dropped"]}
    out["decode_experts"] = gen.stats()["decode_experts"]
    for batch in (1, 3, 4):
        ids, mask = prompts(batch)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=[], pad_token_id=PAD)
        out[f"tokens_equal_hf_batch_{batch}"] = bool(torch.equal(ours, hf_static(model, ids, mask)))
    out["replays"] = gen.stats()["replays"]
    out["eager_runs"] = gen.stats()["eager_runs"]
    out["after"] = model.get_experts_implementation()
    return out


@fact("capture_fails")
def _():
    model = moe("olmoe", device="cuda").eval()
    x = torch.randn(2, 16, 64, device="cuda")
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block(x)
        try:
            capture_into_graph(lambda: block(x), what="float32 grouped_mm MoE block")
        except Exception as exc:
            cause = exc.__cause__
            return {"failed": True, "error": str(exc)[:600], "cause": str(cause)[:400]}
    return {"failed": False}


text = json.dumps(facts, indent=2, default=str)
print(text)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "moe_fp32_facts.json"), "w") as f:
        f.write(text)
