"""Hugging Face causal LMs generating through the bucketed runner (the ``hf`` extra).

:class:`GraphedGenerator` prefills into one static KV cache shared by every bucket
(eagerly, or from a graph per rows and prompt-length bucket: :mod:`.prefill`) and
replays a captured decode step per token; with the model's kernels and eager prefills
(the default without ``compile_options``) greedy tokens equal HF's static-cache
``generate`` (compilation off) at the same batch size.
"""

from ...errors import MissingDependencyError

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - the hf extra brings it
    raise MissingDependencyError(
        "cudagraphs.serving.hf needs transformers. Fix: pip install 'cudagraphs[hf]'"
    ) from exc

from .attention import COMPILED_SDPA_BACKENDS
from .cache import LayerShape, SharedStaticCache
from .generator import DEFAULT_GENERATE_BATCH_SIZES, GraphedGenerator
from .prefill import DEFAULT_PREFILL_TOKENS, default_prefill_lengths
from .requests import Request, check_request, positions_from_mask
from .sampling import Sampling, StopTokens, stop_tokens
from .support import check_supported

__all__ = [
    "COMPILED_SDPA_BACKENDS",
    "DEFAULT_GENERATE_BATCH_SIZES",
    "DEFAULT_PREFILL_TOKENS",
    "GraphedGenerator",
    "LayerShape",
    "Request",
    "Sampling",
    "SharedStaticCache",
    "StopTokens",
    "check_request",
    "check_supported",
    "default_prefill_lengths",
    "positions_from_mask",
    "stop_tokens",
]
