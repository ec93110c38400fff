"""torch's own best compiled training recipe, as the benchmarks compare ours with it.

Used as torch documents it: the model (or the function that runs it) and the
optimizer's step compiled in one mode, a device learning rate (a float one is a guard
that recompiles whenever it changes; AdamW takes a tensor with ``foreach`` only when
``capturable``), and under ``mode="reduce-overhead"`` one
``torch.compiler.cudagraph_mark_step_begin()`` per step, so that a step's outputs are
not taken for the previous one's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from _report import timed_setup

WARM_STEPS = 3  # compiles, then (reduce-overhead) warmup and recording


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
