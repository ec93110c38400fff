"""Upstream code run against cudagraphs, beside its reference implementation.

Three cases, each the upstream project's own code, unmodified:

* ``torch_suite``: PyTorch's ``test/test_cuda.py`` (a torch-2.11-era revision, test
  data outside this repository: ``--torch-tests``), its tests that call
  ``make_graphed_callables`` (``-k make_graphed_callables``), under torch's own
  harness, once with torch's helper and once with ours swapped in by
  ``-p cudagraphs.pytest_plugin``; each run in its own process. Per-test outcomes
  come from pytest's JUnit XML.
* ``nemo``: NeMo Automodel's ``PartialCudaGraphManager`` (from its wheel), capturing
  with cudagraphs' helper through :func:`cudagraphs.integrations.nemo_automodel.
  use_cudagraphs` (Transformer Engine is absent), against eager and against our own
  ``PartialCudaGraphManager`` on the same model: HF Llama, 8 layers, hidden 512,
  bf16, ``AdamW(foreach=True)``, ``zero_grad(set_to_none=True)``; NeMo's ``attn``
  scope, ours at the same scope (``attention``) and at its defaults (the widest
  graph-safe scope per layer).
* ``megatron``: Megatron-Core's ``TECudaGraphHelper`` over a ``GPTModel`` with the
  local layer spec at one rank, our helper behind the Transformer Engine names it
  imports (a test-only stand-in, ``tests/helpers/te_standin.py``), against eager
  (``benchmarks/_upstream_megatron.py``).

Method (``nemo``): every variant is built and recorded/captured from the same weights
and batch (one eager recording step each), then ``CHECK_STEPS`` steps run on each and
the parameters are compared with eager's bit for bit, then all are timed in shuffled
interleaved rounds (``cudagraphs.timing.interleaved_samples_ms``), and last each
variant's own kernel-busy time and launches are profiled on a fresh build.

Targets: ``torch_suite_outcomes_equal_torch`` (every test id's outcome under ours
equals its outcome under torch's helper), ``nemo_automodel_partial_equals_eager``,
``megatron_te_helper_equals_eager``, ``ours_partial_le_0.5x_nemo_partial`` (our
default manager's step time at most half NeMo's on our core, same model).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch  # noqa: E402
from torch import nn  # noqa: E402

import _report  # noqa: E402,F401  (first: puts this checkout's src on sys.path)
from _checks import fresh_kernel_busy, guard_steps, ratio  # noqa: E402
from _report import (  # noqa: E402
    REPO,
    add_common_arguments,
    describe_error,
    environment,
    exit_code_without_gpu,
    free_memory,
    kernel_busy_method,
    step_time_method,
    write_report,
)
from cudagraphs.timing import interleaved_samples_ms, summarize  # noqa: E402

NAME = "upstream"
TORCH_TESTS = REPO.parent / "shared" / "upstream" / "torch" / "test_cuda.py"
TORCH_SELECT = "make_graphed_callables"
EAGER, NEMO = "eager", "nemo_partial_cudagraphs"
OURS_SAME_SCOPE, OURS_DEFAULT = "cudagraphs_partial_attention", "cudagraphs_partial"
NEMO_VARIANTS = (EAGER, NEMO, OURS_SAME_SCOPE, OURS_DEFAULT)
CHECK_STEPS, WARMUP_STEPS, ITERS, REPEATS = 6, 5, 20, 7
KERNEL_BUSY_ITERS, KERNEL_BUSY_WARMUP = 10, 3
SHUFFLE_SEED, MODEL_SEED, INPUT_SEED = 1234, 0, 1
LR = 1e-3


# ---- pure logic (tested on the CPU) --------------------------------------------------


def junit_outcomes(xml_text: str) -> dict[str, str]:
    """Per test id (``Class::name``), ``passed``, ``failed``, ``error``, ``skipped`` or
    ``xfailed`` from pytest's JUnit XML (an expected failure is a ``skipped`` element
    of type ``pytest.xfail``)."""
    outcomes = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        test_id = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                break
            if child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        outcomes[test_id] = outcome
    return outcomes


def outcome_differences(ours: Mapping[str, str], torch_: Mapping[str, str]) -> list[str]:
    """Every test id whose outcome under ours differs from torch's, or ran under one
    only: ``"id: torch X, ours Y"``."""
    return [
        f"{t}: torch {torch_.get(t, 'not run')}, ours {ours.get(t, 'not run')}"
        for t in sorted(set(ours) | set(torch_))
        if ours.get(t) != torch_.get(t)
    ]


def compute_targets(report: Mapping) -> dict[str, bool | None]:
    """The issue's four targets from the cases' results; ``None`` where a case did
    not run or a number is missing."""
    suite = report.get("torch_suite", {})
    nemo = report.get("nemo", {})
    megatron = report.get("megatron", {})
    runs = suite.get("outcomes", {})
    suite_ok = None
    if "torch" in runs and "cudagraphs" in runs:
        suite_ok = bool(runs["torch"]) and not outcome_differences(
            runs["cudagraphs"], runs["torch"]
        )
    ms = nemo.get("ms", {})
    speed = ratio(ms.get(OURS_DEFAULT), ms.get(NEMO))
    equal = nemo.get("check", {}).get(NEMO, {}).get("equal")
    return {
        "torch_suite_outcomes_equal_torch": suite_ok,
        "nemo_automodel_partial_equals_eager": equal,
        "megatron_te_helper_equals_eager": megatron.get("equal_to_eager"),
        "ours_partial_le_0.5x_nemo_partial": None if speed is None else speed <= 0.5,
    }


def compare_params(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict:
    """Bitwise, per parameter: ``{"equal", "differing", "max_abs_diff"}``."""
    differing, worst = [], 0.0
    for name, ref in want.items():
        cur = got.get(name)
        if cur is None or cur.shape != ref.shape or not torch.equal(cur, ref):
            differing.append(name)
            if cur is not None and cur.shape == ref.shape:
                worst = max(worst, (cur.float() - ref.float()).abs().max().item())
    return {"equal": not differing, "differing": differing[:20], "max_abs_diff": worst}


# ---- torch's suite ---------------------------------------------------------------------


def run_torch_suite(path: Path, swap: bool, timeout_s: int = 900) -> dict:
    """One pytest process over ``path -k make_graphed_callables``; with ``swap`` under
    ``-p cudagraphs.pytest_plugin``. Returns ``outcomes``, ``exit_code``, ``seconds``
    and the tail of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", str(path), "-k", TORCH_SELECT, "-q"]
        cmd += ["-p", "no:cacheprovider", f"--junitxml={junit}", "--rootdir", tmp]
        if swap:
            cmd += ["-p", "cudagraphs.pytest_plugin"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p
        )
        t0 = time.perf_counter()
        done = subprocess.run(
            cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        seconds = time.perf_counter() - t0
        outcomes = junit_outcomes(junit.read_text()) if junit.exists() else {}
    return {
        "outcomes": outcomes,
        "exit_code": done.returncode,
        "seconds": round(seconds, 1),
        "output_tail": (done.stdout + done.stderr)[-3000:],
    }


def torch_suite_case(path: Path) -> dict:
    if not path.exists():
        return {"error": f"{path} does not exist (pass --torch-tests)"}
    path = path.resolve()  # each run's working directory is a fresh temporary one
    runs = {
        "torch": run_torch_suite(path, swap=False),
        "cudagraphs": run_torch_suite(path, swap=True),
    }
    outcomes = {k: r.pop("outcomes") for k, r in runs.items()}
    return {
        "file": str(path),
        "select": TORCH_SELECT,
        "outcomes": outcomes,
        "runs": runs,
        "differences": outcome_differences(outcomes["cudagraphs"], outcomes["torch"]),
    }


# ---- NeMo Automodel's partial graphs on our core -----------------------------------------


@dataclass
class Built:
    step: Callable[[], torch.Tensor]
    model: nn.Module
    setup_s: float
    release: Callable[[], None] = field(default=lambda: None)
    info: dict = field(default_factory=dict)


def llama(shape: dict) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        vocab_size=shape["vocab"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(MODEL_SEED)
    net = transformers.LlamaForCausalLM(config).to(dtype=torch.bfloat16)
    return net.to("cuda").train()


SHAPE = dict(
    layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=2, vocab=1024, batch=1, seq=128
)


def make_step(net: nn.Module) -> Callable[[], torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(INPUT_SEED)
    ids = torch.randint(
        0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"]), generator=gen, device="cuda"
    )
    opt = torch.optim.AdamW(net.parameters(), lr=LR, foreach=True)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = net(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def build_eager() -> Built:
    net = llama(SHAPE)
    step = make_step(net)
    step()  # the recording step of the graphed variants
    return Built(step, net, 0.0)


def build_nemo() -> Built:
    from nemo_automodel.components.cuda_graphs.partial import PartialCudaGraphManager as Nemo

    from cudagraphs.integrations.nemo_automodel import use_cudagraphs

    net = llama(SHAPE)
    step = make_step(net)
    # What NeMo's recipes attach to a model that asks for partial graphs.
    net.backend = SimpleNamespace(cuda_graph=SimpleNamespace(modules=["attn"]))
    swap = use_cudagraphs()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    manager = Nemo.from_model_parts([net])
    step()  # recorded
    manager.capture()
    torch.cuda.synchronize()

    def release() -> None:
        manager.close()
        swap.restore()

    stats = manager.stats
    return Built(step, net, time.perf_counter() - t0, release, {"scope": "attn", "stats": stats})


def build_ours(scopes: tuple[str, ...] | None) -> Built:
    from cudagraphs.partial import PartialCudaGraphManager

    net = llama(SHAPE)
    step = make_step(net)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    kwargs = {} if scopes is None else {"scopes": scopes}
    manager = PartialCudaGraphManager.from_model_parts([net], **kwargs)
    manager.start_recording()
    step()
    manager.capture()
    torch.cuda.synchronize()
    info = {"scopes": list(scopes) if scopes else "default", "stats": manager.stats}
    return Built(step, net, time.perf_counter() - t0, manager.close, info)


BUILDERS: dict[str, Callable[[], Built]] = {
    EAGER: build_eager,
    NEMO: build_nemo,
    OURS_SAME_SCOPE: lambda: build_ours(("attention",)),
    OURS_DEFAULT: lambda: build_ours(None),
}


def log(msg: str) -> None:
    print(f"{NAME}: {msg}", file=sys.stderr, flush=True)


def _release(built: Built) -> None:
    try:
        built.release()
    except Exception as exc:
        describe_error(exc)


def _stats(built: Built) -> dict | None:
    stats = built.info.get("stats")
    return dict(stats()) if callable(stats) else None


def nemo_case(names: tuple[str, ...] = NEMO_VARIANTS, skip_kernel_busy: bool = False) -> dict:
    results: dict[str, dict] = {}
    built: dict[str, Built] = {}
    for name in names:
        log(f"nemo: build {name}")
        try:
            built[name] = b = BUILDERS[name]()
            results[name] = {"setup_s": round(b.setup_s, 3)}
            results[name].update({k: v for k, v in b.info.items() if k != "stats"})
        except Exception as exc:
            results[name] = describe_error(exc)
    check: dict[str, dict] = {}
    try:
        for name, b in list(built.items()):
            try:
                for _ in range(CHECK_STEPS):
                    b.step()
            except Exception as exc:
                results[name].update(describe_error(exc))
                _release(built.pop(name))
        torch.cuda.synchronize()
        if EAGER in built:
            want = {n: p.detach() for n, p in built[EAGER].model.named_parameters()}
            for name, b in built.items():
                if name != EAGER:
                    got = {n: p.detach() for n, p in b.model.named_parameters()}
                    check[name] = compare_params(got, want)
                    check[name]["steps"] = CHECK_STEPS + 1
        errors: dict[str, dict] = {}
        steps = guard_steps({n: b.step for n, b in built.items()}, errors)
        samples = interleaved_samples_ms(
            steps, iters=ITERS, warmup=WARMUP_STEPS, repeats=REPEATS, shuffle_seed=SHUFFLE_SEED
        )
        for name, times in samples.items():
            if name in errors:
                results[name].update(errors[name])
            else:
                results[name]["ms"] = summarize(times)
            stats = _stats(built[name])
            if stats is not None:
                results[name]["stats"] = stats
    finally:
        for b in built.values():
            _release(b)
        built.clear()
        free_memory()
    if not skip_kernel_busy:
        for name in names:
            if "ms" in results.get(name, {}):
                log(f"nemo: kernel-busy {name}")
                results[name].update(
                    fresh_kernel_busy(
                        BUILDERS[name],
                        _release,
                        iters=KERNEL_BUSY_ITERS,
                        warmup=KERNEL_BUSY_WARMUP,
                    )
                )
    ms = {n: r["ms"]["median"] for n, r in results.items() if "ms" in r}
    return {
        "shape": SHAPE,
        "variants": results,
        "check": check,
        "ms": ms,
        "ratios": {f"{n}/{EAGER}": ratio(ms.get(n), ms.get(EAGER)) for n in ms if n != EAGER}
        | {f"{OURS_DEFAULT}/{NEMO}": ratio(ms.get(OURS_DEFAULT), ms.get(NEMO))}
        | {f"{OURS_SAME_SCOPE}/{NEMO}": ratio(ms.get(OURS_SAME_SCOPE), ms.get(NEMO))},
    }


# ---- Megatron-Core ------------------------------------------------------------------------


def megatron_case(steps: int) -> dict:
    try:
        from _upstream_megatron import run_megatron_case
    except ImportError as exc:
        return {"skipped": f"megatron case unavailable: {exc}"}
    try:
        return run_megatron_case(steps=steps)
    except Exception as exc:
        return describe_error(exc)


# ---- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--torch-tests", type=Path, default=TORCH_TESTS)
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=["torch_suite", "nemo", "megatron"],
        default=["torch_suite", "nemo", "megatron"],
    )
    parser.add_argument("--megatron-steps", type=int, default=6)
    parser.add_argument("--skip-kernel-busy", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = exit_code_without_gpu(NAME, args.require_gpu)
    if code is not None:
        return code
    report = environment(NAME, args.commit, args.run_label)
    report["settings"] = {
        "cases": args.cases,
        "nemo": {
            "check_steps": CHECK_STEPS,
            "step": "zero_grad(set_to_none=True), forward, loss.float().pow(2).mean(), "
            "backward, AdamW(foreach=True, lr=1e-3).step()",
            "step_time": step_time_method(SHUFFLE_SEED),
            "iters": ITERS,
            "repeats": REPEATS,
            "kernel_busy": kernel_busy_method(KERNEL_BUSY_ITERS, KERNEL_BUSY_WARMUP),
        },
    }
    if "torch_suite" in args.cases:
        log("torch_suite")
        report["torch_suite"] = torch_suite_case(args.torch_tests)
        write_report(NAME, report, args.out, final=False)
    if "nemo" in args.cases:
        try:
            report["nemo"] = nemo_case(skip_kernel_busy=args.skip_kernel_busy)
        except Exception as exc:
            report["nemo"] = describe_error(exc)
        write_report(NAME, report, args.out, final=False)
    if "megatron" in args.cases:
        log("megatron")
        report["megatron"] = megatron_case(args.megatron_steps)
    report["targets"] = compute_targets(report)
    write_report(NAME, report, args.out, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
