"""Graph-program replay benchmark: the per-call cost of ``CudaGraphProgram.replay``
and the copy/compute overlap of ``copy_inputs_from`` + ``replay_prepared``.

Cases (the variants of a per-call case are built together, then timed in turns, so
that drift in host speed during the run affects them alike):

* ``one_input``: ``torch.add(x, 1)`` on a 1024-float tensor: one kernel, so a step
  is almost nothing but per-call host overhead.
* ``tree_64``: ``torch._foreach_add`` over a dict of 8 lists of 8 tensors of 256
  floats (one fused kernel, returns a list of 64 tensors): per-leaf host overhead.
* ``prefetch``: 64 MiB of pinned CPU input per step (a 4096 x 4096 float32 matrix)
  and two fp32 matmuls on it, 20 steps: transfer/compute overlap.

Variants of ``one_input`` and ``tree_64``, all fed a source tree other than the
capture example, in the caller's default grad mode (no input requires grad):

* ``eager``: the function itself.
* ``raw``: one ``torch.cuda.CUDAGraph``; a step is ``graph.replay()`` and copies
  nothing (the floor for a replay).
* ``raw_plus_copy``: ``static.copy_(x)`` (one leaf) or one fused
  ``torch._foreach_copy_`` over pre-flattened leaves (tree), then ``graph.replay()``.
* ``raw_plus_copy_below_autograd``: the same copy dispatched below autograd (no
  in-place checks, no version counter bumps), as ``ReusableValueBuffer`` copies: the
  floor for a replay that copies.
* ``cudagraphs_program``: ``CudaGraphProgram.replay(tree)`` with the default staging
  (``"auto"``: in-graph staging for ``one_input``, one fused copy for ``tree_64``);
  validation + staging + replay. The same source tree at every step.
* ``cudagraphs_program_unvalidated``: ``replay(tree, validate=False)``.
* ``cudagraphs_program_copy``: ``staging="copy"``: one fused copy per call.
* ``cudagraphs_program_rotating``: the default, fed 4 source trees in turn, so that
  in-graph staging updates its memcpy nodes at every step.
* ``naive_wrapper``: what one writes by hand: ``pytree.tree_leaves`` of the tree, one
  ``copy_`` per leaf, ``graph.replay()``.
* ``torch_make_graphed_callables``: the torch helper around a wrapper taking the leaves
  as positional arguments; a step flattens the tree and calls it.
* ``torch_compile_reduce_overhead``: ``torch.compile(mode="reduce-overhead")``.
* ``kernel_busy``: profiler kernel-busy time of a ``raw`` step (the physical floor),
  measured after all wall-clock timings, because CUPTI may stay attached after
  profiling and slow later launches (pytorch/pytorch#144455, #146604).

Variants of ``prefetch`` (times per step, one window = 20 steps):

* ``serial``: ``program.replay(pinned)``: a synchronous copy, then the replay.
* ``prefetch``: two programs of the same function, alternating; step i+1's input is
  copied with ``copy_inputs_from`` on a transfer stream while step i replays, then
  ``replay_prepared(copy_handle=...)``. Two programs, because one program has one
  input buffer, and a copy into it waits for the replay that reads it.
* ``prefetch_one_program``: the same loop on one program; the automatic wait on the
  last replay serializes it (no overlap expected).
* ``copy_only``: the H2D copies alone (``copy_inputs_from``); gives the bandwidth.
* ``compute_only``: ``replay_prepared()`` alone.

Prints one JSON object; ``--out`` also writes it. Without a CUDA device it says so on
stderr and exits 0 (2 with ``--require-gpu``). Exits 1 after printing when a variant
other than the torch helper, torch.compile and kernel_busy failed, or when a program's
output differed from eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO / "src") not in sys.path:
    # Run against this checkout's sources, also without PYTHONPATH=src.
    sys.path.insert(0, str(_REPO / "src"))

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from _report import (  # noqa: E402
    add_common_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    write_report,
)
from cudagraphs import CudaGraphCaptureError, CudaGraphProgram  # noqa: E402
from cudagraphs.timing import (  # noqa: E402
    interleaved_step_times_ms,
    kernel_busy_ms,
    step_time_ms,
)

DEVICE = "cuda"
EXAMPLE_SEED, SOURCE_SEED = 0, 1
ONE_NUMEL = 1024
TREE_GROUPS, TREE_PER_GROUP, TREE_NUMEL = 8, 8, 256
PREFETCH_DIM = 4096  # input: DIM x DIM float32 = 64 MiB
PREFETCH_MATMULS = 2
PREFETCH_STEPS = 20
PREFETCH_SOURCES = 3  # != 2 programs, so each program sees changing data (race check)
ITERS, REPEATS, WARMUP = 1000, 21, 100
SHUFFLE_SEED = 0  # each round times the variants in a new (seeded) order
WINDOW_WARMUP = 2  # warmup windows of the prefetch case
CHECK_RTOL = {"one_input": 0.0, "tree_64": 0.0, "prefetch": 1e-4}
ONE_INPUT_TARGET_US = 5.0  # cudagraphs_program - raw
TREE_TARGET_RATIO = 1.3  # cudagraphs_program / raw_plus_copy
COMPILE_VARIANT = "torch_compile_reduce_overhead"
HELPER_VARIANT = "torch_make_graphed_callables"
OURS = "cudagraphs_program"
# Failures of these are recorded and do not change the exit status: none is ours.
NOT_FATAL = (COMPILE_VARIANT, HELPER_VARIANT, "kernel_busy")


# ---- cases -------------------------------------------------------------------------


def one_input_fn(x: torch.Tensor) -> torch.Tensor:
    return torch.add(x, 1)


def tree_fn(tree: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    return torch._foreach_add([t for key in sorted(tree) for t in tree[key]], 1.0)


def prefetch_fn(x: torch.Tensor) -> torch.Tensor:
    y = x
    for _ in range(PREFETCH_MATMULS):
        y = torch.mm(y, x)
    return y.sum(dim=0)


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=DEVICE)


def one_input_args(seed: int) -> tuple:
    return (_randn((ONE_NUMEL,), seed),)


def tree_args(seed: int) -> tuple:
    rows = _randn((TREE_GROUPS * TREE_PER_GROUP, TREE_NUMEL), seed).unbind(0)
    # One storage per leaf (clones, not views of one block): a program requires it, and
    # it keeps the fused copies honest (64 separate tensors, as a real tree has).
    tree = {
        f"g{g}": [rows[g * TREE_PER_GROUP + i].clone() for i in range(TREE_PER_GROUP)]
        for g in range(TREE_GROUPS)
    }
    return (tree,)


def prefetch_args(seed: int) -> tuple:
    return (_randn((PREFETCH_DIM, PREFETCH_DIM), seed),)


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., object]
    make_args: Callable[[int], tuple]  # seed -> positional arguments on the GPU
    describe: dict


CASES = {
    "one_input": Case(
        "one_input", one_input_fn, one_input_args, {"fn": "torch.add(x, 1)", "numel": ONE_NUMEL}
    ),
    "tree_64": Case(
        "tree_64",
        tree_fn,
        tree_args,
        {
            "fn": "torch._foreach_add(leaves, 1.0)",
            "tree": f"dict of {TREE_GROUPS} lists of {TREE_PER_GROUP} tensors",
            "leaves": TREE_GROUPS * TREE_PER_GROUP,
            "numel_per_leaf": TREE_NUMEL,
        },
    ),
    "prefetch": Case(
        "prefetch",
        prefetch_fn,
        prefetch_args,
        {
            "fn": f"{PREFETCH_MATMULS} x torch.mm({PREFETCH_DIM}^2 float32), then sum(dim=0)",
            "input_bytes": PREFETCH_DIM * PREFETCH_DIM * 4,
            "steps": PREFETCH_STEPS,
            "pinned_sources": PREFETCH_SOURCES,
        },
    ),
}


@dataclass
class Built:
    """One variant, ready to time: its step, its setup time, a correctness check to
    run after timing (ours only) and how to release it."""

    step: Callable[[], object]
    setup_s: float = 0.0
    release: Callable[[], None] = field(default=lambda: None)
    check: Callable[[], dict] | None = None
    extra: dict = field(default_factory=dict)


# ---- helpers -----------------------------------------------------------------------


def compare(got: object, want: object, rtol: float) -> dict:
    """Largest |got - want| over all leaves; ok when within ``rtol`` of want's scale."""
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(g) != len(w):
        return {"ok": False, "error": f"{len(g)} output leaves, eager has {len(w)}"}
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(g, w))
    scale = max(b.float().abs().max().item() for b in w)
    return {"max_abs_diff": diff, "ref_max_abs": scale, "ok": diff <= rtol * max(scale, 1.0)}


