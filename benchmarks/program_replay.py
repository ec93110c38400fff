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
  floor for a replay that copies, and the baseline of the ``tree_64`` target.
* ``raw_plus_copy_below_autograd_rotating``: the same, fed 4 source trees in turn:
  the like-for-like floor of ``cudagraphs_program_rotating``.
* ``cudagraphs_program``: ``CudaGraphProgram.replay(tree)`` with the default staging
  (``"auto"``: in-graph staging for ``one_input``, one fused copy for ``tree_64``);
  validation + staging + replay. The same source tree at every step.
* ``cudagraphs_program_unvalidated``: ``replay(tree, validate=False)``.
* ``cudagraphs_program_copy``: ``staging="copy"``: one fused copy per call.
* ``cudagraphs_program_rotating``: the default, fed 4 source trees in turn, so that
  in-graph staging updates its memcpy nodes at every step.
* ``cudagraphs_program_rotating_ctypes``: the same with the updates made through the
  ``ctypes`` binding instead of ``cuda.bindings`` (``cudagraphs/cuda_binding.py``).
* ``naive_wrapper``: what one writes by hand: ``pytree.tree_leaves`` of the tree, one
  ``copy_`` per leaf, ``graph.replay()``.
* ``torch_make_graphed_callables``: the torch helper around a wrapper taking the leaves
  as positional arguments; a step flattens the tree and calls it.
