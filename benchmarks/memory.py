"""Device memory of every graphed layer against the eager run of the same work.

Each variant runs in its own process (``--child``), eager first, so that no variant
sees another's cache: a fresh CUDA context, the model built from the same seeds, the
work run, and the process's own ``torch.cuda.max_memory_reserved()`` /
``max_memory_allocated()`` read at the end (the peak over set-up, capture and steps)
and after set-up (``steady_*``: over the steps alone). ``device_used_bytes``: the drop
in the device's free memory from the context's creation to the end (torch's reserved
memory plus what the driver holds for the process: graph executables, library
handles); device-wide, so measured only where children run one at a time
(``--jobs 1``), else ``None``.

Work (HF Llama from config, bf16, SDPA, random weights):

* training shapes ``small`` (8 layers, hidden 512, batch 4, seq 512), ``mid``
  (16 layers, hidden 2048, batch 1, seq 1024) and ``6b`` (32 layers, hidden 4096,
  batch 1, seq 2048); a step is the model's causal-LM loss, ``backward()``, fused
  ``AdamW`` and ``zero_grad(set_to_none=True)``. Variants: ``eager``;
  ``graph_train_step``; ``graph_stack`` and ``make_graphed_callables`` (the decoder
  layers, each taking and returning the hidden states, as one graph / one graph per
  layer, with the embedding, norm, head and loss eager; ``_lent``: lent gradients;
  ``_late``: captured after two eager steps of the whole model, as in mid-training,
  so the optimizer's state and the eager cuBLAS workspaces exist before the capture);
  ``partial_default`` and
  ``partial_model`` (``PartialCudaGraphManager`` with its default scopes / the
  ``"model"`` scope; one recorded eager step, then captured); ``trainer_eager`` and
  ``trainer_callback`` (HF ``Trainer`` without and with ``PartialGraphsCallback``,
  against each other).
* a decode config (the ``mid`` model in eval mode, batch 8, prompt 128, 32 new
  tokens, cache of 256): ``hf_static`` (HF ``generate`` with a ``StaticCache``) against
  ``graphed_generator`` (``GraphedGenerator`` with buckets 1, 2, 4, 8 and the same
  cache length); ``runner_eager`` (the model's forward over the batch, eagerly)
  against ``graph_runner`` (a ``GraphRunner`` of that forward, buckets 1, 2, 4, 8).

Largest batch (``--search``): under a per-process cap of ``--cap-gib`` of device
memory (``torch.cuda.set_per_process_memory_fraction``, the same for every process),
the largest batch that runs without running out of memory, found by doubling then
bisection, eagerly and graphed: ``small`` training at seq 512 for
``graph_train_step`` and ``partial_default`` against ``eager``, and the decode config
for ``graphed_generator`` against ``hf_static``. A cap keeps each probe small; the
allocator's limit applies to every pool alike, so the comparison is that of a full
device. ``--jobs`` searches run at once (each variant searched once).

``--segments`` (a diagnostic): each child also reports a census of its allocator
segments after its steps (``info["segments"]``: per pool the segments, reserved and
live bytes; the default pool's segments held by a few live blocks, with those blocks'
allocation sites; per graph pool the allocation sites of its live blocks), and what
grew reserved memory during the set-up and during the steps (``info["setup_growth"]``,
``info["steady_growth"]``: the segments allocated or mapped, by pool, read from the
address among the final segments, ``released`` for one given back since, and
allocation site). It records
torch's memory history, which slows allocation, so its peaks are not to be quoted.

Targets: ``<layer>_peak_reserved_le_1.10x_eager`` per layer and shape run (the
larger ratio over the training shapes run);
``<layer>_peak_allocated_le_1.05x_eager_plus_static``: the allocated peak less the
static buffers the graphs own (their memory account's ``static_bytes``) within 1.05x
of eager's (``ratios[...]["allocated_less_static"]``);
``<layer>_largest_batch_ge_eager`` with ``--search``. Each child also returns the
library's INFO log (``log``: its releases, packing and capture accounts).

Prints one JSON object; ``--out`` also writes it. Without a CUDA device it says so and
exits 0 (2 with ``--require-gpu``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

import _report  # noqa: F401  (first: puts this checkout's src on sys.path)
from _report import add_common_arguments, environment, exit_code_without_gpu, write_report

NAME = "memory"
RATIO_TARGET = 1.10
# Peak allocated: within this of eager's, beyond the static buffers the graphs own.
ALLOCATED_TARGET = 1.05
DTYPE = torch.bfloat16
MODEL_SEED, INPUT_SEED = 0, 1
STEPS = 4
TRAIN_LAYERS = (
    "graph_train_step",
    "graph_stack",
    "make_graphed_callables",
    "partial_default",
    "partial_model",
    "trainer_callback",
)
# The core's opt-in lent gradients (clone_param_grads_on_return=False), beside its
# owned default: partial graphs lend, the core owns unless asked.
LENT_LAYERS = ("graph_stack_lent", "make_graphed_callables_lent")
# The core's layers captured in mid-training, after two eager steps of the whole model
# (the optimizer's state and the eager cuBLAS workspaces exist before the capture).
LATE_LAYERS = ("graph_stack_late", "make_graphed_callables_late", "graph_train_step_late")
# Each graphed variant and the eager run of the same work.
REFERENCE = {
    **dict.fromkeys((*TRAIN_LAYERS, *LENT_LAYERS, *LATE_LAYERS), "eager"),
    "trainer_callback": "trainer_eager",
    "graphed_generator": "hf_static",
    "graph_runner": "runner_eager",
}
SEARCHED = {
    "graph_train_step": "eager",
    "partial_default": "eager",
    "graphed_generator": "hf_static",
}
DECODE = {"batch": 8, "prompt": 128, "new_tokens": 32, "cache": 256, "buckets": (1, 2, 4, 8)}
CHILD_TIMEOUT_S = 420


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    batch: int
    seq: int
    vocab: int = 32000


SHAPES = {
    "small": Shape(8, 512, 1376, 8, 4, 512),
    "mid": Shape(16, 2048, 5504, 16, 1, 1024),
    "6b": Shape(32, 4096, 11008, 32, 1, 2048),
}
# 6b runs the layers that fit its time and memory: the step and partial default.
SHAPE_VARIANTS = {
    "small": (
        "eager",
        *TRAIN_LAYERS[:5],
        *LENT_LAYERS,
        *LATE_LAYERS,
        "trainer_eager",
        "trainer_callback",
    ),
    "mid": (
        "eager",
        *TRAIN_LAYERS[:5],
        *LENT_LAYERS,
        *LATE_LAYERS,
        "trainer_eager",
        "trainer_callback",
    ),
    "6b": ("eager", "graph_train_step", "partial_default"),
}
SERVING_VARIANTS = ("hf_static", "graphed_generator", "runner_eager", "graph_runner")


# ---- the child: one variant in one process ------------------------------------------


def _config(shape: Shape):
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        vocab_size=shape.vocab,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )


def _model(shape: Shape, train: bool):
    import transformers

    torch.manual_seed(MODEL_SEED)
    with torch.device("cuda"):
        net = transformers.LlamaForCausalLM._from_config(_config(shape), dtype=DTYPE)
    net.generation_config.eos_token_id = None
    net.generation_config.pad_token_id = 0
    return net.train() if train else net.eval()


def _ids(shape: Shape, batch: int, seq: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(INPUT_SEED)
    return torch.randint(0, shape.vocab, (batch, seq), generator=gen, device="cuda")


def _loss(net, ids: torch.Tensor) -> torch.Tensor:
    return net(input_ids=ids, labels=ids, use_cache=False).loss


class _Layer(torch.nn.Module):
    """A decoder layer as a function of the hidden states alone: it computes its own
    rotary embeddings, so that layers can follow one another in one graph."""

    def __init__(self, layer, rotary, seq: int) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.register_buffer("positions", torch.arange(seq, device="cuda")[None], persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        cos_sin = self.rotary(hidden, self.positions)
        out = self.layer(hidden, position_embeddings=cos_sin, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


def _layers_step(net, layers, ids):
    inner = net.model
    hidden = inner.embed_tokens(ids)
    for layer in layers:
        hidden = layer(hidden)
    logits = net.lm_head(inner.norm(hidden))
    return net.loss_function(logits=logits, labels=ids, vocab_size=net.config.vocab_size)


def layer_kind(variant: str) -> tuple[str, bool, bool] | None:
    """``(layer, lent, late)`` of a per-layer variant (``graph_stack`` or
    ``make_graphed_callables``, ``_lent`` gradients, ``_late``: captured after two eager
    steps), ``None`` for any other."""
    for kind in ("graph_stack", "make_graphed_callables"):
        rest = variant.removeprefix(kind)
        if rest != variant and rest in ("", "_lent", "_late"):
            return kind, rest == "_lent", rest == "_late"
    return None


def _train_child(variant: str, shape: Shape, batch: int) -> dict:
    import cudagraphs

    net = _model(shape, train=True)
    ids = _ids(shape, batch, shape.seq)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    info: dict = {}

    def eager_step(loss_of) -> None:
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if variant == "eager":
        step = lambda: eager_step(lambda: _loss(net, ids))  # noqa: E731
    elif variant in ("graph_train_step", "graph_train_step_late"):
        # _late: captured after two eager steps (their working set cached, the
        # optimizer state made).
        for _ in range(2 if variant.endswith("_late") else 0):
            eager_step(lambda: _loss(net, ids))

        def step_fn(batch_ids):
            loss = _loss(net, batch_ids)
            loss.backward()
            return loss

        graphed = cudagraphs.graph_train_step(step_fn, ids, optimizer=opt)
        info["account"] = graphed.stats.memory.as_dict()
        step = lambda: graphed(ids)  # noqa: E731
    elif layer_kind(variant) is not None:
        kind, lent, late = layer_kind(variant)
        for _ in range(2 if late else 0):
            eager_step(lambda: _loss(net, ids))
        options = {"clone_param_grads_on_return": not lent}
        if late:
            # The state the eager steps made is packed before the warmup.
            options["optimizers"] = (opt,)
        layers = [_Layer(layer, net.model.rotary_emb, shape.seq) for layer in net.model.layers]
        hidden = torch.randn(batch, shape.seq, shape.hidden, device="cuda", dtype=DTYPE)
        sample = (hidden.requires_grad_(),)
        if kind == "graph_stack":
            stack = cudagraphs.graph_stack(layers, sample, **options)
            run_layers, graphed = [stack], stack.cuda_graph
        else:
            samples = tuple(sample for _ in layers)
            cudagraphs.make_graphed_callables(tuple(layers), samples, **options)
            run_layers, graphed = layers, layers[0].cuda_graph
        del sample, hidden
        account = graphed.memory
        info["account"] = account.as_dict() if account is not None else None
        step = lambda: eager_step(lambda: _layers_step(net, run_layers, ids))  # noqa: E731
        out = _run(step, info)
        # Whether owned gradients were handed out as graph memory, and what moves copied
        # (CUDAGRAPHS_OWNED_GRADS=defer): a set_to_none loop should copy nothing.
        copies = graphed.deferred_copies
        out["info"]["deferred_copies"] = {
            "deferred": copies.deferred,
            "moves": copies.moves,
            "moved_bytes": copies.moved_bytes,
        }
        return out
    elif variant in ("partial_default", "partial_model"):
        from cudagraphs.partial import MODEL_SCOPE, PartialCudaGraphManager

        scopes = None if variant == "partial_default" else (MODEL_SCOPE,)
        mgr = PartialCudaGraphManager.from_model_parts([net], scopes=scopes, speed_check=False)
        mgr.start_recording()
        eager_step(lambda: _loss(net, ids))
        mgr.capture()
        out = _run(lambda: eager_step(lambda: _loss(net, ids)), info)
        out["info"]["stats"] = _stats(mgr.stats())
        return out
    else:
        raise ValueError(variant)
    return _run(step, info)


def _trainer_child(variant: str, shape: Shape, batch: int) -> dict:
    import tempfile

    import transformers

    from cudagraphs.integrations.hf import PartialGraphsCallback

    torch.manual_seed(MODEL_SEED)
    net = transformers.LlamaForCausalLM._from_config(_config(shape), dtype=torch.float32)
    steps = 3 + STEPS
    gen = torch.Generator().manual_seed(INPUT_SEED)
    rows = torch.randint(0, shape.vocab, (steps * batch, shape.seq), generator=gen)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    callbacks = [PartialGraphsCallback()] if variant == "trainer_callback" else []
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            bf16=True,
            report_to=[],
            max_steps=steps,
            per_device_train_batch_size=batch,
            learning_rate=1e-4,
            optim="adamw_torch_fused",
            logging_steps=steps,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(
            model=net, args=args, train_dataset=data, callbacks=callbacks
        )
        trainer.train()
    torch.cuda.synchronize()
    info = {}
    if callbacks:
        info["stats"] = _stats(callbacks[0].stats())
        info["off_reason"] = callbacks[0].off_reason
    return {**_peaks(), "steady_reserved": None, "steady_allocated": None, "info": info}


def _serving_child(variant: str, shape: Shape, batch: int, searching: bool) -> dict:
    import transformers

    from cudagraphs.serving import BucketConfig, GraphRunner, InputSpec
    from cudagraphs.serving.hf import GraphedGenerator

    net = _model(shape, train=False)
    ids = _ids(shape, batch, DECODE["prompt"])
    # A search probe captures one bucket and makes fewer tokens: what it asks is
    # whether the batch fits, and the largest bucket holds the most.
    buckets = (batch,) if searching else tuple(b for b in DECODE["buckets"] if b < batch) + (batch,)
    new_tokens = 8 if searching else DECODE["new_tokens"]
    info: dict = {}
    with torch.no_grad():
        if variant == "hf_static":

            def step():
                cache = transformers.StaticCache(config=net.config, max_cache_len=DECODE["cache"])
                net.generate(
                    ids,
                    max_new_tokens=DECODE["new_tokens"],
                    do_sample=False,
                    disable_compile=True,
                    past_key_values=cache,
                )

        elif variant == "graphed_generator":
            gen = GraphedGenerator(net, buckets, max_cache_len=DECODE["cache"])
            gen.capture()
            info["account"] = gen.stats().get("memory")
            step = lambda: gen.generate(ids, max_new_tokens=new_tokens)  # noqa: E731
        elif variant == "runner_eager":
            step = lambda: net(input_ids=ids, use_cache=False).logits  # noqa: E731
        elif variant == "graph_runner":
            spec = InputSpec("input_ids", tuple(ids.shape), torch.long)
            runner = GraphRunner(
                lambda input_ids: net(input_ids=input_ids, use_cache=False).logits,
                [spec],
                BucketConfig(buckets),
            )
            runner.capture(lambda b: {"input_ids": ids[: b.rows]})
            info["account"] = runner.stats().get("memory")
            step = lambda: runner.run({"input_ids": ids})  # noqa: E731
        else:
            raise ValueError(variant)
        return _run(step, info)


# A default-pool segment counts as pinned when its live blocks use less than this share
# of it: the caching allocator can give a segment back only when all of it is free.
PINNED_SHARE = 0.5
# Set for the children by --segments: each adds its segment census to its info.
SEGMENTS_ENV = "CUDAGRAPHS_MEMORY_SEGMENTS"
CENSUS_TOP = 12


def _where(block: dict) -> str:
    """The innermost frame of a block's allocation that is not torch's own code."""
    frames = block.get("frames") or []
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and name:
            return f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def segment_census(snapshot: dict) -> dict:
    """Where reserved memory sits, from ``torch.cuda.memory_snapshot()``'s segments:
    per pool (``default`` or the graph pool's id) segments, reserved and live bytes;
    and the default pool's pinned segments (live blocks under ``PINNED_SHARE`` of the
    segment), the ``CENSUS_TOP`` largest by bytes they hold for nothing, each with its
    live blocks' sizes and the allocation sites (with memory history recorded); and per
    graph pool the ``CENSUS_TOP`` allocation sites of its live blocks by bytes
    (``sites``: what the graphs keep for good)."""
    pools: dict[str, dict[str, int]] = {}
    sites: dict[str, dict[str, list[int]]] = {}
    pinned = []
    for seg in snapshot.get("segments", []):
        pool_id = tuple(seg.get("segment_pool_id") or (0, 0))
        pool = "default" if pool_id == (0, 0) else f"graph{pool_id}"
        total = int(seg.get("total_size", 0))
        live = [b for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
        active = sum(int(b.get("size", 0)) for b in live)
        row = pools.setdefault(pool, {"segments": 0, "reserved": 0, "active": 0})
        row["segments"] += 1
        row["reserved"] += total
        row["active"] += active
        if pool != "default":
            per = sites.setdefault(pool, {})
            for b in live:
                where = per.setdefault(_where(b), [0, 0])
                where[0] += int(b.get("size", 0))
                where[1] += 1
        if pool == "default" and live and active < PINNED_SHARE * total:
            pinned.append(
                {
                    "segment": total,
                    "active": active,
                    "held_for_nothing": total - active,
                    "blocks": [
                        {"size": int(b.get("size", 0)), "where": _where(b)}
                        for b in sorted(live, key=lambda b: -int(b.get("size", 0)))[:4]
                    ],
                }
            )
    pinned.sort(key=lambda r: -r["held_for_nothing"])
    for pool, per in sites.items():
        top = sorted(per.items(), key=lambda kv: -kv[1][0])[:CENSUS_TOP]
        pools[pool]["sites"] = [{"where": w, "bytes": n, "blocks": k} for w, (n, k) in top]
    return {
        "pools": pools,
        "pinned_segments": len(pinned),
        "pinned_bytes": sum(r["held_for_nothing"] for r in pinned),
        "pinned": pinned[:CENSUS_TOP],
    }


_GROWTH = ("segment_alloc", "segment_map")


def pool_of(addr: int, segments: list[dict]) -> str:
    """The pool (``default`` or ``graph(...)``) of the segment of ``segments``
    (``torch.cuda.memory_snapshot()``'s) that holds address ``addr``; ``released``
    when none does (the segment went back to the driver after the event)."""
    for seg in segments:
        start = int(seg.get("address", -1))
        if start <= addr < start + int(seg.get("total_size", 0)):
            pool_id = tuple(seg.get("segment_pool_id") or (0, 0))
            return "default" if pool_id == (0, 0) else f"graph{pool_id}"
    return "released"


def steady_growth(entries: list[dict], segments: list[dict] | None = None) -> list[dict]:
    """What grew reserved memory in ``entries`` (torch's memory-history trace:
    ``segment_alloc``, and ``segment_map`` for expandable segments): bytes and events
    per pool and allocation site, the ``CENSUS_TOP`` largest first.

    A trace entry does not say its pool; it is read from where the entry's address
    lies among ``segments`` (the snapshot's, taken after the trace: :func:`pool_of`),
    or from a ``pool_id`` the entry carries; without either, ``default``."""
    rows: dict[tuple[str, str], list[int]] = {}
    for e in entries:
        if e.get("action") not in _GROWTH:
            continue
        if e.get("pool_id") is not None or not segments:
            pool_id = tuple(e.get("pool_id") or (0, 0))
            pool = "default" if pool_id == (0, 0) else f"graph{pool_id}"
        else:
            pool = pool_of(int(e.get("addr", -1)), segments)
        row = rows.setdefault((pool, _where(e)), [0, 0])
        row[0] += int(e.get("size", 0))
        row[1] += 1
    top = sorted(rows.items(), key=lambda kv: -kv[1][0])[:CENSUS_TOP]
    return [{"pool": p, "where": w, "bytes": n, "events": k} for (p, w), (n, k) in top]


_SHRINK = ("segment_free", "segment_unmap")
BIG_BLOCK = 8 << 20  # a block this large is named by its size among its site's blocks


def peak_census(entries: list[dict], segments: list[dict]) -> dict:
    """What was live at the trace's highest reserved memory, by pool and allocation
    site: the census that tells which tensors make a peak (the partial ``"model"``
    scope's warmup gradient for the logits was found with it).

    Reserved memory is followed through ``entries`` alone: ``segment_alloc`` and
    ``segment_map`` add their size, ``segment_free`` and ``segment_unmap`` take it away
    (an expandable segment maps and unmaps pieces of itself), from the trace's start
    (the child records memory history from its start). A block is live from its
    ``alloc`` to the ``free_completed`` of its address. At the first entry where
    reserved memory is highest: ``index`` (of ``of`` entries), ``reserved`` and
    ``allocated`` there, and per pool (:func:`pool_of` on ``segments``, the snapshot
    taken after the trace) the ``live`` bytes and the ``CENSUS_TOP`` sites by bytes
    (``where``, with a block's size in MiB where it is ``BIG_BLOCK`` or more)."""
    reserved = allocated = 0
    best, at = -1, -1
    for i, e in enumerate(entries):
        action, size = e.get("action"), int(e.get("size", 0))
        if action in _GROWTH:
            reserved += size
        elif action in _SHRINK:
            reserved -= size
        if reserved > best:
            best, at = reserved, i
    live: dict[int, dict] = {}
    for e in entries[: at + 1]:
        action, addr = e.get("action"), int(e.get("addr", -1))
        if action == "alloc":
            live[addr] = e
        elif action == "free_completed":
            live.pop(addr, None)
    pools: dict[str, dict] = {}
    for addr, e in live.items():
        size = int(e.get("size", 0))
        allocated += size
        row = pools.setdefault(pool_of(addr, segments), {"live": 0, "sites": {}})
        row["live"] += size
        where = _where(e) + (f" [{size >> 20} MiB]" if size >= BIG_BLOCK else "")
        site = row["sites"].setdefault(where, [0, 0])
        site[0] += size
        site[1] += 1
    for row in pools.values():
        top = sorted(row["sites"].items(), key=lambda kv: (-kv[1][0], kv[0]))[:CENSUS_TOP]
        row["sites"] = [{"where": w, "bytes": n, "blocks": k} for w, (n, k) in top]
    return {
        "index": at,
        "of": len(entries),
        "reserved": max(best, 0),
        "allocated": allocated,
        "pools": pools,
    }


def _trace() -> list[dict]:
    traces = torch.cuda.memory._snapshot().get("device_traces") or [[]]
    return traces[torch.cuda.current_device()]


def _stats(stats: dict) -> dict:
    keep = ("captured", "replayed", "fallbacks")
    return {k: v for k, v in stats.items() if k.endswith("bytes") or k in keep}


def _peaks() -> dict:
    return {
        "reserved": torch.cuda.max_memory_reserved(),
        "allocated": torch.cuda.max_memory_allocated(),
    }


def _run(step, info: dict) -> dict:
    torch.cuda.synchronize()
    setup = _peaks()
    torch.cuda.reset_peak_memory_stats()
    census = os.environ.get(SEGMENTS_ENV) == "1"
    mark = len(_trace()) if census else 0
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    steady = _peaks()
    if census:
        segments = torch.cuda.memory_snapshot()
        trace = _trace()
        info["segments"] = segment_census({"segments": segments})
        # Set-up (model, recording, warmup, capture) apart from the steps: the pools
        # a capture grows, and the segments the first steps add after it.
        info["setup_growth"] = steady_growth(trace[:mark], segments)
        info["steady_growth"] = steady_growth(trace[mark:], segments)
        info["peak"] = peak_census(trace, segments)
    return {
        "reserved": max(setup["reserved"], steady["reserved"]),
        "allocated": max(setup["allocated"], steady["allocated"]),
        "steady_reserved": steady["reserved"],
        "steady_allocated": steady["allocated"],
        "info": info,
    }


LOG_LINES = 30


class _LogLines(logging.Handler):
    """Keeps the messages of the records it handles, at INFO and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage()[:300])


def child(variant: str, shape_name: str, batch: int, cap_gib: float | None) -> dict:
    torch.cuda.init()
    if os.environ.get(SEGMENTS_ENV) == "1":
        # Allocation sites for the census (torch's memory history: a diagnostic's
        # private API; it slows allocation, so the peaks of such a run are not kept).
        torch.cuda.memory._record_memory_history(stacks="python")
    torch.zeros(1, device="cuda")
    total = torch.cuda.mem_get_info()[1]
    if cap_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * (1 << 30) / total))
    free0 = torch.cuda.mem_get_info()[0]
    reserved0 = torch.cuda.memory_reserved()
    shape = SHAPES.get(shape_name, SHAPES["mid"])
    # What the library said at INFO (its releases, packing and capture accounts).
    said = _LogLines()
    logging.getLogger("cudagraphs").addHandler(said)
    logging.getLogger("cudagraphs").setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        if variant in SERVING_VARIANTS:
            out = _serving_child(variant, shape, batch, searching=bool(cap_gib))
        elif variant.startswith("trainer_"):
            out = _trainer_child(variant, shape, batch)
        else:
            out = _train_child(variant, shape, batch)
        out["ok"] = True
    except torch.OutOfMemoryError as exc:
        out = {"ok": False, "oom": True, "error": str(exc).splitlines()[0][:300]}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["log"] = said.lines[-LOG_LINES:]
    torch.cuda.synchronize()
    out["device_used"] = free0 - torch.cuda.mem_get_info()[0] + reserved0
    return out


# ---- the parent: children, ratios, searches, targets ------------------------------------


def _spawn(variant: str, shape: str, batch: int, cap_gib: float | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--shape", shape, "--batch", str(batch)]
    if cap_gib:
        cmd += ["--child-cap-gib", str(cap_gib)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout)[-1500:]
        oom = "OutOfMemoryError" in tail or "out of memory" in tail
        return {"ok": False, "oom": oom, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def shape_jobs(shapes: list[str], only: list[str]) -> list[tuple[str, str]]:
    """``(shape, variant)`` for every variant each shape runs, in order; with ``only``,
    just those variants (a name no shape runs is an error, not an empty run)."""
    jobs = [
        (shape, v)
        for shape in shapes
        for v in (SERVING_VARIANTS if shape == "decode" else SHAPE_VARIANTS[shape])
    ]
    if not only:
        return jobs
    unknown = sorted(set(only) - {v for _, v in jobs})
    if unknown:
        raise SystemExit(f"{NAME}: --variants {unknown} are not run on shapes {shapes}")
    return [j for j in jobs if j[1] in only]


def static_bytes(result: dict) -> int:
    """The static buffers a variant's graphs own (its memory account's, or the sum of
    its partial graphs' accounts), 0 where it has none."""
    info = result.get("info") or {}
    for source in (info.get("account"), info.get("stats")):
        if source and source.get("static_bytes"):
            return int(source["static_bytes"])
    return 0


def ratios(results: dict) -> dict:
    """Per graphed variant of a shape: reserved and allocated peaks over its eager
    reference's (``None`` where either did not run), and ``allocated_less_static``:
    the allocated peak less the graphs' static buffers (:func:`static_bytes`) over
    eager's."""
    out = {}
    for variant, ref in REFERENCE.items():
        got, base = results.get(variant), results.get(ref)
        if not got or not base or not got.get("ok") or not base.get("ok"):
            continue
        out[variant] = {
            key: round(got[key] / base[key], 4)
            for key in ("reserved", "allocated", "steady_reserved", "steady_allocated")
            if got.get(key) and base.get(key)
        }
        if got.get("allocated") and base.get("allocated"):
            less = got["allocated"] - static_bytes(got)
            out[variant]["allocated_less_static"] = round(less / base["allocated"], 4)
    return out


def largest(probe, start: int, limit: int) -> tuple[int, list]:
    """The largest ``b`` in ``[1, limit]`` with ``probe(b)`` true, assuming it is
    monotone: doubling from ``start``, then bisection; 0 when even 1 fails. Returns
    it and the probes made, in order."""
    seen: list[tuple[int, bool]] = []

    def ok(b: int) -> bool:
        result = probe(b)
        seen.append((b, result))
        return result

    lo, hi = 0, None  # lo passes (0: nothing yet), hi fails
    b = max(1, min(start, limit))
    while hi is None:
        if ok(b):
            lo = b
            if b >= limit:
                return b, seen
            b = min(limit, b * 2)
        else:
            hi = b
            if b == 1:
                return 0, seen
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, seen


def search(variant: str, shape: str, cap_gib: float, start: int, limit: int) -> dict:
    def probe(b: int) -> bool:
        return bool(_spawn(variant, shape, b, cap_gib).get("ok"))

    best, probes = largest(probe, start, limit)
    return {"largest_batch": best, "probes": probes}


def search_tasks(cap_gib: float, decode_cap_gib: float) -> dict[str, tuple[str, float, int]]:
    """Each variant to search, once (``eager`` is the reference of two layers), with
    its shape, cap and first batch."""
    tasks: dict[str, tuple[str, float, int]] = {}
    for layer, ref in SEARCHED.items():
        decode = layer == "graphed_generator"
        task = ("mid", decode_cap_gib, 32) if decode else ("small", cap_gib, 16)
        tasks.setdefault(ref, task)
        tasks.setdefault(layer, task)
    return tasks


def search_all(cap_gib: float, decode_cap_gib: float, jobs: int) -> dict:
    """The largest batch of every searched layer and its reference, ``jobs`` searches at
    once: each probe is its own process under the same cap, so concurrent searches
    change no answer while the device holds ``jobs`` caps."""
    tasks = search_tasks(cap_gib, decode_cap_gib)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = {
            v: pool.submit(search, v, shape, cap, start, 512)
            for v, (shape, cap, start) in tasks.items()
        }
        found = {v: f.result() for v, f in futures.items()}
    return {layer: {ref: found[ref], "graphed": found[layer]} for layer, ref in SEARCHED.items()}


def targets(shape_ratios: dict, searched: dict) -> dict:
    out = {}
    layers = (*TRAIN_LAYERS, *LENT_LAYERS, *LATE_LAYERS, "graphed_generator", "graph_runner")
    for layer in layers:
        values = [r[layer]["reserved"] for r in shape_ratios.values() if layer in r]
        if values:
            out[f"{layer}_peak_reserved_le_{RATIO_TARGET:.2f}x_eager"] = max(values) <= RATIO_TARGET
        values = [
            r[layer]["allocated_less_static"]
            for r in shape_ratios.values()
            if "allocated_less_static" in r.get(layer, {})
        ]
        if values:
            name = f"{layer}_peak_allocated_le_{ALLOCATED_TARGET:.2f}x_eager_plus_static"
            out[name] = max(values) <= ALLOCATED_TARGET
    for layer, ref in SEARCHED.items():
        if layer in searched and ref in searched[layer]:
            got, want = (
                searched[layer]["graphed"]["largest_batch"],
                searched[layer][ref]["largest_batch"],
            )
            out[f"{layer}_largest_batch_ge_eager"] = got >= want > 0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--shape", default="small")
    p.add_argument("--batch", type=int)
    p.add_argument(
        "--shapes", default="small,mid,6b,decode", help="comma-separated: small, mid, 6b, decode"
    )
    p.add_argument(
        "--variants",
        default="",
        help="comma-separated: run only these variants of each shape (default: all); a "
        "graphed variant's ratio needs its eager reference in the list",
    )
    p.add_argument("--jobs", type=int, default=1, help="children at once (device_used only with 1)")
    p.add_argument("--search", action="store_true", help="also find the largest batches")
    p.add_argument(
        "--cap-gib", type=float, default=6.0, help="per-process cap of the training search"
    )
    p.add_argument(
        "--decode-cap-gib", type=float, default=3.5, help="per-process cap of the decode search"
    )
    p.add_argument("--child-cap-gib", type=float, help=argparse.SUPPRESS)
    p.add_argument(
        "--segments",
        action="store_true",
        help="each child adds a census of its allocator segments after its steps, with "
        "allocation sites (slower: a diagnostic, not a measurement)",
    )
    args = p.parse_args(argv)
    if args.segments:
        os.environ[SEGMENTS_ENV] = "1"  # the children inherit it
    if args.child:
        batch = args.batch or (
            DECODE["batch"] if args.child in SERVING_VARIANTS else SHAPES[args.shape].batch
        )
        print(json.dumps(child(args.child, args.shape, batch, args.child_cap_gib)))
        return 0
    code = exit_code_without_gpu(NAME, args.require_gpu)
    if code is not None:
        return code
    report = environment(NAME, args.commit, args.run_label)
    report["settings"] = {
        "segments": args.segments,
        "shapes": {k: asdict(v) for k, v in SHAPES.items()},
        "decode": DECODE,
        "steps": STEPS,
        "jobs": args.jobs,
        "variants": args.variants or "all",
        "cap_gib": {"train": args.cap_gib, "decode": args.decode_cap_gib} if args.search else None,
        "peak": "torch.cuda.max_memory_reserved/allocated of the child process: set-up, capture and steps",
    }
    shapes = [s for s in args.shapes.split(",") if s]
    jobs = shape_jobs(shapes, [v for v in args.variants.split(",") if v])
    results: dict = {}
    # 6b alone: two of its processes do not fit one device.
    alone = [j for j in jobs if j[0] == "6b"]
    shared = [j for j in jobs if j[0] != "6b"]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {
            j: pool.submit(
                _spawn,
                j[1],
                "mid" if j[0] == "decode" else j[0],
                DECODE["batch"] if j[0] == "decode" else SHAPES[j[0]].batch,
            )
            for j in shared
        }
        for j, f in futures.items():
            results.setdefault(j[0], {})[j[1]] = f.result()
    report["results"] = results
    report["ratios"] = {shape: ratios(per) for shape, per in results.items()}
    write_report(NAME, report, args.out, final=False)  # kept should a later phase stop
    for j in alone:
        results.setdefault(j[0], {})[j[1]] = _spawn(j[1], j[0], SHAPES[j[0]].batch)
        print(f"{NAME}: {j[0]} {j[1]} done", file=sys.stderr)
    if args.jobs != 1:
        for per in results.values():
            for r in per.values():
                r["device_used"] = None
    report["results"] = results
    report["ratios"] = {shape: ratios(per) for shape, per in results.items()}
    searched: dict = {}
    if args.search:
        searched = search_all(args.cap_gib, args.decode_cap_gib, args.jobs)
    report["largest_batch"] = searched
    report["targets"] = targets(report["ratios"], searched)
    write_report(NAME, report, args.out, final=True)
    failed = [f"{s}/{v}" for s, per in results.items() for v, r in per.items() if not r.get("ok")]
    if failed:
        print(f"{NAME}: variants that did not run: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