def capture_raw(fn: Callable[..., object], static_args: tuple) -> torch.cuda.CUDAGraph:
    """The PyTorch-notes recipe: warm up on a side stream, then capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*static_args)
    torch.cuda.synchronize()
    return graph


def _timed_setup(build: Callable[[], object]) -> tuple[object, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    made = build()
    torch.cuda.synchronize()
    return made, time.perf_counter() - t0


# ---- variants of the per-call cases ------------------------------------------------


def build_eager(case: Case) -> Built:
    src = case.make_args(SOURCE_SEED)
    return Built(lambda: case.fn(*src))


def _build_raw(case: Case, copy: str | None) -> Built:
    static, src = case.make_args(EXAMPLE_SEED), case.make_args(SOURCE_SEED)
    graph, setup_s = _timed_setup(lambda: capture_raw(case.fn, static))
    static_leaves, src_leaves = pytree.tree_leaves(static), pytree.tree_leaves(src)
    if copy is None:
        step = graph.replay
    elif copy == "fused" and len(static_leaves) == 1:
        dst, one = static_leaves[0], src_leaves[0]

        def step() -> None:
            dst.copy_(one)
            graph.replay()

    elif copy == "fused":

        def step() -> None:
            torch._foreach_copy_(static_leaves, src_leaves)
            graph.replay()

    elif copy == "fused_below_autograd":
        below = torch._C._AutoDispatchBelowADInplaceOrView()

        def step() -> None:
            with below:
                if len(static_leaves) == 1:
                    static_leaves[0].copy_(src_leaves[0])
                else:
                    torch._foreach_copy_(static_leaves, src_leaves)
            graph.replay()

    else:

        def step() -> None:
            for s, t in zip(static_leaves, pytree.tree_leaves(src)):
                s.copy_(t)
            graph.replay()

    return Built(step, setup_s, graph.reset)


def build_ours(case: Case, validate: bool = True, staging: str = "auto", rotate: int = 1) -> Built:
    """``rotate`` > 1 feeds that many different source trees in turn, so that under
    in-graph staging every step changes the memcpy nodes' sources."""
    example = case.make_args(EXAMPLE_SEED)
    sources = [case.make_args(SOURCE_SEED + k) for k in range(rotate)]
    program, setup_s = _timed_setup(
        lambda: CudaGraphProgram.capture(case.fn, example_inputs=example, staging=staging)
    )

    def check() -> dict:
        results = []
        for src in sources:
            out = program.replay(*src, copy_output=True, synchronize=True, validate=validate)
            results.append(compare(out, case.fn(*src), CHECK_RTOL[case.name]))
        return max(results, key=lambda r: r.get("max_abs_diff", float("inf")))

    if rotate == 1:
        src = sources[0]

        def step() -> object:
            return program.replay(*src, validate=validate)

    else:
        turn = itertools.cycle(sources)

        def step() -> object:
            return program.replay(*next(turn), validate=validate)

    extra = {"stats": dataclasses.asdict(program.stats), "staging": program.staging}
    return Built(step, setup_s, program.close, check, extra)


