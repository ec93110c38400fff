"""What every benchmark report records about its run, and where it is written."""

from __future__ import annotations

import argparse
import gc
import json
import re
import subprocess
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

import cudagraphs

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def environment(benchmark: str, commit: str | None = None) -> dict:
    """The run's identity: benchmark, commit (``commit`` overrides git, for checkouts
    without ``.git`` such as the GPU machine's), device and versions, UTC time."""
    porcelain = None if commit else _git("status", "--porcelain")
    return {
        "benchmark": benchmark,
        "commit": commit or _git("rev-parse", "HEAD") or "unknown",
        "dirty": False if commit else (None if porcelain is None else bool(porcelain)),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudagraphs": cudagraphs.__version__,
        "python": sys.version.split()[0],
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def result_path(out: str, report: dict) -> Path:
    """``out`` itself, or inside a directory (existing, or ``out`` ends with ``/``) the
    standard name ``<benchmark>-<device>-<commit12>[-dirty].json``."""
    path = Path(out)
    if not (out.endswith("/") or path.is_dir()):
        return path
    device = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    commit = report["commit"][:12] + ("-dirty" if report["dirty"] else "")
    return path / f"{report['benchmark']}-{device}-{commit}.json"


def free_memory() -> None:
    """Drop what the last variant left behind before the next one is built."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


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
    """The options every benchmark takes: --out, --require-gpu, --commit."""
    parser.add_argument("--out", help="also write the JSON here (a directory: standard name)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 without a CUDA device")
    parser.add_argument("--commit", help="commit to record (where the checkout has no .git)")


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
