"""CPU test of ``benchmarks/device_session.sh``: every variant a phase names is one the
benchmark it runs knows, so a typo fails here and not after minutes of device time."""

from __future__ import annotations

import re

from conftest import script
from helpers.train_bench import BENCH


def phase_variants() -> dict[str, set[str]]:
    """Per benchmark script, the variant names the session script passes to it."""
    text = (BENCH / "device_session.sh").read_text()
    out: dict[str, set[str]] = {}
    for case in text.split(";;"):
        if "--variants" not in case:
            continue
        scripts = set(re.findall(r"benchmarks/(\w+)\.py", case))
        names = set(re.findall(r"\b((?:cudagraphs|torch_compile|raw_cuda_graph)\w*)\b", case))
        for s in scripts:
            out.setdefault(s, set()).update(names)
    return out


def test_every_variant_the_session_script_names_is_known_to_its_benchmark():
    found = phase_variants()
    assert {"train_step", "train_step_hf"} <= set(found)
    for name, variants in found.items():
        known = set(script(name).VARIANTS)
        assert variants <= known, f"{name}: unknown {sorted(variants - known)}"
    assert "cudagraphs_train_step_compiled_optimizer" in found["train_step_hf"]


def test_the_suite_phase_reports_a_folder_without_gpu_tests_as_such(tmp_path):
    """pytest's exit status 5 (nothing collected) is a folder without single-GPU tests:
    the phase says so instead of printing it as a failing status."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python"
    # The stand-in pytest: nothing collected in tests/distributed, green elsewhere.
    stub.write_text(
        '#!/bin/bash\ncase "$*" in *tests/distributed*) echo "no tests ran"; exit 5;; esac\n'
        'echo "3 passed"; exit 0\n'
    )
    stub.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        OUT=str(tmp_path / "out"),
        WHEELS=str(tmp_path / "no-wheels"),
    )
    done = subprocess.run(
        ["bash", str(BENCH / "device_session.sh"), "suite", "abc"],
        cwd=BENCH.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "== tests/distributed: no -m cuda tests collected" in lines
    assert not any(line.startswith("== tests/distributed rc=") for line in lines)
    assert any(line.startswith("== tests/core rc=0") for line in lines)
    assert (tmp_path / "out" / "logs.tgz").exists()
