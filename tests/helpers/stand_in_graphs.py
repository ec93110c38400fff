"""EntryGraphs over stand-in graphs, for CPU tests of the replay path: objects with
``replay()``/``reset()`` that write what a captured graph would, into the same static
buffers."""

from torch.utils import _pytree as pytree

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