def build_helper(case: Case) -> Built:
    example, src = case.make_args(EXAMPLE_SEED), case.make_args(SOURCE_SEED)
    spec = pytree.tree_structure(example)

    def flat(*leaves: torch.Tensor) -> object:
        # The torch helper takes flat tuples of tensors only.
        return case.fn(*pytree.tree_unflatten(list(leaves), spec))

    sample = tuple(pytree.tree_leaves(example))
    graphed, setup_s = _timed_setup(lambda: torch.cuda.make_graphed_callables(flat, sample))
    return Built(lambda: graphed(*pytree.tree_leaves(src)), setup_s)


def build_compile(case: Case) -> Built:
    src = case.make_args(SOURCE_SEED)
    compiled = torch.compile(case.fn, mode="reduce-overhead")

    def step() -> object:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*src)

    def warm() -> None:
        # Compilation, cudagraph-tree warmup and recording happen on the first steps.
        for _ in range(3):
            step()

    try:
        _, setup_s = _timed_setup(warm)
    except BaseException:
        torch.compiler.reset()  # drop half-made compiled code and cudagraph trees
        raise
    return Built(step, setup_s, torch.compiler.reset)


VARIANTS: dict[str, Callable[[Case], Built]] = {
    "eager": build_eager,
    "raw": lambda case: _build_raw(case, None),
    "raw_plus_copy": lambda case: _build_raw(case, "fused"),
    # The same copy dispatched below autograd, as the program's buffer does.
    "raw_plus_copy_below_autograd": lambda case: _build_raw(case, "fused_below_autograd"),
    OURS: build_ours,
    # The same with replay(validate=False): no per-leaf checks, for trusted callers.
    f"{OURS}_unvalidated": lambda case: build_ours(case, validate=False),
    # Staging by one fused copy per call (the default for many-leaf programs).
    f"{OURS}_copy": lambda case: build_ours(case, staging="copy"),
    # A different source tree at every step (4 in turn): under in-graph staging each
    # step updates the memcpy nodes, where the default variant reuses one source.
    f"{OURS}_rotating": lambda case: build_ours(case, rotate=4),
    "naive_wrapper": lambda case: _build_raw(case, "naive"),
    HELPER_VARIANT: build_helper,
    COMPILE_VARIANT: build_compile,
}


