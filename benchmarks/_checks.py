"""What the training benchmarks check and how they guard a step, in one place:
every gradient against eager's (:func:`compare_tensors`), parameters after optimizer
steps element by element (:func:`compare_params`), ratios of medians, steps that
record their first exception instead of ending the run (:func:`guard_steps`), and a
variant's own kernel-busy time and launches on a fresh build
(:func:`fresh_kernel_busy`), and the idle time per launch they imply
(:func:`launch_gaps_us`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from _report import describe_error, free_memory
from cudagraphs.timing import kernel_activity

# Parameters after CHECK_STEPS AdamW steps, per element (see compare_params): AdamW's
# first steps move a weight by about lr * sign(g), so a gradient that differs by
# rounding near zero flips that weight's update without any bug. A bug (a step left
# out, run twice, or on the wrong tensors) moves nearly every element instead.
PARAM_ULPS = 2  # an element within 2 ulps (of the dtype, at eager's value) is equal
PARAM_MISMATCH_FRACTION = 0.05  # at most this share of a tensor's elements may differ
ADAM_MAX_UPDATE = 3.2  # the largest |m_hat / sqrt(v_hat)|: (1 - b1) / sqrt(1 - b2)


def compare_tensors(
    got: Mapping[str, torch.Tensor | None], want: Mapping[str, torch.Tensor], rel_tol: float
) -> dict:
    """Every tensor of ``got`` against ``want`` (same names), all differences at once.

    Per tensor the relative error is ``max|got - want| / max|want|`` (computed in
    float32; 0 when they are equal, infinite when only ``want`` is all zeros or a
    value is NaN).

    Returns:
        ``tensors`` (how many compared), ``max_rel_err`` (over the finite errors) and
        ``worst`` (the tensor with the largest error, an infinite one first),
        ``beyond_tol`` (names over ``rel_tol``), ``non_finite`` (names whose error is
        infinite), ``missing`` (in ``want``, absent or ``None`` in ``got``),
        ``unexpected`` (only in ``got``), ``shape_mismatch`` (``name: expected vs
        received``), ``equal`` (bitwise, all) and ``within_tol`` (nothing missing,
        unexpected, mismatched or beyond the tolerance).
    """
    errors: dict[str, float] = {}
    missing, mismatch, equal = [], [], True
    for name, ref in want.items():
        cur = got.get(name)
        if cur is None:
            missing.append(name)
        elif cur.shape != ref.shape:
            mismatch.append(f"{name}: {tuple(ref.shape)} vs {tuple(cur.shape)}")
        else:
            errors[name] = relative_error(cur, ref)
            equal = equal and torch.equal(cur, ref)
    unexpected = sorted(set(got) - set(want))
    beyond = [n for n, e in errors.items() if not e <= rel_tol]
    finite = [e for e in errors.values() if math.isfinite(e)]
    return {
        "tensors": len(errors),
        "max_rel_err": max(finite, default=None),
        "worst": max(errors, key=errors.__getitem__, default=None),
        "rel_tol": rel_tol,
        "beyond_tol": beyond,
        "non_finite": [n for n, e in errors.items() if not math.isfinite(e)],
        "missing": missing,
        "unexpected": unexpected,
        "shape_mismatch": mismatch,
        "equal": equal and not (missing or mismatch or unexpected),
        "within_tol": not (beyond or missing or mismatch or unexpected),
    }


def compare_params(
    got: Mapping[str, torch.Tensor | None], want: Mapping[str, torch.Tensor], *, max_update: float
) -> dict:
    """Every parameter of ``got`` against eager's ``want`` after the same optimizer
    steps, element by element.

    An element differs when ``|got - want|`` exceeds ``PARAM_ULPS`` ulps of the dtype at
    ``|want|``. A tensor passes when at most ``PARAM_MISMATCH_FRACTION`` of its
    elements differ and no element differs by more than ``max_update`` (twice the most
    the steps can move one element: two opposite updates). Sign flips of near-zero
    gradients move few elements, each by at most an update; a missing or doubled step
    moves most of them.

    Returns the keys of :func:`compare_tensors` (``max_rel_err`` and ``worst`` by the
    share of differing elements) plus ``max_mismatch_fraction``, ``max_abs_diff``,
    ``max_update`` and ``rule``.
    """
    fractions: dict[str, float] = {}
    missing, mismatch, equal, max_abs = [], [], True, 0.0
    for name, ref in want.items():
        cur = got.get(name)
        if cur is None:
            missing.append(name)
            continue
        if cur.shape != ref.shape:
            mismatch.append(f"{name}: {tuple(ref.shape)} vs {tuple(cur.shape)}")
            continue
        equal = equal and torch.equal(cur, ref)
        diff = (cur.detach().float() - ref.detach().float()).abs()
        ulp = torch.finfo(ref.dtype).eps if ref.dtype.is_floating_point else 0.0
        tol = PARAM_ULPS * ulp * ref.detach().float().abs()
        if torch.isnan(diff).any():
            fractions[name], max_abs = 1.0, math.inf
            continue
        fractions[name] = (diff > tol).float().mean().item() if diff.numel() else 0.0
        max_abs = max(max_abs, diff.max().item() if diff.numel() else 0.0)
    unexpected = sorted(set(got) - set(want))
    beyond = [n for n, f in fractions.items() if f > PARAM_MISMATCH_FRACTION]
    too_far = max_abs > max_update
    return {
        "tensors": len(fractions),
        "rule": f"an element differs beyond {PARAM_ULPS} ulps of eager's value; pass: at "
        f"most {PARAM_MISMATCH_FRACTION:.0%} of a tensor's elements differ, none by more "
        "than max_update",
        "max_mismatch_fraction": max(fractions.values(), default=None),
        "worst": max(fractions, key=fractions.__getitem__, default=None),
        "max_abs_diff": max_abs,
        "max_update": max_update,
        "beyond_tol": beyond + (["(an element beyond max_update)"] if too_far else []),
        "missing": missing,
        "unexpected": unexpected,
        "shape_mismatch": mismatch,
        "equal": equal and not (missing or mismatch or unexpected),
        "within_tol": not (beyond or too_far or missing or mismatch or unexpected),
    }


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` in float32; a NaN anywhere counts as infinite."""
    got, want = got.detach().float(), want.detach().float()
    if got.numel() == 0:
        return 0.0
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    if math.isnan(diff) or math.isnan(scale):
        return math.inf
    if diff == 0.0:
        return 0.0
    return math.inf if scale == 0.0 else diff / scale


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def launch_gaps_us(
    ms: Mapping[str, float], busy: Mapping[str, float], launches: Mapping[str, float]
) -> dict[str, float]:
    """Per variant with all three, the GPU's idle microseconds per launch within a
    step: ``(ms - busy) / launches``. For a graph replay this is the device's gap
    between dependent nodes (about 0.4-0.5 us on the H200), so ``busy + launches *
    gap`` is the floor of any graph of those kernels, ours or a raw one; for an eager
    step it is mostly the host's launch cost."""
    return {
        v: round((ms[v] - busy[v]) * 1e3 / launches[v], 3)
        for v in ms
        if v in busy and launches.get(v)
    }


