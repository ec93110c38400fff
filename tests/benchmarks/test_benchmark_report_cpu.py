"""CPU tests of the benchmarks' provenance record (``benchmarks/_report.py``): the
sources hash computed on disk equals the one computed from git for the same commit,
and a changed file is caught."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report_module():
    spec = importlib.util.spec_from_file_location("_report", REPO / "benchmarks" / "_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_report", module)
    spec.loader.exec_module(module)
    return module


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "src" / "cudagraphs" / "sub").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "src" / "cudagraphs" / "a.py").write_text("A = 1\n")
    (tmp_path / "src" / "cudagraphs" / "sub" / "b.py").write_text("B = 2\n")
    (tmp_path / "benchmarks" / "bench.py").write_text("print('x')\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}\n")  # not a source
    (tmp_path / "README.md").write_text("not a source\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return tmp_path


def test_the_hash_on_disk_equals_the_hash_of_the_commit(report_module, tree):
    on_disk = report_module.source_sha256(tree)
    assert on_disk == report_module.commit_source_sha256("HEAD", root=tree)
    (tree / "README.md").write_text("changed, but not a measured source\n")
    (tree / "benchmarks" / "results" / "r.json").write_text('{"x": 1}\n')
    assert report_module.source_sha256(tree) == on_disk


@pytest.mark.parametrize("change", ["edit", "add", "remove"])
def test_any_change_to_a_measured_source_changes_the_hash(report_module, tree, change):
    before = report_module.source_sha256(tree)
    target = tree / "src" / "cudagraphs" / "sub" / "b.py"
    if change == "edit":
        target.write_text("B = 3\n")
    elif change == "add":
        (tree / "benchmarks" / "new.py").write_text("\n")
    else:
        target.unlink()
    assert report_module.source_sha256(tree) != before
    assert report_module.commit_source_sha256("HEAD", root=tree) == before


def test_an_unknown_commit_has_no_hash(report_module, tree):
    assert report_module.commit_source_sha256("0" * 40, root=tree) is None


def test_result_names_carry_the_tree_state_and_the_run_label(report_module, tmp_path):
    base = {"benchmark": "b", "device": "NVIDIA H200", "commit": "0123456789abcdef" * 2}
    out = str(tmp_path) + "/"
    assert report_module.result_path(out, {**base, "dirty": False}).name == (
        "b-nvidia-h200-0123456789ab.json"
    )
    dirty = {**base, "dirty": True, "diff_sha256": "feedbeef" * 8}
    assert report_module.result_path(out, dirty).name == (
        "b-nvidia-h200-0123456789ab-dirty-feedbeef.json"
    )
    labelled = {**base, "dirty": None, "run_label": "run2"}
    assert report_module.result_path(out, labelled).name == "b-nvidia-h200-0123456789ab-run2.json"
    assert report_module.result_path(str(tmp_path / "x.json"), labelled) == tmp_path / "x.json"


def test_verify_names_what_does_not_hold(report_module, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"commit": "HEAD", "dirty": None}))
    assert report_module.verify(path) == "no source_sha256 recorded"
    path.write_text(json.dumps({"commit": "HEAD", "source_sha256": "x", "dirty": True}))
    assert "dirty tree" in report_module.verify(path)


def test_committed_results_ran_the_sources_of_their_commit(report_module):
    """Every report under benchmarks/results that records a source hash ran exactly
    the sources of the commit it names (reports before the hash existed are skipped)."""
    if Path(_git(REPO, "rev-parse", "--show-toplevel")).resolve() != REPO.resolve():
        # A copy inside another tree (mutmut's mutants/ directory): git answers for the
        # outer repository, whose paths are not this copy's.
        pytest.skip("this checkout is not the root of its git repository")
    if _git(REPO, "rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone lacks the commits the reports name")
    checked = 0
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        if "source_sha256" not in json.loads(path.read_text()):
            continue
        assert report_module.verify(path) is None, path.name
        checked += 1
    if checked == 0:
        pytest.skip("no report records a source hash yet")


def test_round_arguments_and_method_lines():
    import argparse

    import _report

    p = argparse.ArgumentParser()
    _report.add_round_arguments(p)
    args = p.parse_args(["--iters", "3", "--skip-kernel-busy"])
    assert (args.iters, args.repeats, args.skip_kernel_busy) == (3, None, True)
    assert "seed 7" in _report.step_time_method(7)
    line = _report.kernel_busy_method(10, 3)
    assert "kernel_activity(iters=10, warmup=3)" in line and "launches" in line
