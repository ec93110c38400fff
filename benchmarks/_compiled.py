"""The compiled training steps the benchmarks compare: ours (``graph_train_step`` over a
``torch.compile``d forward, :func:`ours_compiled`) and torch's own best recipe
(:func:`torch_compiled_recipe`).

torch's recipe is used as torch documents it: the model (or the function that runs it) and the
optimizer's step compiled in one mode, a device learning rate (a float one is a guard
that recompiles whenever it changes; AdamW takes a tensor with ``foreach`` only when
``capturable``), and under ``mode="reduce-overhead"`` one
``torch.compiler.cudagraph_mark_step_begin()`` per step, so that a step's outputs are
not taken for the previous one's.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import cudagraphs
from _report import timed_setup

WARM_STEPS = 3  # compiles, then (reduce-overhead) warmup and recording

# Ours compiled: graph_train_step over the torch.compile'd model (mode="default") with the
# fused optimizer (optimizer_impl="fused"), or with the optimizer step compiled too
# (optimizer_impl="compiled", which "auto" picks on a step that compiles).
# OURS_STACKED and OURS_STACKED_OPTIMIZER: the same two over cudagraphs.compile_stacked
# (each projection group one GEMM, forward and backward) in place of torch.compile.
# The targets take the fastest of those that ran, as they take torch's best recipe.
OURS_COMPILED = "cudagraphs_train_step_compiled"
OURS_COMPILED_OPTIMIZER = "cudagraphs_train_step_compiled_optimizer"
OURS_STACKED = "cudagraphs_train_step_compiled_stacked"
OURS_STACKED_OPTIMIZER = "cudagraphs_train_step_compiled_stacked_optimizer"
OURS_COMPILED_VARIANTS = (
    OURS_COMPILED,
    OURS_COMPILED_OPTIMIZER,
    OURS_STACKED,
    OURS_STACKED_OPTIMIZER,
)


def fastest(ms: Mapping[str, float], names: Iterable[str]) -> str | None:
    """The one of ``names`` with the lowest time in ``ms`` (first on a tie); ``None``
    when none of them ran."""
    ran = [n for n in names if ms.get(n) is not None]
    return min(ran, key=lambda n: ms[n]) if ran else None


# ---- inductor settings for the whole run (every compiled variant alike) ---------------


def parse_inductor_config(pairs: Sequence[str]) -> dict[str, Any]:
    """``["triton.enable_pdl=True", "combo_kernels=1"]`` as a dict of inductor config
    keys to Python values: ``True``/``False``, then ``int``, then ``float``, else the
    string. Raises ``ValueError`` naming a pair without ``=`` or with an empty key."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--inductor-config takes KEY=VALUE pairs; got {pair!r}")
        out[key] = _value(raw.strip())
    return out


def _value(raw: str) -> Any:
    if raw in ("True", "true"):
        return True
    if raw in ("False", "false"):
        return False
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


