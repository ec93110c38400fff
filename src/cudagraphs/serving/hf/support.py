"""The checks of the graphed generator on the model: which HF models' decode step
cannot be one static graph (the fix for each), read before anything is allocated; and
whether the model's tensors are still those its graphs read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from torch import nn

from ...errors import CudaGraphsStateError, UnsupportedModelError
from ...moe_kernels import STATIC_EXPERTS
from ...stacking import StackedGroups

__all__ = ["WeightAddresses", "check_groups_in_place", "check_supported"]


def check_groups_in_place(stacked: StackedGroups) -> None:
    """Raises:
    CudaGraphsStateError: a grouped weight replaced since its projection group was
        laid (naming up to three): the decode step reads the group's buffer, which
        holds the old weight.
    """
    moved = stacked.moved()
    if not moved:
        return
    shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
    raise CudaGraphsStateError(
        f"GraphedGenerator.generate(): {shown} were replaced since capture() laid their "
        "projection groups back to back (stack_projections), e.g. by "
        "load_state_dict(assign=True) or a new module; the decode step reads the groups' "
        "buffers, which hold the old weights. Fix: update weights in place "
        "(load_state_dict() without assign, param.data.copy_()), or close() and "
        "capture() again."
    )


def check_supported(model: nn.Module) -> None:
    """Refuse models whose decode step cannot be one static graph (the fix named).

    Raises:
        UnsupportedModelError: encoder-decoder, stateful (recurrent state outside the
            KV cache), not marked graph-safe by HF (``_can_compile_fullgraph``), or MoE
            experts whose implementation has host-side shapes.
    """
    config, name = model.config, type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; the graphed generator serves decoder-only "
            "causal LMs"
        )
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} keeps recurrent state outside a KV cache; it has no static cache to "
            "decode from. Use model.generate"
        )
    if not getattr(model, "_can_compile_fullgraph", False):
        raise UnsupportedModelError(
            f"{name} does not support a static cache (transformers marks it "
            "_can_compile_fullgraph=False: its forward is not graph-safe). Use "
            "model.generate"
        )
    has_experts = any(hasattr(module, "experts") for module in model.modules())
    implementation = getattr(config, "_experts_implementation", None)
    if has_experts and isinstance(implementation, str) and implementation not in STATIC_EXPERTS:
        raise UnsupportedModelError(
            f"{name}'s MoE experts use the {implementation!r} implementation, which loops "
            "over the experts hit with host-side shapes and cannot be captured. Fix: "
            "model.set_experts_implementation('grouped_mm') (or build the model with "
            "experts_implementation='grouped_mm')"
        )


@dataclass(frozen=True)
class TensorSlots:
    """Every module's ``_parameters``, ``_buffers`` and ``_modules`` entries as they were
    (the very objects), and each tensor's data pointer: a snapshot of the model that
    says in one pass, without building a name, whether anything it holds was replaced.

    Why: a request compares the model with its capture, before its first kernel is
    queued. ``named_parameters()`` builds every dotted name through generators and a
    memo set: for a 16-layer Llama on a 2-core CPU host, 0.52 ms a request against
    0.12 ms for reading the same dicts entry by entry
    (``tests/serving/test_hf_weight_addresses_cpu.py`` holds the two to the same
    verdicts). A slot
    that differs says only that something changed, not what:
    :meth:`WeightAddresses.check` then walks the names to say which, and a change that
    kept every address (a tensor rewrapped over the same memory) passes.
    """

    modules: tuple[tuple[nn.Module, dict, dict, dict], ...]
    entries: tuple[tuple[dict, tuple[tuple[str, object], ...]], ...]
    pointers: tuple[tuple[object, int], ...]

    @classmethod
    def of(cls, model: nn.Module) -> TensorSlots:
        modules, entries, pointers = [], [], []
        for module in model.modules():
            own = vars(module)
            dicts = (own["_parameters"], own["_buffers"], own["_modules"])
            modules.append((module, *dicts))
            for d in dicts:
                entries.append((d, tuple(d.items())))
            for d in dicts[:2]:
                pointers.extend((t, t.data_ptr()) for t in d.values() if t is not None)
        return cls(tuple(modules), tuple(entries), tuple(pointers))

    def same(self) -> bool:
        """Whether every module still holds the same dicts, each the same entries (the
        same objects, in the same order), and every tensor the same data pointer."""
        for module, params, buffers, children in self.modules:
            own = vars(module)
            if (
                own["_parameters"] is not params
                or own["_buffers"] is not buffers
                or own["_modules"] is not children
            ):
                return False
        for d, items in self.entries:
            if len(d) != len(items):
                return False
            for key, value in items:
                if d.get(key, d) is not value:
                    return False
        return all(t.data_ptr() == p for t, p in self.pointers)


@dataclass
class WeightAddresses:
    """Where each parameter and buffer of the model lived when the graphs were captured.

    The graphs read the model's tensors at those addresses; a tensor replaced since
    (``model.to()``, ``load_state_dict(assign=True)``, a new tensor assigned to a
    module) leaves them reading the old memory, which is silently wrong, so each
    request compares: first :class:`TensorSlots` (one pass over the modules' own
    dicts), and only where a slot changed the named walk, which says what.
    """

    names: tuple[str, ...]
    pointers: tuple[int, ...]
    # The fast path's snapshot (None: none taken), taken again when a changed slot kept
    # every address.
    slots: TensorSlots | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, model: nn.Module) -> WeightAddresses:
        named = list(chain(model.named_parameters(), model.named_buffers()))
        return cls(
            tuple(n for n, _ in named),
            tuple(t.data_ptr() for _, t in named),
            TensorSlots.of(model),
        )

    def check(self, model: nn.Module) -> None:
        """Raises:
        CudaGraphsStateError: a parameter or buffer replaced, added or removed since
            these addresses were taken (naming up to three).
        """
        if self.slots is not None and self.slots.same():
            return
        now = WeightAddresses.of(model)
        if now.pointers == self.pointers and now.names == self.names:
            self.slots = now.slots
            return
        before = dict(zip(self.names, self.pointers))
        after = dict(zip(now.names, now.pointers))
        changed = [n for n in after if before.get(n) != after[n]]
        changed += [n for n in before if n not in after]
        shown = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise CudaGraphsStateError(
            f"GraphedGenerator.generate(): the model's tensors were replaced since capture() "
            f"({shown}), e.g. by model.to(), load_state_dict(assign=True), assigning a new "
            "tensor, or another generator's capture laying projections back to back "
            "(stack_projections); the graphs would read the old memory. Fix: update "
            "weights in place "
            "(load_state_dict() without assign, param.data.copy_()), or close() and "
            "capture() again."
        )
