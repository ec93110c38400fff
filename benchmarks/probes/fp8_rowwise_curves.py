"""Is the graphed rowwise-float8 loss curve of ``train_fp8`` a graphs bug, or the
recipe's own trajectory?

Run from the repository root on the GPU machine:

    PYTHONPATH=src python benchmarks/probes/fp8_rowwise_curves.py

It runs ``train_fp8.loss_curve`` (200 steps from the seed's weights over the
benchmark's 8 fixed batches) for ``graphed_fp8_rowwise_compiled`` twice, for
``graphed_fp8_rowwise`` (eager kernels) once, and for torchao's own
``eager_fp8_rowwise_compiled`` once, and records every 10th loss and the last three.

How to read it: two graphed compiled runs of the same code from the same weights that
end far apart mean the trajectory is not reproducible run to run (the float8 kernels'
rounding is not deterministic here), so one run's end says nothing about graphs; the
eager curve's spikes say whether the recipe is unstable on its own. Note that
``loss_curve`` of an eager variant starts after the variant's ``WARMUP`` steps (its
``build`` warms it up), so its first point is later on the same trajectory.
Writes ``$OUT/probe-fp8_rowwise_curves.json`` when OUT is set.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import train_fp8  # noqa: E402

RUNS = (
    "graphed_fp8_rowwise_compiled",
    "graphed_fp8_rowwise",
    "graphed_fp8_rowwise_compiled",
    "eager_fp8_rowwise_compiled",
)


def main() -> None:
    data = train_fp8.make_data()
    by_name = {v.name: v for v in train_fp8.variants(("rowwise",))}
    record: dict = {
        "probe": "fp8_rowwise_curves",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "steps": train_fp8.LOSS_STEPS,
        "points": "every 10th loss, then the last three",
        "curves": {},
    }
    for name in RUNS:
        curve = train_fp8.loss_curve(by_name[name], data)
        points = [round(x, 5) for x in curve[::10]] + [round(x, 5) for x in curve[-3:]]
        record["curves"].setdefault(name, []).append(points)
        print(name, points, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "probe-fp8_rowwise_curves.json", "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
