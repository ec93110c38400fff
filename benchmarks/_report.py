"""What every benchmark report records about its run, and where it is written.

Every benchmark imports this module before ``cudagraphs`` (it sorts first among the
first-party imports): it puts this checkout's ``src`` first on ``sys.path``, so a
script measures the sources beside it, also without ``PYTHONPATH=src``."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))  # this checkout's sources, as the scripts do

import torch  # noqa: E402

import cudagraphs  # noqa: E402

# The files whose content decides what a benchmark measures.
SOURCE_GLOBS = ("src/cudagraphs/**/*.py", "benchmarks/*.py")


def _git(*args: str, root: Path = REPO) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


def source_sha256(root: Path = REPO) -> str:
    """A hash of the measured sources as they are on disk (paths and contents of
    :data:`SOURCE_GLOBS`), computable without git, so a run on a machine that has no
    ``.git`` still says exactly what it ran."""
    files = {}
    for pattern in SOURCE_GLOBS:
        for path in root.glob(pattern):
            if path.is_file() and "__pycache__" not in path.parts:
                files[path.relative_to(root).as_posix()] = path.read_bytes()
    return _digest(files)


def commit_source_sha256(commit: str, root: Path = REPO) -> str | None:
    """:func:`source_sha256` of ``commit``'s tree, read from git (``None`` without git
    or without that commit)."""
    listing = _git(
        "ls-tree", "-r", "--name-only", commit, "--", "src/cudagraphs", "benchmarks", root=root
    )
    if listing is None:
        return None
    files = {}
    for path in listing.splitlines():
        inside_src = path.startswith("src/cudagraphs/") and path.endswith(".py")
        inside_bench = path.startswith("benchmarks/") and path.count("/") == 1
        if (inside_src or inside_bench) and path.endswith(".py"):
            done = subprocess.run(
                ["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, check=True
            )
            files[path] = done.stdout
    return _digest(files)


def environment(benchmark: str, commit: str | None = None, run_label: str | None = None) -> dict:
    """The run's identity: benchmark, device and versions, UTC time, and the tree.

    The tree is recorded as it is, never as it is hoped to be: with git, the commit
    and whether the tree differs from it (and then a hash of ``git diff HEAD``);
    with ``commit`` (``--commit``, for a checkout whose ``.git`` is missing or stale,
    as on the GPU machine) that commit and ``dirty: None`` (unknown) unless git's
    HEAD is that commit. Either way ``source_sha256`` hashes the measured sources on
    disk, and ``python benchmarks/_report.py verify FILE`` checks it against the
    recorded commit.
    """
    head = (_git("rev-parse", "HEAD") or "").strip() or None
    if commit:
        # Given by the caller: the machine's checkout may carry a stale .git (the GPU
        # machine's copy does), so git's view counts only when it names that commit.
        trusted_git = head is not None and head.startswith(commit)
        record = {"benchmark": benchmark, "commit": head if trusted_git else commit}
        record["commit_from"] = "git" if trusted_git else "--commit"
        if head and not trusted_git:
            record["git_head_ignored"] = head
    else:
        trusted_git = head is not None
        record = {"benchmark": benchmark, "commit": head or "unknown"}
        record["commit_from"] = "git" if head else "unknown"
    porcelain = _git("status", "--porcelain", "--untracked-files=no") if trusted_git else None
    record["dirty"] = None if porcelain is None else bool(porcelain.strip())
    record["source_sha256"] = source_sha256()
    if record["dirty"]:
        diff = _git("diff", "HEAD") or ""
        record["diff_sha256"] = hashlib.sha256(diff.encode()).hexdigest()
    if run_label:
        record["run_label"] = run_label
    record.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudagraphs=cudagraphs.__version__,
        python=sys.version.split()[0],
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # The package's switches in force (CUDAGRAPHS_OWNED_GRADS=defer, say): they
        # change what a layer does, so a run under one must say so.
        cudagraphs_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("CUDAGRAPHS_")},
    )
    return record


def verify(path: Path) -> str | None:
    """``None`` when the report's ``source_sha256`` equals that of its commit's
    tree; else what does not hold."""
    report = json.loads(path.read_text())
    recorded = report.get("source_sha256")
    if recorded is None:
        return "no source_sha256 recorded"
    if report.get("dirty"):
        return f"recorded from a dirty tree (diff_sha256 {report.get('diff_sha256')})"
    expected = commit_source_sha256(report["commit"])
    if expected is None:
        return f"commit {report['commit']} is not in this repository"
    if expected != recorded:
        return f"sources differ from commit {report['commit'][:12]}"
    return None


def result_path(out: str, report: dict) -> Path:
    """``out`` itself, or inside a directory (existing, or ``out`` ends with ``/``) the
    standard name ``<benchmark>-<device>-<commit12>[-dirty-<diff8>].json``."""
    path = Path(out)
    if not (out.endswith("/") or path.is_dir()):
        return path
    device = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    commit = report["commit"][:12]
    if report.get("dirty"):
        commit += f"-dirty-{report.get('diff_sha256', 'unknown')[:8]}"
    name = f"{report['benchmark']}-{device}-{commit}"
    run = report.get("run_label")
    return path / (f"{name}-{run}.json" if run else f"{name}.json")


def free_memory() -> None:
    """Drop what the last variant left behind before the next one is built."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def timed_setup(build: Callable[[], object]) -> tuple[object, float]:
    """``(build(), seconds)``: a variant's setup time, with the device idle at both ends
    so that queued work is neither counted nor left out."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    made = build()
    torch.cuda.synchronize()
    return made, time.perf_counter() - t0


def describe_error(exc: BaseException) -> dict:
    """An error as the reports record it; the traceback also goes to stderr."""
    tb = traceback.format_exc()
    print(tb, file=sys.stderr)
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-4000:]}


def write_report(name: str, report: dict, out: str | None, *, final: bool) -> None:
    """Print ``report`` as JSON when ``final``; with ``out`` also write it there (a
    directory gets the standard file name). Called before the profiler runs too, so a
    crash in it still leaves the wall-clock numbers on disk."""
    text = json.dumps(report, indent=2)
    if final:
        print(text)
    if out:
        path = result_path(out, report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"{name}: wrote {path}", file=sys.stderr)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark takes: --out, --require-gpu, --commit, --run-label."""
    parser.add_argument("--out", help="also write the JSON here (a directory: standard name)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 without a CUDA device")
    parser.add_argument(
        "--commit", help="commit to record where the checkout has no .git (verify it later)"
    )
    parser.add_argument(
        "--run-label",
        help="suffix of the standard file name, for repeated runs of one commit (run1, ...)",
    )