* ``torch_compile_reduce_overhead``: ``torch.compile(mode="reduce-overhead")``.
* ``kernel_busy``: profiler kernel-busy time of a ``raw`` step (the physical floor;
  every variant's own is reported too, as ``kernel_busy_us``), measured after all
  wall-clock timings, because CUPTI may stay attached after profiling and slow
  later launches (pytorch/pytorch#144455, #146604).

Every variant except ``eager`` (the reference) is checked against eager once, after
timing. Times are the median over rounds of the per-round mean, with the range.

Targets:

* ``one_input``: ``cudagraphs_program_rotating`` minus
  ``raw_plus_copy_below_autograd_rotating`` (the host work we add to a hand-written
  copy-and-replay, both fed a new tensor each call) is at most one bare replay
  (``raw``) of the same run. Relative, because host speed differs by 2x between
  machines of one kind. The same-source figure (where in-graph staging binds
  nothing) is reported, not targeted.
* ``tree_64``: ``cudagraphs_program`` at most 1.3x ``raw_plus_copy_below_autograd``;
  the ratio to ``raw_plus_copy`` is reported beside it, and ``minus_floor_us``.
* ``prefetch``: prefetching beats the serial loop.

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
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from _report import (  # noqa: E402
    add_common_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    timed_setup,
    write_report,
)
from cudagraphs import CudaGraphCaptureError, CudaGraphProgram  # noqa: E402
from cudagraphs.cuda_binding import cuda_binding  # noqa: E402
from cudagraphs.settings import BINDING_ENV  # noqa: E402
from cudagraphs.timing import (  # noqa: E402
    interleaved_samples_ms,
    kernel_busy_ms,
    summarize,
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
# Our host work per call beyond a hand-written copy-and-replay fed the same
# sources, in bare replays of the same run: at most one (validation and staging of a
# one-tensor call should cost no more than launching one graph does).
ONE_INPUT_TARGET_LAUNCHES = 1.0
TREE_TARGET_RATIO = 1.3  # cudagraphs_program / raw_plus_copy_below_autograd
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
    keep: object = None  # what the graph reads and no closure holds (its static input)


# ---- helpers -----------------------------------------------------------------------


def compare(got: object, want: object, rtol: float) -> dict:
    """Largest |got - want| over all leaves; ok when within ``rtol`` of want's scale."""
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(g) != len(w):
        return {"ok": False, "error": f"{len(g)} output leaves, eager has {len(w)}"}
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(g, w))
    scale = max(b.float().abs().max().item() for b in w)
    return {"max_abs_diff": diff, "ref_max_abs": scale, "ok": diff <= rtol * max(scale, 1.0)}


def capture_raw(
    fn: Callable[..., object], static_args: tuple
) -> tuple[torch.cuda.CUDAGraph, object]:
    """The PyTorch-notes recipe: warm up on a side stream, then capture. Returns the
    graph and its static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_args)
    torch.cuda.synchronize()
    return graph, out


def _checked(step: Callable[[], object], output: Callable[[], object], want: object, rtol: float):
    """A check that runs ``step`` once and compares ``output()`` with ``want``."""

    def check() -> dict:
        step()
        torch.cuda.synchronize()
        return compare(output(), want, rtol)

    return check


# ---- variants of the per-call cases ------------------------------------------------


def build_eager(case: Case) -> Built:
    src = case.make_args(SOURCE_SEED)
    return Built(lambda: case.fn(*src))  # the reference: nothing to check against


def _build_raw(case: Case, copy: str | None, rotate: int = 1) -> Built:
    """A hand-captured graph; ``copy`` says how a step stages its source: ``None``
    (no copy: the graph reads its capture example), ``"fused"`` (one ``copy_`` or
    one ``_foreach_copy_``), ``"fused_below_autograd"`` (the same below autograd, as
    the program's buffer copies) or ``"naive"`` (flatten the tree, one ``copy_`` per
    leaf). ``rotate`` > 1 cycles that many source trees, one per step."""
    static = case.make_args(EXAMPLE_SEED)
    sources = [case.make_args(SOURCE_SEED + k) for k in range(rotate)]
    (graph, out), setup_s = timed_setup(lambda: capture_raw(case.fn, static))
    static_leaves = pytree.tree_leaves(static)
    flat_sources = [pytree.tree_leaves(src) for src in sources]
    turn = itertools.cycle(range(rotate))
    rtol = CHECK_RTOL[case.name]
    if copy is None:
        step = graph.replay
        check = _checked(step, lambda: out, case.fn(*static), rtol)
        return Built(step, setup_s, graph.reset, check, keep=static)
    if copy == "fused" and len(static_leaves) == 1:
        dst = static_leaves[0]

        def step() -> None:
            dst.copy_(flat_sources[next(turn)][0])
            graph.replay()

    elif copy == "fused":

        def step() -> None:
            torch._foreach_copy_(static_leaves, flat_sources[next(turn)])
            graph.replay()

    elif copy == "fused_below_autograd":
        below = torch._C._AutoDispatchBelowADInplaceOrView()

        def step() -> None:
            leaves = flat_sources[next(turn)]
            with below:
                if len(static_leaves) == 1:
                    static_leaves[0].copy_(leaves[0])
                else:
                    torch._foreach_copy_(static_leaves, leaves)
            graph.replay()

    else:

        def step() -> None:
            for s, t in zip(static_leaves, pytree.tree_leaves(sources[next(turn)])):
                s.copy_(t)
            graph.replay()

    # Checked with one source (rotation 1, or the cycle back at source 0 before and
    # after a full turn): the output must be eager's of that source.
    def check() -> dict:
        results = []
        for k in range(rotate):
            step()
            torch.cuda.synchronize()
            results.append(compare(out, case.fn(*sources[k]), rtol))
        return max(results, key=lambda r: r.get("max_abs_diff", float("inf")))

    return Built(step, setup_s, graph.reset, check, keep=static)


def build_ours(
    case: Case,
    validate: bool = True,
    staging: str = "auto",
    rotate: int = 1,
    binding: str = "auto",
) -> Built:
    """``rotate`` > 1 feeds that many different source trees in turn, so that under
    in-graph staging every step changes the memcpy nodes' sources. ``binding`` is the
    CUDA binding in-graph staging updates the nodes through (``CUDAGRAPHS_CUDA_BINDING``
    during capture; the program keeps what it was given)."""
    example = case.make_args(EXAMPLE_SEED)
    sources = [case.make_args(SOURCE_SEED + k) for k in range(rotate)]
    before = os.environ.get(BINDING_ENV)
    os.environ[BINDING_ENV] = binding
    try:
        program, setup_s = timed_setup(
            lambda: CudaGraphProgram.capture(case.fn, example_inputs=example, staging=staging)
        )
    finally:
        if before is None:
            del os.environ[BINDING_ENV]
        else:
            os.environ[BINDING_ENV] = before
    found = cuda_binding(binding)

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

    extra = {
        "stats": dataclasses.asdict(program.stats),
        "staging": program.staging,
        "cuda_binding": found.describe() if found is not None else None,
    }
    return Built(step, setup_s, program.close, check, extra)


def build_helper(case: Case) -> Built:
    example, src = case.make_args(EXAMPLE_SEED), case.make_args(SOURCE_SEED)
    spec = pytree.tree_structure(example)

    def flat(*leaves: torch.Tensor) -> object:
        # The torch helper takes flat tuples of tensors only.
        return case.fn(*pytree.tree_unflatten(list(leaves), spec))

    sample = tuple(pytree.tree_leaves(example))
    graphed, setup_s = timed_setup(lambda: torch.cuda.make_graphed_callables(flat, sample))

    def step() -> object:
        return graphed(*pytree.tree_leaves(src))

    def check() -> dict:
        got = step()
        torch.cuda.synchronize()
        return compare(got, case.fn(*src), CHECK_RTOL[case.name])

    return Built(step, setup_s, check=check)


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
        _, setup_s = timed_setup(warm)
    except BaseException:
        torch.compiler.reset()  # drop half-made compiled code and cudagraph trees
        raise

    def check() -> dict:
        got = step()
        torch.cuda.synchronize()
        return compare(got, case.fn(*src), CHECK_RTOL[case.name])

    return Built(step, setup_s, torch.compiler.reset, check)


VARIANTS: dict[str, Callable[[Case], Built]] = {
    "eager": build_eager,
    "raw": lambda case: _build_raw(case, None),
    "raw_plus_copy": lambda case: _build_raw(case, "fused"),
    # The same copy dispatched below autograd, as the program's buffer does.
    "raw_plus_copy_below_autograd": lambda case: _build_raw(case, "fused_below_autograd"),
    # ... fed 4 sources in turn: the like-for-like floor of the rotating program.
    "raw_plus_copy_below_autograd_rotating": lambda case: _build_raw(
        case, "fused_below_autograd", rotate=4
    ),
    OURS: build_ours,
    # The same with replay(validate=False): no per-leaf checks, for trusted callers.
    f"{OURS}_unvalidated": lambda case: build_ours(case, validate=False),
    # Staging by one fused copy per call (the default for many-leaf programs).
    f"{OURS}_copy": lambda case: build_ours(case, staging="copy"),
    # A different source tree at every step (4 in turn): under in-graph staging each
    # step updates the memcpy nodes, where the default variant reuses one source.
    f"{OURS}_rotating": lambda case: build_ours(case, rotate=4),
    # The same with the node updates made through ctypes rather than cuda.bindings
    # (identical to the above where cuda-bindings is not installed).
    f"{OURS}_rotating_ctypes": lambda case: build_ours(case, rotate=4, binding="ctypes"),
    "naive_wrapper": lambda case: _build_raw(case, "naive"),
    HELPER_VARIANT: build_helper,
    COMPILE_VARIANT: build_compile,
}


def build_all(case: Case, variants: list[str]) -> tuple[dict[str, Built], dict[str, dict]]:
    """Every variant of ``case``, built before any is timed; a failed build is
    recorded as ``{"error": ...}``."""
    built: dict[str, Built] = {}
    errors: dict[str, dict] = {}
    for name in variants:
        print(f"program_replay: {case.name}: build {name}", file=sys.stderr, flush=True)
        try:
            built[name] = VARIANTS[name](case)
        except Exception as exc:
            errors[name] = describe_error(exc)
    return built, errors


def measure_all(
    case: Case, built: dict[str, Built], errors: dict[str, dict], iters: int, repeats: int
) -> dict[str, dict]:
    """Time the built variants in turns (µs per step, median and range over rounds;
    see ``interleaved_samples_ms``), then run their checks. Errors are recorded as
    ``{"error": ...}``, never raised. The variants stay built, for the profiler."""
    results: dict[str, dict] = dict(errors)
    try:
        print(f"program_replay: {case.name}: timing {len(built)} variants", file=sys.stderr)
        samples = interleaved_samples_ms(
            {n: b.step for n, b in built.items()},
            iters=iters,
            warmup=WARMUP,
            repeats=repeats,
            shuffle_seed=SHUFFLE_SEED,
        )
        for name, b in built.items():
            rounds = summarize([ms * 1e3 for ms in samples[name]], digits=3)
            results[name] = {
                "us": rounds["median"],
                "us_range": [rounds["min"], rounds["max"]],
                "setup_s": round(b.setup_s, 4),
                **b.extra,
            }
            if b.check is not None:
                try:
                    results[name]["check"] = b.check()
                except Exception as exc:
                    results[name]["check"] = {"ok": False, **describe_error(exc)}
    except Exception as exc:
        for name in built:
            results.setdefault(name, describe_error(exc))
    return {name: results[name] for name in VARIANTS if name in results}


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 4)


FLOOR = "raw_plus_copy_below_autograd"  # a replay that stages its input, like ours
ROTATING = f"{OURS}_rotating"
ROTATING_FLOOR = f"{FLOOR}_rotating"


def per_call_targets(case_name: str, us: dict[str, float]) -> tuple[dict, dict]:
    """The targets of a per-call case, and the figures they rest on.

    ``one_input``: with a new source tensor every call (``*_rotating``, what a caller
    does), our host work beyond a hand-written copy-and-replay fed the same sources
    is at most ``ONE_INPUT_TARGET_LAUNCHES`` bare replays (``raw``) of the same run.
    ``tree_64``: ours at most ``TREE_TARGET_RATIO`` times the like-for-like floor (one
    fused copy below autograd, then the replay); the ratio to ``raw_plus_copy``
    (whose copy runs through autograd) is reported beside it, not targeted.
    """
    raw = us.get("raw")
    if case_name == "one_input":
        extra = _diff(us.get(ROTATING), us.get(ROTATING_FLOOR))
        launches = None if extra is None or not raw else round(extra / raw, 3)
        name = f"{ROTATING}_minus_{ROTATING_FLOOR}_le_{ONE_INPUT_TARGET_LAUNCHES:g}x_raw"
        ok = None if launches is None else launches <= ONE_INPUT_TARGET_LAUNCHES
        figures = {
            "rotating_minus_floor_us": extra,
            "rotating_minus_floor_in_raw_launches": launches,
            "same_source_minus_floor_us": _diff(us.get(OURS), us.get(FLOOR)),
            "raw_us": raw,
        }
        return {name: ok}, figures
    ours, floor = us.get(OURS), us.get(FLOOR)
    ratio = _ratio(ours, floor)
    name = f"{OURS}_le_{TREE_TARGET_RATIO:g}x_{FLOOR}"
    figures = {
        f"{OURS}/{FLOOR}": ratio,
        f"{OURS}/raw_plus_copy": _ratio(ours, us.get("raw_plus_copy")),
        "minus_floor_us": _diff(ours, floor),
    }
    return {name: None if ratio is None else ratio <= TREE_TARGET_RATIO}, figures


def run_per_call_case(
    case: Case, built: dict[str, Built], errors: dict[str, dict], iters: int, repeats: int
) -> dict:
    results = measure_all(case, built, errors, iters, repeats)
    us = {n: r["us"] for n, r in results.items() if "us" in r}
    raw, floor = us.get("raw"), us.get(FLOOR)
    targets, figures = per_call_targets(case.name, us)
    return {
        "settings": {**case.describe, "iters": iters, "repeats": repeats, "warmup": WARMUP},
        "us": us,
        "variants": results,
        "minus_raw_us": {n: _diff(v, raw) for n, v in us.items() if n != "raw"},
        f"minus_{FLOOR}_us": {n: _diff(v, floor) for n, v in us.items() if n != FLOOR},
        "ratio_to_raw_plus_copy": {
            n: _ratio(v, us.get("raw_plus_copy")) for n, v in us.items() if n != "raw_plus_copy"
        },
        f"ratio_to_{FLOOR}": {n: _ratio(v, floor) for n, v in us.items() if n != FLOOR},
        "figures": figures,
        "targets": targets,
    }


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
    programs, setup_s = timed_setup(
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
    """All windows timed in turns (one window each per round, shuffled), then the
    checked ones compared with eager."""
    print("program_replay: prefetch: timing windows", file=sys.stderr, flush=True)
    results: dict[str, dict] = {}
    try:
        samples = interleaved_samples_ms(
            {name: (lambda w=window: w(rig)) for name, window in PREFETCH_WINDOWS.items()},
            iters=1,
            warmup=WINDOW_WARMUP,
            repeats=repeats,
            shuffle_seed=SHUFFLE_SEED,
        )
    except Exception as exc:
        return {name: describe_error(exc) for name in PREFETCH_WINDOWS}
    for name, times in samples.items():
        rounds = summarize([t / rig.steps for t in times])
        results[name] = {"ms": rounds["median"], "ms_range": [rounds["min"], rounds["max"]]}
        if name in CHECKED_WINDOWS:
            try:
                results[name]["check"] = check_window(rig, name)
            except Exception as exc:
                results[name]["check"] = {"ok": False, **describe_error(exc)}
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


def add_kernel_busy(report: dict, built: dict[str, dict[str, Built]]) -> None:
    """Kernel-busy time per step of every built variant of the per-call cases (µs;
    ``ratio_to_kernel_busy`` uses the raw replay's, the floor of every variant, and
    ``kernel_busy_us`` of a variant is its own), and of a raw replay of ``prefetch``
    (ms). Runs last: see the module docstring."""
    for case_name, variants in built.items():
        res = report["cases"][case_name]
        for name, b in variants.items():
            print(f"program_replay: {case_name}: kernel_busy {name}", file=sys.stderr, flush=True)
            try:
                res["variants"][name]["kernel_busy_us"] = round(kernel_busy_ms(b.step) * 1e3, 3)
            except Exception as exc:
                res["variants"][name]["kernel_busy_error"] = describe_error(exc)["error"]
        floor = res["variants"].get("raw", {}).get("kernel_busy_us")
        if floor:
            res["us"]["kernel_busy"] = floor
            res["ratio_to_kernel_busy"] = {
                n: _ratio(v, floor) for n, v in res["us"].items() if n != "kernel_busy"
            }
    if "prefetch" in report["cases"]:
        res = report["cases"]["prefetch"]
        print("program_replay: prefetch: kernel_busy", file=sys.stderr, flush=True)
        raw = None
        try:
            raw = _build_raw(CASES["prefetch"], None)
            res.setdefault("ms_per_step", {})["kernel_busy"] = kernel_busy_ms(raw.step)
        except Exception as exc:
            res.setdefault("variants", {})["kernel_busy"] = describe_error(exc)
        finally:
            if raw is not None:
                raw.release()
            del raw
            free_memory()


def release_all(built: dict[str, dict[str, Built]]) -> None:
    for variants in built.values():
        for b in variants.values():
            try:
                b.release()
            except Exception as exc:
                describe_error(exc)
    built.clear()
    free_memory()


# ---- report and CLI ----------------------------------------------------------------


def failures(report: dict) -> list[str]:
    failed = []
    for case, res in report["cases"].items():
        for name, r in res.get("variants", {}).items():
            if "error" in r and name not in NOT_FATAL:
                failed.append(f"{case}/{name}")
            if not r.get("check", {}).get("ok", True):
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
        "step_range": "us_range: min and max over the rounds of the per-round means",
        "kernel_busy": "cudagraphs.timing.kernel_busy_ms defaults (iters=20, warmup=5) "
        "of every variant (its own kernel_busy_us), after all wall-clock timings; "
        "ratio_to_kernel_busy uses the raw replay's",
        "gc": "collected, frozen and disabled inside the timed rounds",
        "grad_mode": torch.is_grad_enabled(),
    }
    report["cases"] = {}
    built: dict[str, dict[str, Built]] = {}
    try:
        for name in args.cases:
            case = CASES[name]
            if name == "prefetch":
                report["cases"][name] = run_prefetch_case(case, args.repeats)
                continue
            built[name], errors = build_all(case, variants)
            report["cases"][name] = run_per_call_case(
                case, built[name], errors, args.iters, args.repeats
            )
        # Written once before profiling too, so a crash in the profiler loses no timings.
        write_report("program_replay", report, args.out, final=False)
        add_kernel_busy(report, built)
    finally:
        release_all(built)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report("program_replay", report, args.out, final=True)
    failed = failures(report)
    if failed:
        print(f"program_replay: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