def measure_all(case: Case, variants: list[str], iters: int, repeats: int) -> dict[str, dict]:
    """Build every variant, time them in turns (µs per step; see
    ``interleaved_step_times_ms``), run their checks, release them. Errors are
    returned as ``{"error": ...}``, never raised."""
    results: dict[str, dict] = {}
    built: dict[str, Built] = {}
    for name in variants:
        print(f"program_replay: {case.name}: build {name}", file=sys.stderr, flush=True)
        try:
            built[name] = VARIANTS[name](case)
        except Exception as exc:
            results[name] = describe_error(exc)
    try:
        print(f"program_replay: {case.name}: timing {len(built)} variants", file=sys.stderr)
        ms = interleaved_step_times_ms(
            {n: b.step for n, b in built.items()},
            iters=iters,
            warmup=WARMUP,
            repeats=repeats,
            shuffle_seed=SHUFFLE_SEED,
        )
        for name, b in built.items():
            results[name] = {"us": ms[name] * 1e3, "setup_s": round(b.setup_s, 4), **b.extra}
            if b.check is not None:
                try:
                    results[name]["check"] = b.check()
                except Exception as exc:
                    results[name]["check"] = {"ok": False, **describe_error(exc)}
    except Exception as exc:
        for name in built:
            results.setdefault(name, describe_error(exc))
    finally:
        for b in built.values():
            try:
                b.release()
            except Exception as exc:
                describe_error(exc)
        built.clear()
        free_memory()
    return {name: results[name] for name in variants}


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 4)


def run_per_call_case(case: Case, variants: list[str], iters: int, repeats: int) -> dict:
    results = measure_all(case, variants, iters, repeats)
    us = {n: r["us"] for n, r in results.items() if "us" in r}
    raw, raw_copy, ours = us.get("raw"), us.get("raw_plus_copy"), us.get(OURS)
    report = {
        "settings": {**case.describe, "iters": iters, "repeats": repeats, "warmup": WARMUP},
        "us": us,
        "variants": results,
        "minus_raw_us": {n: _diff(v, raw) for n, v in us.items() if n != "raw"},
        "ratio_to_raw_plus_copy": {
            n: _ratio(v, raw_copy) for n, v in us.items() if n != "raw_plus_copy"
        },
    }
    if case.name == "one_input":
        gap = _diff(ours, raw)
        ok = None if gap is None else gap <= ONE_INPUT_TARGET_US
        report["targets"] = {f"{OURS}_minus_raw_le_{ONE_INPUT_TARGET_US:g}us": ok}
    else:
        ratio = _ratio(ours, raw_copy)
        ok = None if ratio is None else ratio <= TREE_TARGET_RATIO
        report["targets"] = {f"{OURS}_le_{TREE_TARGET_RATIO:g}x_raw_plus_copy": ok}
    return report


# ---- prefetch case -----------------------------------------------------------------


@dataclass
class PrefetchRig:
    """Two programs of the same function, pinned sources and their eager outputs."""

    programs: list[CudaGraphProgram]
    sources: list[torch.Tensor]
    expected: list[torch.Tensor]
    transfer: torch.cuda.Stream
    steps: int

    def source(self, i: int) -> torch.Tensor:
        return self.sources[i % len(self.sources)]

    def close(self) -> None:
        for program in self.programs:
            program.close()


def capture_matmul_program(fn: Callable[..., object], example: tuple, notes: list[str]):
    """Capture with the default first-replay check (bitwise equality with the last
    warmup). Should only that check fail (cuBLAS choosing another kernel inside
    capture), capture again without it, note why, and leave correctness to the
    tolerance check against eager: one failed check must not cost the whole case."""
    try:
        return CudaGraphProgram.capture(fn, example_inputs=example)
    except CudaGraphCaptureError as exc:
        if "first replay's output differs" not in str(exc):
            raise
        notes.append(f"recaptured with check_first_replay=False after: {exc}"[:1000])
        return CudaGraphProgram.capture(fn, example_inputs=example, check_first_replay=False)


