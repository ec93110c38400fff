"""Write ``benchmarks/RESULTS.md`` from the committed result files.

    python benchmarks/results_md.py            # rewrite benchmarks/RESULTS.md
    python benchmarks/results_md.py --check    # exit 1 when it is stale

Sources, all committed JSON: every ``benchmarks/results/*.json`` and ``*.jsonl`` (the
benchmarks' reports and the probes' records), ``tests/distributed/results/*.json``
(the multi-GPU checks) and ``docs/mutation-testing.json`` (the last mutation-testing
summary). Per report: the device, the commit it measured, the versions, the headline
figures named in :data:`HEADLINES` and every ``targets`` value as recorded. Reports are
grouped by benchmark, newest first (by their ``timestamp``).

The output depends on the files alone: sorted, and nothing about the time or machine
of generation, so ``tests/test_results_md_cpu.py`` can regenerate it in memory and
compare. Pure Python and json: it imports neither torch nor cudagraphs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "RESULTS.md"
COMMAND = "python benchmarks/results_md.py"

#: Pattern keys: ``ROW`` and ``COL`` take every key of the dict at that depth; the
#: keys they took name the table's row and column. Any other string is one key.
ROW = "<row>"
COL = "<col>"


@dataclass(frozen=True)
class Grid:
    """One headline table: the values at ``pattern`` in a report, rows x columns.

    Args:
        title: the table's caption.
        pattern: keys from the report's top, with :data:`ROW` / :data:`COL` where a
            dict's keys become rows / columns. Without ``COL`` there is one column,
            without ``ROW`` one row (named after the last key).
        rows: keep only these row names, in this order (``None``: every row, in the
            report's order).
    """

    title: str
    pattern: tuple[str, ...]
    rows: tuple[str, ...] | None = None


_TRAIN_RATIOS = (
    "cudagraphs/torch_make_graphed_callables",
    "cudagraphs_lent/torch_make_graphed_callables",
    "cudagraphs_no_clone/torch_make_graphed_callables",
    "cudagraphs_stack_in_graph/kernel_busy_eager",
    "cudagraphs_stack_in_graph/raw_cuda_graph",
    "cudagraphs_train_step/eager",
    "cudagraphs_train_step/raw_cuda_graph",
    "cudagraphs_train_step/raw_cuda_graph_same_optimizer",
    "cudagraphs_train_step/kernel_busy_own",
    "cudagraphs_train_step_compiled/eager",
    "cudagraphs_train_step_compiled/kernel_busy_eager",
    "cudagraphs_train_step_compiled/kernel_busy_own",
    "torch_compile_reduce_overhead_compiled_optimizer/eager",
    "torch_compile_max_autotune_no_cudagraphs_compiled_optimizer/eager",
)
_SERVING_HF_TIMES = ("capture_s", "compiled_capture_s")
_STARTUP = ("startup_s", "capture_s", "first_token_s")

#: The headline tables of each benchmark (``benchmark`` field, or a probe's name).
HEADLINES: dict[str, tuple[Grid, ...]] = {
    "train_step": (
        Grid("Step time, ms (median over rounds)", ("configs", COL, "regimes", COL, "ms", ROW)),
        Grid("Ratios", ("configs", COL, "regimes", COL, "ratios", ROW), rows=_TRAIN_RATIOS),
        Grid("Launches per step", ("configs", COL, "regimes", COL, "kernels_per_step", ROW)),
        Grid(
            "Idle µs per launch (`launch_gap_us`)",
            ("configs", COL, "regimes", COL, "launch_gap_us", ROW),
        ),
    ),
    "train_fp8": (
        Grid("Step time, ms (median over rounds)", ("ms", ROW)),
        Grid("Ratios", ("ratios", ROW)),
        Grid("Launches per step", ("kernels_per_step", ROW)),
        Grid("Loss-curve SQNR against bf16, dB", ("loss_sqnr_db", ROW)),
    ),
    "train_step_hf": (
        Grid("Step time, ms (median over rounds)", ("models", COL, "ms", ROW)),
        Grid("Ratios", ("models", COL, "ratios", ROW)),
        Grid("Launches per step", ("models", COL, "kernels_per_step", ROW)),
        Grid("Idle µs per launch (`launch_gap_us`)", ("models", COL, "launch_gap_us", ROW)),
    ),
    "partial_train": (
        Grid("Step time, ms (median over rounds)", ("configs", COL, "models", COL, "ms", ROW)),
        Grid(
            "Ratios",
            ("configs", COL, "models", COL, "ratios", ROW),
            rows=(
                "eager/partial",
                "eager/partial_layers",
                "eager/partial_widest",
                "eager/whole_layer",
                "partial_widest/kernel_busy_own",
            ),
        ),
    ),
    "trainer_callback": (
        Grid(
            "Trainer step, ms (median over runs)",
            ("models", COL, "variants", ROW, "step_ms", "median"),
        ),
        Grid("Ratios", ("models", COL, "ratios", ROW)),
        Grid("Kernel-busy ms per step", ("models", COL, "kernel_busy_ms_per_step", ROW)),
    ),
    "program_replay": (
        Grid("µs per call (median over rounds)", ("cases", COL, "us", ROW)),
        Grid("Figures", ("cases", COL, "figures", ROW)),
        Grid("Prefetch, ms per step", ("cases", "prefetch", "ms_per_step", ROW)),
        Grid(
            "Prefetch",
            ("cases", "prefetch", ROW),
            rows=("overlap", "overlap_one_program", "prefetch/serial", "prefetch/ideal"),
        ),
    ),
    "serving_decode": (
        Grid(
            "Latency mode: runner − raw graph of the same rows, µs",
            ("ratios", COL, ROW, "latency", "runner_minus_raw_us"),
        ),
        Grid(
            "Latency mode: runner / raw graph",
            ("ratios", COL, ROW, "latency", "runner/raw_cuda_graph"),
        ),
        Grid(
            "Latency mode: runner / raw graph at the bucket's rows",
            ("ratios", COL, ROW, "latency", "runner/raw_cuda_graph_at_bucket"),
        ),
        Grid(
            "Capture, s",
            ("configs", COL, ROW, "capture_s"),
            rows=("runner", "runner_largest_alone"),
        ),
        Grid("Pool", ("ratios", ROW), rows=("pool_all_buckets/pool_largest_alone",)),
    ),
    "serving_hf": (
        Grid(
            "ms per token (median)", ("models", COL, "batches", COL, "ms_per_token", ROW, "median")
        ),
        Grid("Prefill alone, ms (median)", ("models", COL, "batches", COL, "prefill_ms", ROW)),
        Grid(
            "Decode steps, ms per token (a request less its prefill)",
            ("models", COL, "batches", COL, "decode_ms_per_token", ROW),
        ),
        Grid(
            "Kernel-busy ms per token", ("models", COL, "batches", COL, "kernel_busy_ms_per_token")
        ),
        Grid(
            "Kernel-busy ms per token, compiled",
            ("models", COL, "batches", COL, "compiled_kernel_busy_ms_per_token"),
        ),
        Grid(
            "Tokens equal HF's static-cache eager `generate`",
            ("models", COL, "batches", COL, "tokens", ROW, "equal_hf_static_eager"),
        ),
        Grid(
            "Requests of ours compiled, by prefill path",
            ("models", COL, "compiled_stats", "prefills", ROW),
        ),
        Grid("First call, s", ("models", COL, "batches", COL, "first_call_s", ROW)),
        Grid("Capture, s", ("models", COL, ROW), rows=_SERVING_HF_TIMES),
        Grid("Startup in a fresh process, s (median)", ("startup", COL, ROW), rows=_STARTUP),
        Grid(
            "Compiled startup in a fresh process, s", ("compiled_startup", COL, ROW), rows=_STARTUP
        ),
    ),
    "memory": (
        Grid("Peak reserved memory / eager's", ("ratios", COL, ROW, "reserved")),
        Grid("Largest batch that fits", ("largest_batch", ROW, COL, "largest_batch")),
    ),
    "upstream": (
        Grid("NeMo Automodel partial step, ms (median)", ("nemo", "ms", ROW)),
        Grid("NeMo Automodel partial step, ratios", ("nemo", "ratios", ROW)),
        Grid("torch's suite: outcome per test", ("torch_suite", "outcomes", COL, ROW)),
        Grid(
            "torch's suite: runs",
            ("torch_suite", "runs", COL, ROW),
            rows=("exit_code", "seconds"),
        ),
        Grid(
            "Megatron-Core's TE graph helper on ours",
            ("megatron", ROW),
            rows=("equal_to_eager", "max_abs_diff", "num_differing", "replays", "expected_replays"),
        ),
    ),
    "compile_phases": (
        Grid("Cold compiled capture, s", ("runs", COL, ROW), rows=("capture_s",)),
        Grid(
            "Compile phases, s",
            ("runs", COL, "compile_phases_s", ROW),
            rows=(
                "_compile.compile_inner",
                "bytecode_tracing",
                "create_aot_dispatcher_function",
                "aot_collect_metadata",
                "compile_fx.<locals>.fw_compiler_base",
                "async_compile.precompile",
            ),
        ),
        Grid("Region schema memo", ("runs", COL, "subgraph_schemas", ROW)),
    ),
    "moe_fp32_facts": (
        Grid("Grouped GEMM stays on the device", ("probe", ROW)),
        Grid("Batched against grouped experts", ("batched_vs_grouped", ROW)),
        Grid(
            "Capture of a float32 `grouped_mm` MoE block", ("capture_fails", ROW), rows=("failed",)
        ),
    ),
}

#: Section order; benchmarks not listed here follow in name order.
ORDER = (
    "train_step",
    "train_step_hf",
    "train_fp8",
    "partial_train",
    "trainer_callback",
    "program_replay",
    "serving_decode",
    "serving_hf",
    "memory",
    "upstream",
)
SCRIPTS = {
    **{name: f"{name}.py" for name in ORDER},
    "fp32_bitwise": "probes/fp32_bitwise.py",
    "moe_fp32_facts": "probes/moe_fp32_facts.py",
    "fp8_rowwise_curves": "probes/fp8_rowwise_curves.py",
    "serving_compiles": "probes/serving_compiles.py",
    "fp8_loss_regime": "probes/fp8_loss_regime.py",
    "compile_phases": "probes/compile_phases.py",
}


@dataclass(frozen=True)
class Report:
    """One result file: its path from the repository root and its content."""

    path: str
    data: Any

    @property
    def name(self) -> str:
        return Path(self.path).name


# ---- reading -------------------------------------------------------------------------
def read_reports(root: Path = REPO) -> list[Report]:
    """Every benchmark report and probe record under ``benchmarks/results``."""
    found = []
    for path in sorted((root / "benchmarks" / "results").glob("*.json*")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if path.suffix == ".jsonl":
            found.append(
                Report(rel, [json.loads(line) for line in text.splitlines() if line.strip()])
            )
        elif path.suffix == ".json":
            found.append(Report(rel, json.loads(text)))
    return found


def read_json_dir(root: Path, folder: str) -> list[Report]:
    return [
        Report(p.relative_to(root).as_posix(), json.loads(p.read_text()))
        for p in sorted((root / folder).glob("*.json"))
    ]


# ---- values --------------------------------------------------------------------------
def fmt(value: Any) -> str:
    """A cell: numbers to at most four decimals, booleans and ``None`` spelled out."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0 or abs(value) >= 0.001:
            text = f"{value:.4f}".rstrip("0").rstrip(".")
            return "0" if text in ("-0", "") else text
        return f"{value:.3g}"
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= 80 else text[:77] + "..."


def verdict(value: Any) -> str:
    """A target as recorded: ``true`` met, ``false`` not met, ``null`` not measured."""
    if value is True:
        return "met"
    if value is False:
        return "**not met**"
    if value is None:
        return "not measured (`null`)"
    return f"`{fmt(value)}`"


def _matches(node: Any, pattern: tuple[str, ...], row: tuple, col: tuple) -> Iterator[tuple]:
    if not pattern:
        yield row, col, node
        return
    if not isinstance(node, dict):
        return
    head, rest = pattern[0], pattern[1:]
    if head in (ROW, COL):
        for key, value in node.items():
            new_row = row + (key,) if head == ROW else row
            new_col = col + (key,) if head == COL else col
            yield from _matches(value, rest, new_row, new_col)
    elif head in node:
        yield from _matches(node[head], rest, row, col)


def grid_cells(data: Any, grid: Grid) -> tuple[list[str], list[str], dict[tuple[str, str], Any]]:
    """``(rows, columns, cells)`` of ``grid`` in ``data``; scalar leaves only."""
    rows: list[str] = []
    cols: list[str] = []
    cells: dict[tuple[str, str], Any] = {}
    fallback_row = next((k for k in reversed(grid.pattern) if k not in (ROW, COL)), "value")
    for row, col, value in _matches(data, grid.pattern, (), ()):
        if isinstance(value, (dict, list)):
            continue
        r = " / ".join(map(str, row)) or fallback_row
        c = " / ".join(map(str, col)) or "value"
        if grid.rows is not None and r not in grid.rows:
            continue
        if r not in rows:
            rows.append(r)
        if c not in cols:
            cols.append(c)
        cells[r, c] = value
    if grid.rows is not None:
        rows = [r for r in grid.rows if r in rows]
    # A row with no value in any column (a ratio the run could not form) says nothing.
    rows = [r for r in rows if any(cells.get((r, c)) is not None for c in cols)]
    return rows, cols, cells


def table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def render_grid(data: Any, grid: Grid) -> list[str]:
    rows, cols, cells = grid_cells(data, grid)
    if not rows:
        return []
    body = [[f"`{r}`"] + [fmt(cells.get((r, c))) for c in cols] for r in rows]
    return [f"*{grid.title}*", "", *table(["", *cols], body), ""]


def targets_of(data: Any) -> list[tuple[str, Any]]:
    """Every target value: the report's top-level ``targets``, or where it has none,
    each nested ``targets`` dict, named by its path."""
    if not isinstance(data, dict):
        return []
    top = data.get("targets")
    if isinstance(top, dict) and top:
        return list(top.items())
    found: list[tuple[str, Any]] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if key == "targets" and isinstance(value, dict):
                # "cases:one_input:name" reads as "one_input:name": the first key of a
                # report's grouping ("cases", "configs", "models") names nothing.
                shown = path[1:] if len(path) > 1 else path
                found.extend((":".join((*shown, name)), v) for name, v in value.items())
            elif key != "settings":
                walk(value, (*path, key))

    walk(data, ())
    return found


# ---- one report ----------------------------------------------------------------------
def _link(report: Report) -> str:
    # RESULTS.md sits in benchmarks/: links are relative to it.
    target = Path(report.path)
    rel = (
        target.relative_to("benchmarks") if target.parts[0] == "benchmarks" else Path("..", target)
    )
    return f"[{report.name}]({rel.as_posix()})"


def _tree(data: dict) -> str:
    dirty = data.get("dirty")
    if dirty is None:
        return "tree state unknown (commit given with `--commit`)"
    return "dirty tree" if dirty else "clean tree"


def _commit_in_name(name: str) -> str | None:
    # Probe records carry no commit field; their file name ends in it (see _report.py).
    last = name.split(".")[0].split("-")[-1]
    return last if len(last) >= 7 and all(ch in "0123456789abcdef" for ch in last) else None


def identity(data: dict, name: str = "") -> str:
    """Device, commit, versions and date of a report, one line."""
    parts = [data.get("device") or data.get("gpu") or "device not recorded"]
    commit = data.get("commit")
    from_name = _commit_in_name(name)
    if commit:
        parts.append(f"commit `{commit[:12]}`")
    elif from_name:
        parts.append(f"commit `{from_name}` (from the file name)")
    else:
        parts.append("commit not recorded")
    if "dirty" in data:
        parts.append(_tree(data))
    for key in ("torch", "transformers"):
        if data.get(key):
            parts.append(f"{key} {data[key]}")
    if data.get("run_label"):
        parts.append(f"label `{data['run_label']}`")
    if data.get("timestamp"):
        parts.append(str(data["timestamp"])[:10])
    return " · ".join(parts)


def render_targets(data: Any) -> list[str]:
    found = targets_of(data)
    if not found:
        return ["No `targets` recorded.", ""]
    body = [[f"`{name}`", verdict(value)] for name, value in found]
    return ["*Targets*", "", *table(["target", "recorded"], body), ""]


def render_report(report: Report, benchmark: str) -> list[str]:
    data = report.data
    lines = [f"### {_link(report)}", ""]
    if isinstance(data, list):  # a probe's .jsonl: a header record, then one per case
        head = data[0] if data and "case" not in data[0] else {}
        cases = [r for r in data if isinstance(r, dict) and "case" in r]
        lines += [identity(head, report.name), ""]
        body = [
            [
                f"`{r['case']}`",
                fmt(r.get("bitwise")),
                fmt(r.get("param_diff")),
                fmt(r.get("loss_diff")),
            ]
            for r in cases
        ]
        lines += table(["case", "bitwise", "param_diff", "loss_diff"], body) + [""]
        return lines + ["No `targets` recorded.", ""]
    lines += [identity(data, report.name), ""]
    for grid in HEADLINES.get(benchmark, ()):
        lines += render_grid(data, grid)
    return lines + render_targets(data)


def benchmark_of(report: Report) -> str:
    data = report.data
    if isinstance(data, dict) and data.get("benchmark"):
        return str(data["benchmark"])
    # probe-<name>-<device>-<commit>.json[l]
    stem = report.name.split(".")[0]
    return stem.split("-")[1] if stem.startswith("probe-") else stem.split("-")[0]


def _newest_first(reports: list[Report]) -> list[Report]:
    def key(r: Report) -> tuple[str, str]:
        stamp = r.data.get("timestamp", "") if isinstance(r.data, dict) else ""
        return (stamp, r.name)

    by_name = sorted(reports, key=lambda r: r.name)
    return sorted(by_name, key=lambda r: key(r)[0], reverse=True)


# ---- the other sources -----------------------------------------------------------------
def render_multi_gpu(reports: list[Report]) -> list[str]:
    lines = [
        "## Multi-GPU checks",
        "",
        "`tests/distributed/multi_gpu.py` (one process per GPU, NCCL; see "
        "[docs/development.md](../docs/development.md#multi-gpu-checks)). These files "
        "record no time: most ranks first, then by name.",
        "",
    ]
    order = sorted(reports, key=lambda r: (-int(r.data.get("world_size", 0)), r.name))
    for report in order:
        data = report.data
        lines += [f"### {_link(report)}", ""]
        head = f"{data.get('world_size')} GPU(s) · " + identity(data)
        hung = data.get("hung_ranks") or []
        lines += [head + (f" · hung ranks {hung}" if hung else ""), ""]
        body = [[f"`{name}`", verdict(ok)] for name, ok in (data.get("checks") or {}).items()]
        lines += table(["check", "passed on every rank"], body) + [""]
    return lines


def _percent(share: Any) -> str:
    return "–" if share is None else f"{100 * share:.1f}%"


def render_mutation(summary: dict) -> list[str]:
    lines = [
        "## Mutation testing",
        "",
        "From [docs/mutation-testing.json](../docs/mutation-testing.json), written by "
        "`python tests/mutation/summarize.py --write` (how to run it and how mutants are "
        "counted: [docs/development.md](../docs/development.md#mutation-testing)).",
        "",
        f"{summary.get('tool', 'mutmut')} · commit `{str(summary.get('commit', ''))[:12]}` · "
        f"target: {_percent(summary.get('target'))} of the non-equivalent mutants killed per module"
        + (
            " · sources or tests differed from the commit"
            if summary.get("src_or_tests_dirty")
            else ""
        ),
        "",
    ]
    body = []
    for module, row in sorted(summary.get("modules", {}).items()):
        equivalent = f"{row.get('equivalent_prose', 0)} / {row.get('equivalent_listed', 0)}"
        shown = _percent(row.get("score"))
        body.append(
            [
                f"`{module}`",
                str(row.get("mutants")),
                str(row.get("killed")),
                str(row.get("survived")),
                equivalent,
                shown,
                verdict(row.get("meets_target")),
            ]
        )
    header = [
        "module",
        "mutants",
        "killed",
        "survived",
        "equivalent (prose / listed)",
        "score",
        "target",
    ]
    lines += table(header, body) + [""]
    reruns = summary.get("reruns") or []
    if reruns:
        lines += ["*Modules re-run after the full run*", ""]
        body = [
            [
                ", ".join(f"`{m}`" for m in r.get("modules", [])),
                f"`{str(r.get('commit', ''))[:12]}`",
                fmt(r.get("why", "")),
            ]
            for r in reruns
        ]
        lines += table(["modules", "commit", "why"], body) + [""]
    return lines


# ---- the page ------------------------------------------------------------------------
def _files(n: int) -> str:
    return "1 file" if n == 1 else f"{n} files"


def _anchor(title: str) -> str:
    return title.lower().replace(" ", "-").replace("`", "")


def render(root: Path = REPO) -> str:
    """The whole of ``benchmarks/RESULTS.md`` from the files under ``root``."""
    groups: dict[str, list[Report]] = {}
    for report in read_reports(root):
        groups.setdefault(benchmark_of(report), []).append(report)
    names = [n for n in ORDER if n in groups] + sorted(set(groups) - set(ORDER))
    multi_gpu = read_json_dir(root, "tests/distributed/results")
    mutation_path = root / "docs" / "mutation-testing.json"
    mutation = json.loads(mutation_path.read_text()) if mutation_path.exists() else None

    lines = [
        "# Results",
        "",
        f"Generated by `{COMMAND}` from the committed result files; do not edit it by "
        f"hand. After adding or changing a result file, run `{COMMAND}` and commit both "
        "(`tests/test_results_md_cpu.py` fails while this page is stale).",
        "",
        "Per file: the device, the commit it measured, the versions, the headline "
        "figures and every target as the file records it (`true`: met, `false`: not met, "
        "`null`: not measured in that run). Files are grouped by benchmark, newest "
        "first. How each benchmark measures, and what its variants are: "
        "[README.md](README.md) in this folder.",
        "",
    ]
    contents = [f"- [{n}](#{_anchor(n)}) ({_files(len(groups[n]))})" for n in names]
    if multi_gpu:
        contents.append(f"- [Multi-GPU checks](#multi-gpu-checks) ({_files(len(multi_gpu))})")
    if mutation is not None:
        contents.append("- [Mutation testing](#mutation-testing)")
    lines += contents + [""]
    for name in names:
        lines += [f"## {name}", ""]
        if name in SCRIPTS:
            lines += [f"`benchmarks/{SCRIPTS[name]}`.", ""]
        for report in _newest_first(groups[name]):
            lines += render_report(report, name)
    if multi_gpu:
        lines += render_multi_gpu(multi_gpu)
    if mutation is not None:
        lines += render_mutation(mutation)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write benchmarks/RESULTS.md from the result files."
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when RESULTS.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(REPO)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
