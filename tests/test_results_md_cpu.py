"""``benchmarks/RESULTS.md`` is generated from the committed result files by
``benchmarks/results_md.py``: it must equal what the script writes today, and the
script must show every report, newest first, with every target it records."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results_md():
    path = REPO / "benchmarks" / "results_md.py"
    spec = importlib.util.spec_from_file_location("results_md", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("results_md", module)
    spec.loader.exec_module(module)
    return module


def test_results_md_is_what_the_script_writes(results_md):
    committed = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert committed == results_md.render(REPO), (
        "benchmarks/RESULTS.md is stale: regenerate it with `python benchmarks/results_md.py` "
        "and commit it with the result files"
    )


def test_every_result_file_has_its_section(results_md):
    text = results_md.render(REPO)
    for folder in ("benchmarks/results", "tests/distributed/results"):
        for path in sorted((REPO / folder).glob("*.json*")):
            assert f"### [{path.name}](" in text, path.name
    assert "## Mutation testing" in text


def _write(root: Path, name: str, report: dict) -> None:
    folder = root / "benchmarks" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(report))


def _report(stamp: str, **extra) -> dict:
    return {
        "benchmark": "program_replay",
        "commit": "0123456789abcdef0123",
        "dirty": False,
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "timestamp": stamp,
        **extra,
    }


def test_reports_are_newest_first_and_every_target_is_shown(results_md, tmp_path):
    older = _report(
        "2026-01-01T00:00:00+00:00",
        cases={"one_input": {"us": {"raw": 2.5, "cudagraphs_program": 7.25}}},
        targets={"fast": True, "small": False, "skipped": None},
    )
    newer = _report("2026-02-01T00:00:00+00:00", targets={"fast": False})
    _write(tmp_path, "a-old.json", older)
    _write(tmp_path, "z-new.json", newer)
    text = results_md.render(tmp_path)
    assert text.index("z-new.json") < text.index("a-old.json")
    assert "| `fast` | met |" in text and "| `fast` | **not met** |" in text
    assert "| `small` | **not met** |" in text
    assert "| `skipped` | not measured (`null`) |" in text
    assert "| `cudagraphs_program` | 7.25 |" in text
    assert "commit `0123456789ab`" in text and "clean tree" in text
    assert "[a-old.json](results/a-old.json)" in text


def test_nested_targets_are_shown_when_a_report_has_none_at_its_top(results_md, tmp_path):
    report = _report(
        "2026-01-01T00:00:00+00:00", cases={"tree_64": {"targets": {"le_1.3x": False}}}
    )
    _write(tmp_path, "r.json", report)
    assert "| `tree_64:le_1.3x` | **not met** |" in results_md.render(tmp_path)


def test_the_output_depends_on_the_files_only(results_md, tmp_path):
    _write(tmp_path, "r.json", _report("2026-01-01T00:00:00+00:00", targets={"t": True}))
    first = results_md.render(tmp_path)
    assert results_md.render(tmp_path) == first
    _write(tmp_path, "r.json", _report("2026-01-01T00:00:00+00:00", targets={"t": False}))
    assert results_md.render(tmp_path) != first


def test_check_fails_on_a_stale_page_and_names_the_command(
    results_md, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "RESULTS.md"
    monkeypatch.setattr(results_md, "OUT", out)
    monkeypatch.setattr(results_md, "REPO", tmp_path)
    monkeypatch.setattr(results_md, "render", lambda: "fresh\n")
    out.write_text("stale\n")
    assert results_md.main(["--check"]) == 1
    assert "python benchmarks/results_md.py" in capsys.readouterr().err
    assert results_md.main([]) == 0
    assert out.read_text() == "fresh\n"
    assert results_md.main(["--check"]) == 0


def test_cells_are_formatted_without_losing_the_fourth_decimal(results_md):
    assert results_md.fmt(1.0017) == "1.0017"
    assert results_md.fmt(10.0) == "10"
    assert results_md.fmt(-0.00001) == "-1e-05"
    assert results_md.fmt(None) == "–"
    assert results_md.fmt(True) == "true"
    assert results_md.fmt("a|b\nc") == "a\\|b c"
