"""Is graph_train_step bit for bit the eager loop on tiny float32 HF models, and why not?

Run from the repository root on the GPU machine:

    PYTHONPATH=src python benchmarks/probes/fp32_bitwise.py

For each family (tests/helpers/hf_fp32.py: 2 layers, hidden 64, 4 query heads, 2 key/value heads
except llama_mha and gpt2, batch 2, seq 64, AdamW lr 1e-3, 8 steps, dropout off) it
prints one JSON line per variant:

* eager_copy: the eager loop against the eager loop of a second copy (determinism);
* graph: graph_train_step as shipped (cudagraphs.hf_masks open around warmup+capture),
  the model called as model(input_ids, labels) (its cache on, the default);
* graph_unfixed: the same with cudagraphs.hf_masks turned off (transformers as is);
* graph_use_cache_false: as shipped, model(..., use_cache=False);
* graph_ones_mask: as shipped, model(..., attention_mask=all ones).

Each graph variant is compared with the eager loop called the same way. A header line
names transformers, torch and the device; then one line per case: param_diff /
loss_diff (max abs after 8 steps), bitwise, replayed (no model forward ran in Python
during the 8 steps), masks (what the step's stats.masks_built_in_capture names),
warnings (how many WARNINGs cudagraphs.train.step logged), and the distinct SDPA calls
seen eagerly (the warmup) and under capture, each "none|MASK causal|- gqa|- qheads/kheads
BACKEND" (BACKEND: what torch._fused_sdp_choice picks for those arguments). The full
lines also go to $OUT/fp32_bitwise.jsonl when OUT is set.

How to read it: the cause is confirmed when graph_unfixed shows sdpa_capture "MASK - -
4/4 <backend>" where sdpa_eager is "none causal gqa 4/2 <another backend>" and is not
bitwise, while graph is bitwise with sdpa_capture equal to sdpa_eager. The last line is
a summary. Stops starting new cases after BUDGET_S seconds.
"""

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import cudagraphs.train.step as step_module  # noqa: E402
from cudagraphs.hf_masks import MaskChoices  # noqa: E402
from helpers import hf_fp32 as H  # noqa: E402

BUDGET_S = 80.0
# A plumbing check without a GPU: PROBE_DEVICE=cpu CUDAGRAPHS_DISABLE=1 (nothing graphed).
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
T0 = time.perf_counter()

# ---- the SDPA spy (this probe only) ------------------------------------------------
_SDPA = torch.nn.functional.scaled_dot_product_attention
_CALLS: list[tuple] = []
try:
    from torch.nn.attention import SDPBackend

    _BACKENDS = {int(v): k for k, v in SDPBackend.__members__.items()}
except Exception:  # noqa: BLE001
    _BACKENDS = {}