def make_rig(case: Case) -> tuple[PrefetchRig, float, list[str]]:
    gpu = [case.make_args(SOURCE_SEED + k)[0] for k in range(PREFETCH_SOURCES)]
    sources = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in gpu]
    expected = [case.fn(t) for t in gpu]
    del gpu
    example, notes = case.make_args(EXAMPLE_SEED), []
    programs, setup_s = _timed_setup(
        lambda: [capture_matmul_program(case.fn, example, notes) for _ in range(2)]
    )
    rig = PrefetchRig(programs, sources, expected, torch.cuda.Stream(), PREFETCH_STEPS)
    return rig, setup_s, notes


def window_serial(rig: PrefetchRig, outputs: list | None = None) -> None:
    program = rig.programs[0]
    for i in range(rig.steps):
        out = program.replay(rig.source(i), copy_output=outputs is not None)
        if outputs is not None:
            outputs.append(out)


def window_prefetch(rig: PrefetchRig, programs: int, outputs: list | None = None) -> None:
    """Replay step i, then start the copy of step i+1 on the transfer stream. The copy
    waits (on the device) for the last replay of the program it fills: with two
    programs that is step i-1, so it overlaps step i; with one it is step i itself."""
    ring = rig.programs[:programs]
    handle = ring[0].copy_inputs_from(rig.source(0), stream=rig.transfer)
    for i in range(rig.steps):
        out = ring[i % programs].replay_prepared(
            copy_handle=handle, copy_output=outputs is not None
        )
        if outputs is not None:
            outputs.append(out)
        if i + 1 < rig.steps:
            nxt = ring[(i + 1) % programs]
            handle = nxt.copy_inputs_from(rig.source(i + 1), stream=rig.transfer)


def window_copy_only(rig: PrefetchRig) -> None:
    for i in range(rig.steps):
        rig.programs[0].copy_inputs_from(rig.source(i), stream=rig.transfer)


def window_compute_only(rig: PrefetchRig) -> None:
    for _ in range(rig.steps):
        rig.programs[0].replay_prepared()


PREFETCH_WINDOWS: dict[str, Callable[..., None]] = {
    "serial": window_serial,
    "prefetch": lambda rig, outputs=None: window_prefetch(rig, 2, outputs),
    "prefetch_one_program": lambda rig, outputs=None: window_prefetch(rig, 1, outputs),
    "copy_only": window_copy_only,
    "compute_only": window_compute_only,
}
CHECKED_WINDOWS = ("serial", "prefetch", "prefetch_one_program")


def check_window(rig: PrefetchRig, name: str) -> dict:
    outputs: list[torch.Tensor] = []
    PREFETCH_WINDOWS[name](rig, outputs)
    torch.cuda.synchronize()
    want = [rig.expected[i % len(rig.expected)] for i in range(len(outputs))]
    return compare(outputs, want, CHECK_RTOL["prefetch"])


def _time_windows(rig: PrefetchRig, repeats: int) -> dict:
    results = {}
    for name, window in PREFETCH_WINDOWS.items():
        print(f"program_replay: prefetch: {name}", file=sys.stderr, flush=True)
        try:
            ms = step_time_ms(
                lambda w=window: w(rig), iters=1, warmup=WINDOW_WARMUP, repeats=repeats
            )
            results[name] = {"ms": ms / rig.steps}
            if name in CHECKED_WINDOWS:
                results[name]["check"] = check_window(rig, name)
        except Exception as exc:
            results[name] = describe_error(exc)
    return results


def prefetch_summary(ms: dict[str, float], nbytes: int) -> dict:
    serial, copy, compute = ms.get("serial"), ms.get("copy_only"), ms.get("compute_only")
    shorter = None if copy is None or compute is None else min(copy, compute)
    longer = None if copy is None or compute is None else max(copy, compute)

    def overlap(variant: str) -> float | None:
        v = ms.get(variant)
        return None if v is None or serial is None else _ratio(serial - v, shorter)

    return {
        "h2d_gb_per_s": None if not copy else round(nbytes / (copy / 1e3) / 1e9, 2),
        "ideal_ms": longer,
        "overlap": overlap("prefetch"),
        "overlap_one_program": overlap("prefetch_one_program"),
        "prefetch/ideal": _ratio(ms.get("prefetch"), longer),
        "prefetch/serial": _ratio(ms.get("prefetch"), serial),
    }