def guard_steps(
    steps: Mapping[str, Callable[[], object]], errors: dict[str, dict]
) -> dict[str, Callable[[], None]]:
    """Steps that record their first exception in ``errors`` (by name) and do
    nothing from then on, so one failing variant does not end the others' rounds.
    Every step pays the same wrapper; the failed one's samples are dropped."""

    def guarded(name: str, step: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            if name in errors:
                return
            try:
                step()
            except Exception as exc:
                errors[name] = describe_error(exc)

        return run

    return {name: guarded(name, step) for name, step in steps.items()}


def fresh_kernel_busy(
    build: Callable[[], object],
    release: Callable[[object], None],
    *,
    iters: int,
    warmup: int,
) -> dict:
    """A variant's own kernel-busy time and launches per step, on a fresh build
    (``build()`` returns an object with a ``step``; ``release`` frees it):
    ``{"kernel_busy_ms", "kernels_per_step", "heaviest_kernels"}`` (the latter a list
    of ``{"name", "ms", "launches"}`` per step, longest first), or
    ``{"kernel_busy_error", ...}`` when building or profiling fails. Memory is freed
    before returning, so the next variant starts clean."""
    try:
        built = build()
    except Exception as exc:
        return {"kernel_busy_error": describe_error(exc)}
    try:
        activity = kernel_activity(built.step, iters=iters, warmup=warmup)
        return {
            "kernel_busy_ms": round(activity.busy_ms, 4),
            "kernels_per_step": round(activity.launches, 1),
            "heaviest_kernels": [
                {"name": name[:120], "ms": round(ms, 4), "launches": round(n, 1)}
                for name, ms, n in activity.heaviest
            ],
        }
    except Exception as exc:
        return {"kernel_busy_error": describe_error(exc)}
    finally:
        release(built)
        del built
        free_memory()
