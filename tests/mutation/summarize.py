"""Summarize a mutmut run of the policy modules: per module, mutants, killed,
survived and equivalent, and the score over the non-equivalent ones.

Run from the repository root after ``OMP_NUM_THREADS=1 mutmut run`` (see
docs/development.md#mutation-testing; with torch's OpenMP pool running, mutmut's
forked workers can hang, and a hang is reported as a "timeout", which counts as
killed)::

    python tests/mutation/summarize.py            # print the table
    python tests/mutation/summarize.py --write    # also write docs/mutation-testing.json
                                                  # (then: python benchmarks/results_md.py)
    python tests/mutation/summarize.py --survivors MODULE   # diffs of what survived

Equivalent mutants are of two kinds:

* message prose: the mutant changes only the text of string constants inside a
  ``raise`` or a logging call (mutmut's "XX" wrapping, upper/lower casing). Tests pin
  what a message must carry (the argument, path, values and the fix's key words),
  not its wording. Found automatically by comparing the mutant's syntax tree with the
  original's; any other difference (a substituted expression in an f-string, a name,
  a number, a string used as data) is not prose.
* listed: a ``tests/mutation/equivalent*.toml`` file names the mutant under
  ``[mutants]`` with the reason no test can tell it from the original (the same
  behaviour for every input).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import tomllib  # Python 3.11+: this is a development tool, not package code

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "mutants"
EQUIVALENT_FILES = "equivalent*.toml"  # beside this file, one per group of modules
OUT_JSON = ROOT / "docs" / "mutation-testing.json"
TARGET = 0.90
_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "_warn", "warn_once", "_warn_once"}


def results() -> dict[str, str]:
    """mutant name -> status, as ``mutmut results --all true`` reports it."""
    out = subprocess.run(
        ["mutmut", "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    found = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name.startswith("cudagraphs."):
            found[name] = status
    return found


def module_of(name: str) -> str:
    """``cudagraphs.core.hooks.x_f__mutmut_3`` -> ``cudagraphs.core.hooks``."""
    parts = name.split(".")
    return ".".join(p for p in parts if not p.startswith("x"))


def _functions(module: str) -> dict[str, ast.FunctionDef]:
    path = MUTANTS / "src" / Path(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _differences(a: ast.AST, b: ast.AST, chain: tuple, out: list) -> None:
    if type(a) is not type(b):
        out.append((a, b, chain))
        return
    for field, va in ast.iter_fields(a):
        vb = getattr(b, field, None)
        if isinstance(va, ast.AST):
            _differences(va, vb, (*chain, a), out)
        elif isinstance(va, list):
            if not isinstance(vb, list) or len(va) != len(vb):
                out.append((a, b, chain))
                return
            for x, y in zip(va, vb):
                if isinstance(x, ast.AST):
                    _differences(x, y, (*chain, a), out)
                elif x != y:
                    out.append((a, b, chain))
        elif va != vb and field not in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
            out.append((a, b, chain))


def _in_message(chain: tuple) -> bool:
    for node in chain:
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _LOG_CALLS:
                return True
    return False


def is_prose(name: str, functions: dict[str, ast.FunctionDef]) -> bool:
    """Whether the mutant only rewords string constants of a message (module docs)."""
    short = name.rsplit(".", 1)[1]
    base = short.rsplit("__mutmut_", 1)[0]
    orig, mutant = functions.get(f"{base}__mutmut_orig"), functions.get(short)
    if orig is None or mutant is None:
        return False
    diffs: list = []
    for x, y in zip(orig.body, mutant.body):
        _differences(x, y, (), diffs)
    if len(orig.body) != len(mutant.body) or not diffs:
        return False
    return all(
        isinstance(a, ast.Constant)
        and isinstance(b, ast.Constant)
        and isinstance(a.value, str)
        and isinstance(b.value, str)
        and _in_message(chain)
        for a, b, chain in diffs
    )


def summarize() -> dict:
    statuses = results()
    listed = {}
    for path in sorted(Path(__file__).parent.glob(EQUIVALENT_FILES)):
        listed.update(tomllib.loads(path.read_text()).get("mutants", {}))
    by_module: dict[str, dict] = defaultdict(
        lambda: {
            "mutants": 0,
            "killed": 0,
            "survived": 0,
            "equivalent_prose": 0,
            "equivalent_listed": 0,
            "survivors": [],
        }
    )
    functions: dict[str, dict] = {}
    for name, status in sorted(statuses.items()):
        module = module_of(name)
        row = by_module[module]
        row["mutants"] += 1
        if status in ("killed", "caught by type check", "timeout", "segfault"):
            row["killed"] += 1
            continue
        if name in listed:
            row["equivalent_listed"] += 1
            continue
        if module not in functions:
            functions[module] = _functions(module)
        if is_prose(name, functions[module]):
            row["equivalent_prose"] += 1
            continue
        row["survived"] += 1
        row["survivors"].append(f"{name} ({status})")
    stale = sorted(set(listed) - set(statuses))
    if stale:
        # A listed mutant that no longer exists: its function changed, so its number
        # now names another mutation. Review the list.
        print(f"listed as equivalent but not in this run: {stale}", file=sys.stderr)
    for row in by_module.values():
        scored = row["mutants"] - row["equivalent_prose"] - row["equivalent_listed"]
        row["score"] = round(row["killed"] / scored, 4) if scored else 1.0
        row["meets_target"] = row["score"] >= TARGET
    return dict(sorted(by_module.items()))


def table(summary: dict) -> str:
    lines = [
        "| module | mutants | killed | survived | equivalent (prose / listed) | killed of non-equivalent |",
        "|---|---|---|---|---|---|",
    ]
    for module, r in summary.items():
        lines.append(
            f"| `{module}` | {r['mutants']} | {r['killed']} | {r['survived']} | "
            f"{r['equivalent_prose']} / {r['equivalent_listed']} | {100 * r['score']:.1f}% |"
        )
    return "\n".join(lines)


def _provenance() -> dict:
    """What the run measured: the commit, whether src/ or tests/ differ from it (the
    mutants and the tests that ran), and the tool."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout

    version = subprocess.run(["mutmut", "--version"], capture_output=True, text=True).stdout
    return {
        "target": TARGET,
        "commit": git("rev-parse", "HEAD").strip(),
        "src_or_tests_dirty": bool(git("status", "--porcelain", "--", "src", "tests").strip()),
        "tool": version.strip(),
        "command": "OMP_NUM_THREADS=1 mutmut run && python tests/mutation/summarize.py --write",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"write {OUT_JSON.relative_to(ROOT)}")
    p.add_argument(
        "--survivors", metavar="MODULE", help="print the diff of each survivor of MODULE"
    )
    args = p.parse_args(argv)
    summary = summarize()
    if args.survivors:
        for entry in summary.get(args.survivors, {}).get("survivors", []):
            name = entry.split(" ", 1)[0]
            print(
                subprocess.run(
                    ["mutmut", "show", name], cwd=ROOT, capture_output=True, text=True
                ).stdout
            )
        return 0
    print(table(summary))
    for r in summary.values():
        for entry in r["survivors"]:
            print(f"survived: {entry}")
    if args.write:
        OUT_JSON.write_text(json.dumps({**_provenance(), "modules": summary}, indent=2) + "\n")
    return 0 if all(r["meets_target"] for r in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
