"""Does ``train_fp8``'s loss SQNR measure the float8 recipe, or the trajectory's
divergence at the benchmark's learning rate?

Run from the repository root on the GPU machine:

    PYTHONPATH=src python benchmarks/probes/fp8_loss_regime.py [LR ...]

For each learning rate (default ``1e-5``, a tenth of the timed steps'; the
benchmark's loss check now runs there) it runs
``train_fp8.loss_curve`` (200 graphed compiled steps from the seed's weights over the
benchmark's 8 fixed batches) for bf16 twice and for each float8 recipe once, and
records each curve's SQNR against the first bf16 run in dB, every 20th loss and the
last three.

How to read it: ``bf16_repeat`` is the floor that run-to-run variation sets at that
learning rate. If the recipes' SQNRs rise with the floor as the learning rate falls,
the benchmark's figure is dominated by divergence of the trajectory; if they stay
low while the floor rises, the error is the recipe's own.
Writes ``$OUT/probe-fp8_loss_regime.json`` when OUT is set.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import train_fp8  # noqa: E402

CURVES = (
    ("bf16", None),
    ("bf16_repeat", None),
    ("tensorwise", "tensorwise"),
    ("rowwise", "rowwise"),
)


def main(argv: list[str]) -> None:
    lrs = [float(a) for a in argv] or [1e-5]
    data = train_fp8.make_data()
    record: dict = {
        "probe": "fp8_loss_regime",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "steps": train_fp8.LOSS_STEPS,
        "points": "every 20th loss, then the last three",
        "by_lr": {},
    }
    for lr in lrs:
        curves, per = {}, {"sqnr_db": {}, "curves": {}}
        for name, recipe in CURVES:
            v = train_fp8.Variant(name, recipe, compiled=True, graphed=True)
            curves[name] = train_fp8.loss_curve(v, data, lr)
            c = curves[name]
            per["curves"][name] = [round(x, 5) for x in c[::20]] + [round(x, 5) for x in c[-3:]]
            if name != "bf16":
                per["sqnr_db"][name] = train_fp8.sqnr_db(curves["bf16"], c)
            print(lr, name, per["sqnr_db"].get(name), per["curves"][name], flush=True)
        record["by_lr"][str(lr)] = per
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "probe-fp8_loss_regime.json", "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
