"""GPU probe (issue 35 item 4): Megatron-Core 0.19.2's TECudaGraphHelper on cudagraphs.

Run from the repository root on the GPU machine, after the wheels are installed:
    python benchmarks/probes/megatron_probe.py
Prints one JSON object per section (and a traceback where a section fails), then a
summary. Sections:

1. env: versions.
2. core: two behaviours Megatron needs from make_graphed_callables, on toy callables:
   (a) under _order it returns something that is not the module (Megatron stores the
   result in layer.cuda_graphs and calls it from the layer's __call__);
   (b) a replay call may carry keywords the capture did not see, with value None, and
   Transformer Engine's is_first_microbatch flag (Megatron's replay passes both);
   a tensor under an uncaptured keyword is still refused.
3. case: the Megatron case exactly as the GPU test runs it (plus an eager twin: is
   eager itself bitwise reproducible here?).
4. case_emulated (only if 3 failed): the same with (a) and (b) emulated around the
   results Megatron stored, to show whether the rest of the case holds.
Finishes in well under two minutes on an H200.
"""

import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

RESULTS = {}


def section(name, fn):
    t0 = time.perf_counter()
    out = {}
    try:
        fn(out)
        out["ok"] = True
    except BaseException as exc:  # report and go on with the next section
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        out["traceback"] = traceback.format_exc()[-6000:]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    RESULTS[name] = out
    tb = out.pop("traceback", None)
    print(f"=== {name}", json.dumps(out, indent=1, default=str), flush=True)
    if tb:
        print(tb, flush=True)
    return out


def env(out):
    import cudagraphs

    out.update(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        cudagraphs=getattr(cudagraphs, "__version__", "?"),
    )
    try:
        from megatron.core import package_info

        out["megatron_core"] = package_info.__version__
    except Exception as exc:
        out["megatron_core"] = f"not importable: {exc}"


def core(out):
    from cudagraphs import make_graphed_callables
    from cudagraphs.errors import CudaGraphInputError

    torch.manual_seed(0)
    lin = nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    (result,) = make_graphed_callables((lin,), [(x,)], _order=[1, -1])
    out["order_returns"] = type(result).__name__
    out["order_returns_module"] = isinstance(result, nn.Module)
    out["order_result_has_reset"] = callable(getattr(result, "reset", None))

    lin2 = nn.Linear(16, 16).cuda()

    def fn(x, mask=None, other=None):
        return lin2(x) * mask

    mask = torch.ones(4, 16, device="cuda")
    g = make_graphed_callables(fn, (x,), sample_kwargs={"mask": mask})
    probes = {
        "None_extra": dict(mask=mask, other=None),
        "is_first_microbatch": dict(mask=mask, is_first_microbatch=True),
        "tensor_extra (must be refused)": dict(mask=mask, other=torch.ones(1, device="cuda")),
    }
    for name, kwargs in probes.items():
        try:
            g(x, **kwargs).sum().backward()
            out[f"replay_{name}"] = "accepted"
        except CudaGraphInputError as exc:
            out[f"replay_{name}"] = f"refused: {str(exc)[:300]}"


class _TEReplayCall:
    """Emulates core change (b) around one stored result: drops uncaptured keywords
    whose value is None, and is_first_microbatch."""

    def __init__(self, graphed):
        self.graphed = graphed
        spec = graphed.graphs.in_spec  # (args, kwargs)
        kwargs_spec = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
        self.captured = set(kwargs_spec.context)

    def __call__(self, *args, **kwargs):
        kept = {
            k: v
            for k, v in kwargs.items()
            if k in self.captured or (v is not None and k != "is_first_microbatch")
        }
        return self.graphed(*args, **kept)

    def reset(self):
        self.graphed.reset()


def emulate(helper):
    for layers in helper.callables_per_chunk:
        for layer in layers:
            stored = []
            for g in layer.cuda_graphs:
                if isinstance(g, nn.Module):  # core change (a)
                    g = g.cuda_graph
                stored.append(_TEReplayCall(g))
            layer.cuda_graphs = stored


def case(out, adapt=None):
    from helpers.megatron_case import run_case

    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_case(4, f"{tmp}/pg", report=out, eager_twin=True, adapt=adapt)
        finally:
            for key in ("graphed_step_ms", "eager_step_ms"):
                if key in out:
                    out[key] = [round(v, 3) for v in out[key]]


def main():
    t0 = time.perf_counter()
    section("env", env)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing more to probe")
        return
    section("core", core)
    strict = section("case", case)
    if not strict["ok"] or not strict.get("equal_to_eager"):
        section("case_emulated", lambda out: case(out, adapt=emulate))
    summary = {
        name: {k: r.get(k) for k in ("ok", "equal_to_eager", "replays", "expected_replays")}
        for name, r in RESULTS.items()
        if name.startswith("case")
    }
    summary["core"] = {k: v for k, v in RESULTS.get("core", {}).items() if k != "seconds"}
    summary["total_seconds"] = round(time.perf_counter() - t0, 1)
    print("=== summary", json.dumps(summary, indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
