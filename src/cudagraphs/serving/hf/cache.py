"""One static KV cache shared by every bucket of a generator.

HF's ``StaticCache`` allocates its keys and values lazily at the batch size of its first
call, so a cache per bucket would hold the sum of all buckets' rows. Instead the keys
and values of every layer are allocated once, ``[max_rows, heads, max_cache_len,
head_dim]``, and each bucket (and each prefill) gets a ``StaticCache`` whose layers are
bound to the leading rows of that storage: a slice of the batch dimension of a
contiguous tensor, itself contiguous. All of them share one write counter per layer
(HF's ``cumulative_length``, a device tensor that each update reads and advances), so a
decode graph writes at the position the prefill reached, and replays advance it on the
device with no host work. Resetting a request is zeroing the counters: positions a
previous request wrote past the current length are hidden by the causal mask, and rows
of other requests are never read.

This binds HF's ``StaticLayer`` the way its own lazy initialization does (the same
attributes), and the GPU and CPU tests run against the transformers versions we support.

Sliding-window layers (Mistral, Gemma 2 and 3, Qwen2 with its window on) are bound as
full-length ``StaticLayer`` s too. HF's ``StaticSlidingWindowLayer`` keeps only the
window and decides how to write by a Python count of the tokens seen (roll once full,
write in place before), a branch a graph would freeze at its capture. Here every
position keeps its own slot, and the window is the mask's work: HF builds a
sliding-window layer's mask from absolute positions (key ``k`` is seen from query
``q`` when ``q - window < k <= q``), sized by the first layer of the cache, which is
then a full-length one. The attention reads the same keys as HF's and the tokens
equal its static-cache ``generate`` (CPU tests, and a GPU test in fp32, with windows
shorter than the request); the price is memory, the full ``max_cache_len`` for those
layers as well.
Chunked attention (Llama 4) and linear-attention layers are refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CudaGraphsValueError, UnsupportedModelError
from ...torch_private import mark_dynamic

__all__ = ["LayerShape", "SharedStaticCache", "cache_keyword", "layer_shapes", "static_layer_check"]

#: The attention layer types (``config.layer_types``) the shared cache binds.
BOUND_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerShape:
    """What one layer's cache holds per row and position: heads, key and value widths and
    the dtype."""

    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype


def cache_keyword(model: Any) -> str:
    """The keyword the model's forward takes its cache under: ``cache`` (transformers
    5.24 and later) or ``past_key_values`` (earlier).

    Raises:
        UnsupportedModelError: the forward takes neither.
    """
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UnsupportedModelError(
        f"{type(model).__name__}.forward takes no cache (neither 'cache' nor "
        "'past_key_values'): it cannot decode from a static KV cache"
    )


def static_layer_check(model: Any, max_cache_len: int) -> int:
    """The number of cache layers of the model's ``StaticCache``, checked to be all
    full-attention or sliding-window layers.

    Raises:
        UnsupportedModelError: layers of another kind (chunked attention, linear
            attention, quantized), naming them.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    kinds = {
        type(layer).__name__
        for layer in cache.layers
        if type(layer) not in (StaticLayer, StaticSlidingWindowLayer)
    }
    # Chunked attention shares the sliding layer's class: the config tells them apart
    # (its decoder's text config, where StaticCache itself reads the layer types).
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
    kinds |= {kind for kind in types if kind not in BOUND_LAYER_TYPES}
    if kinds:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s static cache has layers of kind {sorted(kinds)}; the "
            "graphed generator supports full-attention and sliding-window layers only (no "
            "chunked or linear-attention layers). Use model.generate for this model."
        )
    return len(cache.layers)


