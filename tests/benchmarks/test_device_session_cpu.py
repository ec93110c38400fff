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
