"""EntryGraphs over stand-in graphs, for CPU tests of the replay path: objects with
``replay()``/``reset()`` that write what a captured graph would, into the same static
buffers."""

from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from cudagraphs.core.runtime import EntryGraphs


def positional_entry(name, x, out, fwd_graph, **fields):
    """An entry captured as ``f(x)`` (one tensor that does not require grad) returning
    ``out``; ``fields`` adds or overrides EntryGraphs fields (params, bwd_graph, ...)."""
    leaves, in_spec = pytree.tree_flatten(((x,), {}))
    _, out_spec = pytree.tree_flatten(out)
    base = dict(
        name=name,
        in_spec=in_spec,
        leaves=leaves,
        tensor_positions=(0,),
        paths=("args[0]",),
        input_meta=((x.shape, x.dtype, False),),
        static_inputs=[x],
        params=(),
        fwd_graph=fwd_graph,
        out_spec=out_spec,
        out_leaves=[out],
        out_tensor_positions=(0,),
        out_differentiable=(False,),
        positional_only=True,
    )
    return EntryGraphs(**{**base, **fields})


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched inside it (``names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class ScaleForward:
    """out = w * x, into the static output, as a replay would. ``scratch``: memory
    the forward uses for temporaries, which a graph captured later into the same pool
    may have been given for its outputs; the replay scribbles over it."""

    def __init__(self, w, x, out, scratch=None):
        self.w, self.x, self.out, self.scratch = w, x, out, scratch

    def replay(self):
        if self.scratch is not None:
            self.scratch.fill_(-1234.0)
        self.out.copy_(self.w.detach() * self.x)

    def reset(self):
        pass


class ScaleBackward:
    """d(out)/dw = x, times the incoming gradient, into the static gradient buffer."""

    def __init__(self, x, grad_out, grad_w):
        self.x, self.grad_out, self.grad_w = x, grad_out, grad_w

    def replay(self):
        self.grad_w.copy_(self.grad_out * self.x)

    def reset(self):
        pass