def add_round_arguments(parser: argparse.ArgumentParser) -> None:
    """--iters and --repeats (a benchmark's per-config defaults where not given) and
    --skip-kernel-busy, for the benchmarks that time steps in interleaved rounds."""
    parser.add_argument("--iters", type=int, help="steps per sample (default: per config)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default: per config)")
    parser.add_argument("--skip-kernel-busy", action="store_true")


def step_time_method(shuffle_seed: int) -> str:
    """The ``settings["step_time"]`` line of a benchmark timed in interleaved rounds."""
    return (
        "interleaved_samples_ms: per round each variant once, in a shuffled order (seed "
        f"{shuffle_seed}); a sample is the mean wall time of iters steps; GC off and "
        "frozen in rounds; summarize: median, min, max over rounds; ratios of medians"
    )


def kernel_busy_method(iters: int, warmup: int) -> str:
    """The ``settings["kernel_busy"]`` line of a benchmark that profiles each variant."""
    return (
        f"each variant's own: kernel_activity(iters={iters}, warmup={warmup}) on a fresh "
        "build, after every wall-clock timing of the run: kernel-busy ms and launches "
        "per step"
    )


def exit_code_without_gpu(name: str, require_gpu: bool) -> int | None:
    """``None`` when a CUDA device is present; else say so on stderr and return the
    exit code (2 with ``--require-gpu``, else 0)."""
    if torch.cuda.is_available():
        return None
    print(
        f"{name}: no CUDA device (torch.cuda.is_available() is False); nothing measured.",
        file=sys.stderr,
    )
    return 2 if require_gpu else 0


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/_report.py verify FILE...``: check that each report's
    sources are those of its recorded commit."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    bad = 0
    for path in args.files:
        problem = verify(path)
        print(f"{path}: {'ok' if problem is None else problem}")
        bad += problem is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