def run_prefetch_case(case: Case, repeats: int) -> dict:
    report: dict = {"settings": {**case.describe, "repeats": repeats, "warmup": WINDOW_WARMUP}}
    report["settings"]["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    print("program_replay: prefetch: capture", file=sys.stderr, flush=True)
    try:
        rig, setup_s, notes = make_rig(case)
    except Exception as exc:
        report["variants"] = {"setup": describe_error(exc)}
        return report
    try:
        report["setup_s"] = round(setup_s, 4)
        if notes:
            report["notes"] = notes
        report["stats"] = [dataclasses.asdict(p.stats) for p in rig.programs]
        results = _time_windows(rig, repeats)
    finally:
        rig.close()
        del rig
        free_memory()
    ms = {n: r["ms"] for n, r in results.items() if "ms" in r}
    report.update(ms_per_step=ms, variants=results)
    report.update(prefetch_summary(ms, case.describe["input_bytes"]))
    prefetch, serial = ms.get("prefetch"), ms.get("serial")
    ok = None if prefetch is None or serial is None else prefetch < serial
    report["targets"] = {"prefetch_lt_serial": ok}
    return report


# ---- kernel-busy floor -------------------------------------------------------------


def add_kernel_busy(report: dict) -> None:
    """The raw replay's kernel-busy time per step, into each case (µs, or ms for
    ``prefetch``). Runs last: see the module docstring."""
    for name, res in report["cases"].items():
        print(f"program_replay: {name}: kernel_busy", file=sys.stderr, flush=True)
        built = None
        try:
            built = _build_raw(CASES[name], None)
            ms = kernel_busy_ms(built.step)
            if name == "prefetch":
                res.setdefault("ms_per_step", {})["kernel_busy"] = ms
            else:
                res["us"]["kernel_busy"] = ms * 1e3
                res["ratio_to_kernel_busy"] = {
                    n: _ratio(v, ms * 1e3) for n, v in res["us"].items() if n != "kernel_busy"
                }
        except Exception as exc:
            res.setdefault("variants", {})["kernel_busy"] = describe_error(exc)
        finally:
            if built is not None:
                built.release()
            del built
            free_memory()


# ---- report and CLI ----------------------------------------------------------------


def failures(report: dict) -> list[str]:
    failed = []
    for case, res in report["cases"].items():
        for name, r in res.get("variants", {}).items():
            if "error" in r and name not in NOT_FATAL:
                failed.append(f"{case}/{name}")
            if name in (OURS, *CHECKED_WINDOWS) and not r.get("check", {}).get("ok", True):
                failed.append(f"{case}/{name}: output differs from eager")
    return failed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--iters", type=int, default=ITERS, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=REPEATS, help="windows, median taken")
    p.add_argument("--skip-compile", action="store_true", help=f"leave out {COMPILE_VARIANT}")
    add_common_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = exit_code_without_gpu("program_replay", args.require_gpu)
    if code is not None:
        return code
    started = time.perf_counter()
    variants = [v for v in VARIANTS if not (args.skip_compile and v == COMPILE_VARIANT)]
    report = environment("program_replay", args.commit, args.run_label)
    report["settings"] = {
        "variants": variants,
        "step_time": "median over repeats of the mean wall time of iters back-to-back "
        "steps, synchronized at both ends of each window; the variants of a case are "
        "built together and timed in turns (one window each per round, in an order "
        "shuffled per round with a fixed seed)",
        "prefetch_time": "median over repeats of one window of steps, per step",
        "kernel_busy": "cudagraphs.timing.kernel_busy_ms defaults (iters=20, warmup=5) "
        "of a raw replay, after all wall-clock timings",
        "grad_mode": torch.is_grad_enabled(),
    }
    report["cases"] = {}
    for name in args.cases:
        case = CASES[name]
        if name == "prefetch":
            report["cases"][name] = run_prefetch_case(case, args.repeats)
        else:
            report["cases"][name] = run_per_call_case(case, variants, args.iters, args.repeats)
    # Written once before profiling too, so a crash in the profiler loses no timings.
    write_report("program_replay", report, args.out, final=False)
    add_kernel_busy(report)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report("program_replay", report, args.out, final=True)
    failed = failures(report)
    if failed:
        print(f"program_replay: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