def _backend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    try:
        choice = torch._fused_sdp_choice(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
        return _BACKENDS.get(int(choice), str(choice))
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({type(exc).__name__})"


def _capturing():
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # CPU-only torch (a dry run here)
        return False


def _spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    phase = "capture" if _capturing() else "eager"
    _CALLS.append(
        (
            phase,
            attn_mask is None,
            bool(is_causal),
            bool(enable_gqa),
            q.shape[1],
            k.shape[1],
            _backend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa),
        )
    )
    return _SDPA(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


torch.nn.functional.scaled_dot_product_attention = _spy


def _sdpa(phase):
    """Distinct SDPA calls of ``phase``: "mask|none, causal|-, gqa|-, qheads/kheads,
    backend"."""
    out = []
    for c in sorted(set(c for c in _CALLS if c[0] == phase)):
        _, no_mask, causal, gqa, qh, kh, backend = c
        flags = ["none" if no_mask else "MASK", "causal" if causal else "-", "gqa" if gqa else "-"]
        out.append(" ".join([*flags, f"{qh}/{kh}", backend.replace("_ATTENTION", "")]))
    return out


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _unfixed():
    """cudagraphs.hf_masks off: transformers chooses its masks under capture as it does."""

    @contextlib.contextmanager
    def nothing():
        yield MaskChoices()

    real = step_module.eager_mask_choice
    step_module.eager_mask_choice = nothing
    try:
        yield
    finally:
        step_module.eager_mask_choice = real


VARIANTS = {
    "graph": ({}, False),
    "graph_unfixed": ({}, True),
    "graph_use_cache_false": ({"use_cache": False}, False),
    "graph_ones_mask": ({"attention_mask": "ones"}, False),
}


def _call(kwargs):
    if kwargs.get("attention_mask") == "ones":
        return {"attention_mask": torch.ones(H.BATCH, H.SEQ, dtype=torch.long, device=DEVICE)}
    return dict(kwargs)


def run_case(family, variant, master, data, eager_cache):
    import copy

    t = time.perf_counter()
    row = {"case": f"{family}/{variant}"}
    if variant == "eager_copy":
        a, b = copy.deepcopy(master), copy.deepcopy(master)
        _CALLS.clear()
        la, lb = H.eager_loop(a, data), H.eager_loop(b, data)
        row.update(
            param_diff=H.max_param_diff(a, b),
            loss_diff=H.max_loss_diff(la, lb),
            sdpa_eager=_sdpa("eager"),
            attn=master.config._attn_implementation,
        )
        row["bitwise"] = row["param_diff"] == 0 and row["loss_diff"] == 0
        row["s"] = round(time.perf_counter() - t, 1)
        return row
    kwargs, unfixed = VARIANTS[variant]
    key = json.dumps(kwargs, sort_keys=True)
    if key not in eager_cache:
        ref = copy.deepcopy(master)
        eager_cache[key] = (ref, H.eager_loop(ref, data, **_call(kwargs)))
    ref, ref_losses = eager_cache[key]
    model = copy.deepcopy(master)
    handler = _Warnings()
    logging.getLogger(step_module.__name__).addHandler(handler)
    _CALLS.clear()
    try:
        with _unfixed() if unfixed else contextlib.nullcontext():
            step, losses, forwards = H.graphed_loop(model, data, **_call(kwargs))
    finally:
        logging.getLogger(step_module.__name__).removeHandler(handler)
    row.update(
        replayed=step.graphed and forwards == 0,
        param_diff=H.max_param_diff(model, ref),
        loss_diff=H.max_loss_diff(losses, ref_losses),
        sdpa_eager=_sdpa("eager"),
        sdpa_capture=_sdpa("capture"),
    )
    masks = getattr(step.stats, "masks_built_in_capture", ["n/a"])
    if masks:
        row["masks"] = [m.split(":")[0] for m in masks]
    if handler.lines:
        row["warnings"] = len(handler.lines)
    row["bitwise"] = row["param_diff"] == 0 and row["loss_diff"] == 0
    step.reset()
    row["s"] = round(time.perf_counter() - t, 1)
    return row


def _emit(row):
    line = json.dumps(row)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "fp32_bitwise.jsonl", "a") as f:
            f.write(line + "\n")


def main():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 2
    import transformers

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    _emit({"transformers": transformers.__version__, "torch": torch.__version__, "device": device})
    families = list(H.FAMILIES)
    order = ["eager_copy", "graph", "graph_unfixed"]
    later = ["graph_use_cache_false", "graph_ones_mask"]
    plan = [(f, v) for f in families for v in order] + [(f, v) for f in families for v in later]
    masters, caches = {}, {}
    bitwise, differ, not_replayed = [], {}, []
    data = H.batches(device=DEVICE)
    for family, variant in plan:
        if time.perf_counter() - T0 > BUDGET_S:
            _emit({"case": f"{family}/{variant}", "skipped": "time budget"})
            continue
        try:
            if family not in masters:
                masters[family] = H.build(family, DEVICE)
                caches[family] = {}
            row = run_case(family, variant, masters[family], data, caches[family])
        except Exception as exc:  # noqa: BLE001
            row = {"case": f"{family}/{variant}", "error": f"{type(exc).__name__}: {exc}"[:400]}
        _emit(row)
        if "bitwise" in row:
            if row["bitwise"]:
                bitwise.append(row["case"])
            else:
                differ[row["case"]] = float(f"{row['param_diff']:.3g}")
            if row.get("replayed") is False:
                not_replayed.append(row["case"])
        elif "error" in row:
            differ[row["case"]] = "error"
    _emit(
        {
            "summary": {"bitwise": len(bitwise), "differ": differ, "not_replayed": not_replayed},
            "seconds": round(time.perf_counter() - T0, 1),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