class _InductorPairs(argparse.Action):
    """Collects ``KEY=VALUE`` pairs into ``namespace.inductor`` (a dict)."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, parse_inductor_config(values))
        except ValueError as exc:
            parser.error(f"argument {option_string}: {exc}")


def add_inductor_config_argument(parser: argparse.ArgumentParser) -> None:
    """``--inductor-config KEY=VALUE ...``, parsed into ``args.inductor`` (``{}`` when
    absent)."""
    parser.add_argument(
        "--inductor-config",
        dest="inductor",
        nargs="+",
        default={},
        action=_InductorPairs,
        metavar="KEY=VALUE",
        help="inductor settings for every compiled variant of the run, e.g. "
        "triton.enable_pdl=True combo_kernels=True (recorded in settings)",
    )


@contextlib.contextmanager
def inductor_config(settings: dict[str, Any]) -> Iterator[None]:
    """Every compile inside runs with ``settings`` patched into inductor's config (an
    unknown key raises before anything runs); nothing when empty."""
    if not settings:
        yield
        return
    import torch._inductor.config as config

    with config.patch(settings):
        yield


@dataclass
class TorchRecipe:
    """One built recipe: ``compute()`` runs a step up to its ``zero_grad()`` (forward,
    loss, backward and the compiled optimizer step) and returns what the loss function
    returned; ``setup_s`` is what compiling and warming up took."""

    optimizer: torch.optim.Optimizer
    compute: Callable[[], Any]
    zero_grad: Callable[[], None]
    setup_s: float
    notes: dict = field(default_factory=dict)

    def step(self) -> Any:
        out = self.compute()
        self.zero_grad()
        return out


def torch_compiled_recipe(
    params: Iterable[torch.nn.Parameter],
    forward: Callable[..., Any],
    run: Callable[[Callable[..., Any]], Any],
    *,
    mode: str,
    lr: float,
    device: str | torch.device,
) -> TorchRecipe:
    """Compile ``forward`` and the AdamW step of ``params`` in ``mode``, warm them up,
    and return the recipe; ``run(compiled_forward)`` is one forward, loss and backward.
    On a failure torch's compile caches are reset before the error propagates."""
    graphs = mode == "reduce-overhead"
    opt = torch.optim.AdamW(
        params, lr=torch.tensor(lr, device=device), foreach=True, capturable=True
    )
    compiled = torch.compile(forward, mode=mode)
    opt_step = torch.compile(opt.step, mode=mode)

    def compute() -> Any:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = run(compiled)
        opt_step()
        return out

    def zero_grad() -> None:
        opt.zero_grad(set_to_none=True)

    def warm() -> None:
        for _ in range(WARM_STEPS):
            compute()
            zero_grad()

    try:
        _, setup_s = timed_setup(warm)
    except BaseException:
        torch.compiler.reset()
        raise
    notes = {"compile": f"forward and optimizer step, mode={mode!r}", "optimizer": "compiled"}
    return TorchRecipe(opt, compute, zero_grad, setup_s, notes)


@dataclass
class OursCompiled:
    """``graph_train_step`` over a compiled forward: ``graphed(batch)`` runs one step."""

    graphed: Any
    setup_s: float
    notes: dict

    def release(self) -> None:
        self.graphed.reset()
        torch.compiler.reset()


def ours_compiled(
    forward: Callable[..., Any],
    run: Callable[[Callable[..., Any], Any], Any],
    sample: Any,
    optimizer: torch.optim.Optimizer,
    compiled_what: str,
    optimizer_impl: str = "fused",
    stacked: bool = False,
) -> OursCompiled:
    """``graph_train_step`` of ``run(compiled_forward, batch)`` (one forward, loss and
    backward) on ``sample`` with ``optimizer`` (prepared as ``optimizer_impl`` says),
    ``forward`` compiled in ``mode="default"`` (inductor's kernels, no CUDA graphs of
    its own: ours takes their place), or with ``stacked`` by
    ``cudagraphs.compile_stacked`` (``forward`` then a module). On a failure torch's
    compile caches are reset before the error propagates."""
    compiled = cudagraphs.compile_stacked(forward) if stacked else torch.compile(forward)

    def step_fn(batch: Any) -> Any:
        return run(compiled, batch)

    try:
        graphed, setup_s = timed_setup(
            lambda: cudagraphs.graph_train_step(
                step_fn, sample, optimizer=optimizer, optimizer_impl=optimizer_impl
            )
        )
    except BaseException:
        torch.compiler.reset()
        raise
    compiled_step = "; optimizer step compiled" if graphed.optimizer_compiled else ""
    how = "cudagraphs.compile_stacked" if stacked else "torch.compile"
    notes = {
        "compile": f'{how}({compiled_what}), mode="default"{compiled_step}',
        "compile_seconds": round(graphed.stats.compile_seconds, 2),
        "optimizer": "; ".join(graphed.stats.optimizer_changes),
    }
    return OursCompiled(graphed, setup_s, notes)
