"""The ``megatron`` case of ``benchmarks/upstream.py``: Megatron-Core's own
``TECudaGraphHelper`` over a ``GPTModel`` (local layer spec, bf16, one rank, Megatron's
DDP) capturing with cudagraphs' helper behind the Transformer Engine names it imports
(the test-only stand-in ``tests/helpers/te_standin.py``, FP8 off), against the
same model trained eagerly.

The case is ``tests/helpers/megatron_case.run_case`` (the GPU test runs the same
code): both models come from one state dict, see the same batches, and run step by
step interleaved (graphed step ``i``, then eager step ``i``), each step timed with
``torch.cuda.synchronize()`` around ``time.perf_counter()``. The helper captures
before the first step (``cuda_graph_warmup_steps=0``), so every timed graphed step
replays.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import _report  # noqa: F401  (first: puts this checkout's src on sys.path)

_TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))  # the stand-in and the case live in the tests' helpers

from helpers.megatron_case import CaseShape, megatron_skip_reason, run_case  # noqa: E402

__all__ = ["run_megatron_case"]

#: The fields ``run_megatron_case`` returns beside the ones ``benchmarks/upstream.py``
#: reads, for a reader of the JSON.
_DETAILS = (
    "kwargs",
    "replay_kwargs",
    "expected_replays",
    "graphed_types",
    "losses",
    "eager_losses",
    "num_differing",
    "differing",
    "shape",
    "steps",
)


def run_megatron_case(steps: int = 6, shape: CaseShape | None = None) -> dict[str, Any]:
    """Train ``steps`` steps graphed (Megatron's helper on cudagraphs) and eager.

    Returns:
        ``{"equal_to_eager": bool (losses every step, and every parameter and
        main_grad at the end, bit for bit), "max_abs_diff": float, "graphed_step_ms":
        [...], "eager_step_ms": [...], "replays": int (CUDAGraph.replay calls while
        training: 2 per layer per step), "kwargs_passed": sorted names Megatron passed
        to make_graphed_callables, "refused": [...] (what cudagraphs refused, at the
        call or at a replay)}`` and the details in ``_DETAILS``; ``{"skipped": why}``
        where megatron-core, Python >= 3.12 or a GPU is missing.
    """
    reason = megatron_skip_reason(need_gpu=True)
    if reason is not None:
        return {"skipped": reason}
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_case(steps, os.path.join(tmp, "pg"), shape or CaseShape(), report=report)
        except Exception as exc:
            if not report.get("refused"):
                raise
            # A refusal is a result of this case, not a crash of the benchmark.
            report.update(equal_to_eager=False, error=f"{type(exc).__name__}: {exc}")
    out = {
        "equal_to_eager": report.get("equal_to_eager", False),
        "max_abs_diff": report.get("max_abs_diff"),
        "graphed_step_ms": report.get("graphed_step_ms", []),
        "eager_step_ms": report.get("eager_step_ms", []),
        "replays": report.get("replays", 0),
        "kwargs_passed": report.get("kwargs_passed", []),
        "refused": report.get("refused", []),
    }
    out.update({k: report[k] for k in _DETAILS if k in report})
    if "error" in report:
        out["error"] = report["error"]
    return out
