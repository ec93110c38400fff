"""Whole-stack capture: a sequence of layers graphed as one forward graph and one
backward graph behind one autograd node.

Graphing per layer (Transformer Engine's and torch's helpers) removes the kernel
launches but keeps, per layer and step, an autograd node, its input and incoming-
gradient copies and the per-parameter gradient hand-out. One graph pair for the whole
stack pays those once per step. The price: the stack is one unit (no eager code or
host logic between its layers, no per-layer pipeline schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..errors import CudaGraphsTypeError, CudaGraphsValueError

__all__ = ["GraphedStack", "graph_stack"]


class GraphedStack(nn.Module):
    """Runs ``layers`` one after another: the first gets the call's arguments, each
    next one the previous output (a tuple output is passed as several arguments).

    Its ``training`` flag is its layers': the stack is a module of its own, outside
    the user's model, so ``model.train()`` / ``model.eval()`` reach the layers and
    never it. Read from them, a mode switch of the model is seen at the next call (the
    graphs of the other mode are not replayed; the layers run eagerly), and layers
    left in mixed modes read as ``None``, which matches no capture."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    @property  # type: ignore[override]
    def training(self) -> bool | None:
        layers = self._modules.get("layers")
        if not layers:
            return True  # during nn.Module.__init__, before the layers are set
        modes = {layer.training for layer in layers}
        return modes.pop() if len(modes) == 1 else None

    @training.setter
    def training(self, mode: bool) -> None:
        # nn.Module.train(mode) sets this, then each child's flag: the layers hold it.
        pass

    def forward(self, *args: Any) -> Any:
        out = self.layers[0](*args)
        for layer in self.layers[1:]:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out


def graph_stack(layers: Sequence[nn.Module], sample_args: tuple, **options: Any) -> GraphedStack:
    """Graph ``layers`` as one unit: one forward and (in training) one backward graph.

    Args:
        layers: the modules, in call order: a list, or a model's ``nn.ModuleList`` /
            ``nn.Sequential`` of decoder blocks (its layers are graphed, one after
            another). Each takes the previous one's output; none may carry module
            hooks. A single other module is one layer.
        sample_args: the first layer's arguments, as for
            :func:`~cudagraphs.make_graphed_callables` with one callable.
        options: any keyword of :func:`~cudagraphs.make_graphed_callables` except the
            ``_order`` pipeline ones, for example ``accumulate_grads_in_graph=True``
            (with a whole stack, the step then runs no per-parameter kernel at all).

    Returns:
        A :class:`GraphedStack` whose ``forward`` replays the graphs (``reset()``
        releases them and restores the eager forward). Outputs are borrowed.

    Raises:
        CudaGraphsTypeError: ``layers`` is empty or holds something other than
            modules, an ``_order`` option or ``sample_kwargs`` was given, or
            ``sample_args`` is not a tuple.
        CudaGraphsValueError: layers in mixed training and eval modes.
    """
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        layers = list(layers)  # model.layers: its layers, one after another
    elif isinstance(layers, nn.Module):
        layers = [layers]
    elif isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise CudaGraphsTypeError(
            f"layers must be a sequence of modules (a list, an nn.ModuleList or an "
            f"nn.Sequential), got {type(layers).__name__}"
        )
    else:
        layers = list(layers)
    if not layers:
        raise CudaGraphsTypeError("graph_stack needs at least one layer")
    bad = [
        f"layers[{i}] ({type(m).__name__})"
        for i, m in enumerate(layers)
        if not isinstance(m, nn.Module)
    ]
    if bad:
        # By name: cudagraphs.stacking sits a layer above core, which imports none of it.
        stacked = any(type(m).__name__ == "StackedCompiled" for m in layers)
        fix = (
            "compile_stacked returns a wrapper, not a module: graph the whole step "
            "with graph_train_step and call it in step_fn, or pass layers that "
            "torch.compile compiled"
            if stacked
            else "Wrap functions in a module."
        )
        raise CudaGraphsTypeError(
            f"graph_stack takes nn.Module layers; got {', '.join(bad)}. {fix}"
        )
    pipeline = sorted(k for k in options if k.startswith("_"))
    if pipeline:
        raise CudaGraphsTypeError(
            f"graph_stack does not take {pipeline}: a stack has no pipeline schedule"
        )
    if not isinstance(sample_args, tuple):
        raise CudaGraphsTypeError(
            f"sample_args must be a tuple of the first layer's arguments, got "
            f"{type(sample_args).__name__}"
        )
    if len({layer.training for layer in layers}) > 1:
        evals = [i for i, layer in enumerate(layers) if not layer.training]
        raise CudaGraphsValueError(
            f"graph_stack: layers {evals} are in eval mode and the others in training "
            "mode; one graph holds one mode. Fix: model.train() or model.eval() before "
            "graphing"
        )
    if "sample_kwargs" in options:
        raise CudaGraphsTypeError(
            "graph_stack does not take sample_kwargs: the first layer gets the call's "
            "positional arguments, and each next layer the previous output. Fix: pass "
            "every argument of the first layer in sample_args"
        )
    from .api import make_graphed_callables  # api imports the runtime, which is heavier

    stack = GraphedStack(layers)
    graphed = make_graphed_callables(stack, sample_args, **options)
    assert graphed is stack  # a module with one entry is returned itself
    return stack
