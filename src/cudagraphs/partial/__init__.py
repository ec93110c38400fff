"""Partial graphs for training: graph the fixed-shape pieces of each transformer block
inside an otherwise eager training loop: by default each block as widely as is safe
(the whole layer, else its attention beside its MoE, router or MLP: :mod:`.scopes`),
plus modules named by ``include``.

:class:`PartialCudaGraphManager` records one eager step, captures the recorded calls
through the core ``make_graphed_callables``, and replays a later call only when it
matches the recorded contract (:class:`CallContract`: structure, tensor type, shape,
stride, dtype, device, requires_grad, aliasing, non-tensor controls, grad mode,
autocast state, training flag). Every other call runs the module eagerly: counted per
reason in ``stats()``, and the first call of each reason logged at WARNING with its
mismatch report (:meth:`CallContract.mismatches`, :class:`~cudagraphs.errors.Mismatch`
records). ``CUDAGRAPHS_DISABLE=1`` runs every target eagerly through the same path.
Parameters are explicit graph inputs: read in place, or under FSDP2 copied in at each
call (:mod:`.fsdp`). The errors this layer raises derive from
:class:`~cudagraphs.errors.CudaGraphsError`. ``cudagraphs.integrations.hf`` drives all
of this from a ``transformers.Trainer`` callback.

The modules, along the data flow (each imports only those above it in this list):

* :mod:`.vocabulary`: the words: targets, blocks, scopes, and every reason with what
  it means; :mod:`.tree`: a model's module tree as selection sees it;
  :mod:`.contract`: what a recorded call fixes and how a later call is compared.
* select: :mod:`.metadata` (what a model declares), :mod:`.discovery` (its blocks and
  their pieces), :mod:`.scopes` (which scope each block takes), :mod:`.skips` (why a
  block yields none or a narrower one), :mod:`.model_scope` (the rules of the
  ``"model"`` scope), :mod:`.arguments`, and :mod:`.planning`: :func:`plan_targets`,
  the preview of what the manager graphs, with each block skipped (a Mamba or
  linear-attention layer, say) or narrowed and the reason (:class:`SkippedBlock`,
  :class:`NarrowedBlock`).
* record: :mod:`.fsdp` (parameters under FSDP2), :mod:`.chaining` (which call reads
  another's output) and :mod:`.recording`: the recording stores
  (:class:`TargetRecording`) and the hooks that fill them over one step's forwards
  (gradient accumulation: equal contracts recorded once, new ones as variants;
  evaluation-style calls ignored or recorded as inference variants).
* capture: :mod:`.speed` (a graph slower than eager is turned off;
  ``speed_check=False`` keeps every graph) and :mod:`.graphing`.
* replay: :mod:`.replay`: each target's dispatching forward (:class:`TargetDispatcher`).
* :mod:`.build`, :mod:`.stats` and :mod:`.manager`: from model parts to one recording
  store per target, the totals, and the life cycle.

Scopes (``scopes=``) choose what is graphed per decoder layer, from the attention and
the router up to the whole MoE sublayer, a dense MLP or the whole layer; a layer that
cannot take the scope asked for (experts with host-side shapes, no attention) is
graphed at a narrower one, with the reason. Asked for by name, ``"model"``
(:data:`MODEL_SCOPE`) graphs a whole model part in one graph, its layers kept in
reserve should the part not capture.
"""

from ..errors import TargetSelectionError
from .contract import CallContract, ContractSet, FallbackCounter
from .discovery import discover_blocks, find_attention, find_moe
from .manager import PartialCudaGraphManager, TargetsBackend
from .planning import TargetPlan, model_label, plan_targets, select_targets
from .recording import TargetRecording
from .replay import PartialGraphEntry, TargetDispatcher
from .scopes import check_scopes
from .speed import SpeedCheck, SpeedVerdict
from .tree import unwrap_checkpoint
from .vocabulary import (
    MODEL_SCOPE,
    SCOPES,
    DiscoveredBlock,
    ModelScopeOff,
    NarrowedBlock,
    SkippedBlock,
    Target,
)

__all__ = [
    "MODEL_SCOPE",
    "ModelScopeOff",
    "SCOPES",
    "NarrowedBlock",
    "check_scopes",
    "TargetsBackend",
    "PartialCudaGraphManager",
    "PartialGraphEntry",
    "TargetDispatcher",
    "TargetRecording",
    "CallContract",
    "ContractSet",
    "DiscoveredBlock",
    "FallbackCounter",
    "SkippedBlock",
    "SpeedCheck",
    "SpeedVerdict",
    "Target",
    "TargetPlan",
    "TargetSelectionError",
    "discover_blocks",
    "find_attention",
    "find_moe",
    "model_label",
    "plan_targets",
    "select_targets",
    "unwrap_checkpoint",
]