def layer_shapes(model: Any, keyword: str) -> list[LayerShape]:
    """Each cache layer's shape, read off one eager step of one token into a
    ``DynamicCache`` (whatever the attention: grouped heads, different key and value
    widths)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            use_cache=True,
            **{keyword: cache},
        )
    shapes = []
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        shapes.append(LayerShape(keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype))
    return shapes


class SharedStaticCache:
    """Keys and values of every layer at ``max_rows`` rows and ``max_cache_len``
    positions, with one write counter per layer, and ``StaticCache`` objects over the
    leading rows (made once per row count).

    Args:
        model: the HF model (its config builds the ``StaticCache`` objects).
        shapes: per layer, what :func:`layer_shapes` read.
        max_rows: rows of the storage (the largest bucket, or a larger request).
        max_cache_len: positions of the storage.
        device: where the storage lives.
        dynamic_rows: mark the row dimension of every view of two rows or more as
            dynamic for ``torch.compile`` (:func:`~cudagraphs.torch_private.mark_dynamic`),
            so that a compiled decode step compiles once for all of them.
        spare_row: allocate one row more than ``max_rows`` (counted in :attr:`nbytes`,
            never handed out), so that no view :meth:`bind_rows` makes is the whole
            storage: at the largest bucket a whole-storage view would let the
            compiled write-back compare the batch with the storage's rows and
            specialize it to the largest bucket (torch 2.11 and 2.13 alike).
    """

    def __init__(
        self,
        model: Any,
        shapes: list[LayerShape],
        max_rows: int,
        max_cache_len: int,
        device: torch.device,
        dynamic_rows: bool = False,
        spare_row: bool = False,
    ) -> None:
        if not shapes:
            raise CudaGraphsValueError("a shared static cache needs at least one layer")
        self.config = model.config
        self.max_rows = max_rows
        self.max_cache_len = max_cache_len
        rows = max_rows + spare_row
        self.keys = [
            torch.zeros(rows, s.heads, max_cache_len, s.key_dim, dtype=s.dtype, device=device)
            for s in shapes
        ]
        self.values = [
            torch.zeros(rows, s.heads, max_cache_len, s.value_dim, dtype=s.dtype, device=device)
            for s in shapes
        ]
        self.counters = [torch.zeros((), dtype=torch.long, device=device) for _ in shapes]
        self.dynamic_rows = dynamic_rows
        self._caches: dict[int, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def reset(self) -> None:
        """Start a new request: every layer writes from position 0 again."""
        # One kernel for every layer's counter (a prefill graph records it).
        torch._foreach_zero_(self.counters)

    def cache_for(self, rows: int) -> Any:
        """A ``StaticCache`` over the leading ``rows`` rows (the same object for every
        call with ``rows``: its tensors are the storage's, so graphs may hold them).

        Raises:
            CudaGraphsValueError: more rows than the storage holds.
        """
        cache = self._caches.get(rows)
        if cache is None:
            if not 1 <= rows <= self.max_rows:
                raise CudaGraphsValueError(
                    f"a cache of {rows} rows was asked of storage with {self.max_rows} rows"
                )
            cache = self._caches[rows] = self._bind(rows)
        return cache

    def mark_rows_dynamic(self) -> None:
        """Mark the row dimension of every view made so far (of two rows or more) as
        dynamic, as ``dynamic_rows`` would have at their making; later views are marked
        too."""
        self.dynamic_rows = True
        for rows, cache in self._caches.items():
            if rows > 1:
                for layer in cache.layers:
                    mark_dynamic(layer.keys, 0)
                    mark_dynamic(layer.values, 0)

    def bind_rows(self, cache: Any, rows: int) -> None:
        """Point every layer of ``cache`` (one of :meth:`cache_for`'s) at the leading
        ``rows`` rows of the storage again. Called inside a compiled decode step whose
        layers share one compiled body (:mod:`.regions`): there every layer's keys and
        values become slices of one static tensor by the step's own batch size, so
        dynamo gives all of them the batch's symbol, where views marked dynamic would
        each bring a symbol of their own and no two layers would trace alike."""
        # A view of ``rows`` rows with the storage's strides: a slice's length,
        # min(rows, storage rows), is a data-dependent size on torch 2.11. The storage
        # has a spare row (spare_row) so that no view here is all of it.
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            layer.keys, layer.values = _leading_rows(keys, rows), _leading_rows(values, rows)

    def _bind(self, rows: int) -> Any:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        cache = StaticCache(config=self.config, max_cache_len=self.max_cache_len)
        # A sliding-window layer becomes a full-length one (module docs): its mask, not
        # its storage, keeps the window.
        cache.layers = [
            layer if type(layer) is StaticLayer else StaticLayer(max_cache_len=self.max_cache_len)
            for layer in cache.layers
        ]
        if len(cache.layers) != len(self.keys):
            raise UnsupportedModelError(
                f"the model's StaticCache has {len(cache.layers)} layers but one step filled "
                f"{len(self.keys)}; its cache layout is not one layer per attention layer"
            )
        for layer, keys, values, counter in zip(
            cache.layers, self.keys, self.values, self.counters
        ):
            keys, values = keys[:rows], values[:rows]
            # One row is a size dynamo specializes (0/1 specialization): that view is
            # compiled apart whatever the mark says.
            if self.dynamic_rows and rows > 1:
                mark_dynamic(keys, 0)
                mark_dynamic(values, 0)
            _bind_layer(layer, keys, values, counter)
        return cache


def _leading_rows(storage: torch.Tensor, rows: Any) -> torch.Tensor:
    return storage.as_strided((rows, *storage.shape[1:]), storage.stride())


def _bind_layer(
    layer: Any, keys: torch.Tensor, values: torch.Tensor, counter: torch.Tensor
) -> None:
    # What StaticLayer.lazy_initialization sets, with our storage in place of its own
    # allocation. Without its torch._dynamo.mark_static_address: that mark tells
    # inductor's CUDA-graph trees an input keeps its address, and the generator's
    # compile_options never turn those trees on (compile_watch.check_compile_options refuses
    # them); the bucket graphs record the compiled kernels over this storage directly.
    layer.keys, layer.values = keys, values
    layer.device, layer.dtype = keys.device, keys.dtype
    layer.batch_size, layer.num_heads = keys.shape[0], keys.shape[1]
    layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
    layer.cumulative_length = counter
    layer.is_initialized = True
