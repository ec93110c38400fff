"""MoE experts and CUDA graphs: which experts implementation a Hugging Face model has in
effect, whether torch runs its grouped GEMM without a host sync, and the refusal every
layer raises when it does not.

transformers (5.x) dispatches each experts module's forward on
``experts.config._experts_implementation`` at every call
(``integrations/moe.py``, ``use_experts_implementation``): ``"grouped_mm"`` and
``"batched_mm"`` compute with fixed-size buffers and the per-expert offsets on the
device; ``"eager"`` loops in Python over the experts hit (``nonzero()``: a host sync
and a shape that changes every step). :func:`experts_implementation` reads that value
duck-typed; transformers is never imported.

``grouped_mm`` experts call ``torch._grouped_mm`` with the offsets on the device. torch
has a grouped-GEMM kernel only for some dtypes on some GPUs (torch 2.11: bfloat16 on
compute capability 9.x and 10.x); for anything else it falls back to a loop of plain
matmuls that first copies the offsets to the host (``offs.cpu()``). That copy is a
synchronizing device-to-host transfer: eager runs it fine, a capture fails on it
("Cannot copy between CPU and CUDA tensors during CUDA graph capture"). The same model
is therefore graph-safe in bfloat16 and not in float32.

The lists of dtypes and GPUs change between torch releases, so the fact is asked of
torch, not written down here: :class:`GroupedMMProbe` runs one tiny grouped GEMM with
``torch.cuda.set_sync_debug_mode("error")``, under which torch raises at a
synchronizing copy instead of performing it. No graph is captured and no model tensor
is touched. Weights off CUDA raise no capture question and count as on the device, so
CPU-only paths never probe.

:func:`find_host_grouped_mm` scans module trees for experts that would sync;
:func:`check_grouped_mm_experts` turns a finding into an
:class:`~cudagraphs.errors.UnsupportedModelError` naming the modules and the fixes. The
partial-graph scopes, ``make_graphed_callables`` (and ``graph_stack``),
``graph_train_step`` and the HF generator all read these facts from here.

What this module does NOT do: it switches no implementation (the callers that can,
do: the generator for its decode steps, the partial-graph manager on request), finds
no routers or blocks (:mod:`cudagraphs.partial.discovery` does), and probes nothing but
``torch._grouped_mm``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import UnsupportedModelError

__all__ = [
    "BATCHED_MM",
    "GROUPED_MM",
    "STATIC_EXPERTS",
    "GroupedMMProbe",
    "HostGroupedMM",
    "check_grouped_mm_experts",
    "experts_implementation",
    "experts_weight",
    "find_host_grouped_mm",
    "grouped_mm_refusal",
    "grouped_mm_syncs",
    "host_grouped_mm_message",
    "static_experts",
]

logger = logging.getLogger(__name__)

GROUPED_MM = "grouped_mm"
BATCHED_MM = "batched_mm"
#: The experts implementations with static shapes and the routing on the device.
STATIC_EXPERTS = (GROUPED_MM, BATCHED_MM)
_EXPERTS_CHILD = "experts"
_IMPLEMENTATION = "_experts_implementation"
# The probe's problem: 2 groups of 8 rows, 16 x 16 weights. Dimensions are multiples
# of 16 bytes in every dtype the kernels take (their alignment rule), so a refusal is
# about the dtype or the GPU, never about this shape.
_ROWS, _DIM, _GROUPS = 16, 16, 2
_SHOWN = 4  # module paths named in a refusal before "and N more"


# ---- which implementation is in effect --------------------------------------------------
def experts_implementation(moe_module: nn.Module, model: nn.Module) -> str | None:
    """The experts implementation the model says is in effect for ``moe_module``'s
    experts: the ``config._experts_implementation`` of its ``experts`` child when that
    child has a config stating one (transformers dispatches on exactly that), else of
    the nearest enclosing module of ``model`` whose config states one. A dict value is
    keyed by sub-config name, ``""`` for the main config. Read duck-typed; transformers
    is never imported. A checkpoint-wrapped module forwards ``config`` to the module it
    wraps, so wrappers change nothing here.

    Args:
        moe_module: the MoE sublayer (borrowed), or an experts module itself.
        model: the model part that holds it (borrowed), searched for enclosing configs.

    Returns:
        The implementation's name, or ``None`` when nothing states one (user models).
    """
    experts = dict(moe_module.named_children()).get(_EXPERTS_CHILD)
    own = getattr(experts, "config", None)
    if own is not None and hasattr(own, _IMPLEMENTATION):
        return _stated(own, lambda: _configs_above(model, moe_module))
    configs = _configs_above(model, moe_module)
    return _stated(configs[0], lambda: configs[1:]) if configs else None


def static_experts(implementation: str | None) -> bool:
    """Whether experts computed by ``implementation`` keep static shapes with their
    routing on the device (:data:`STATIC_EXPERTS`). ``"eager"``, ``None`` and any name
    not known here are not."""
    return isinstance(implementation, str) and implementation in STATIC_EXPERTS


def _stated(config: Any, outer: Callable[[], list[Any]]) -> str | None:
    value = getattr(config, _IMPLEMENTATION)  # callers pass configs that have it
    if isinstance(value, Mapping):
        value = value.get(_subconfig_key(config, outer()))
    return value if isinstance(value, str) and value else None


def _subconfig_key(config: Any, outer: list[Any]) -> str:
    # A sub-config's entry sits under the attribute name an enclosing config keeps it
    # at (transformers' sub_configs); the main config's entry is "".
    for parent in outer:
        for key in getattr(parent, "sub_configs", None) or ():
            if isinstance(key, str) and getattr(parent, key, None) is config:
                return key
    return ""


def _configs_above(model: nn.Module, module: nn.Module) -> list[Any]:
    """The distinct configs stating an experts implementation on ``module`` and the
    modules above it in ``model``, nearest first."""
    out: list[Any] = []
    for m in reversed(_path_to(model, module)):
        config = getattr(m, "config", None)
        if hasattr(config, _IMPLEMENTATION) and all(config is not c for c in out):
            out.append(config)
    return out


def _path_to(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    stack: list[tuple[nn.Module, tuple[nn.Module, ...]]] = [(root, (root,))]
    while stack:
        module, path = stack.pop()
        if module is target:
            return list(path)
        stack.extend((child, (*path, child)) for child in module.children())
    return [target]


def experts_weight(moe_module: nn.Module) -> torch.Tensor | None:
    """The first floating-point parameter of ``moe_module``'s ``experts`` child (of
    ``moe_module`` itself when it has none): the dtype and device the experts' GEMMs
    run in, since transformers casts the activations to the weights' dtype. ``None``
    when there is no such parameter. Borrows."""
    experts = getattr(moe_module, _EXPERTS_CHILD, None)
    owner = experts if isinstance(experts, nn.Module) else moe_module
    for p in owner.parameters():
        if p.is_floating_point():
            return p
    return None


# ---- whether torch's grouped GEMM stays on the device -----------------------------------
class GroupedMMProbe:
    """Asks torch, once per (dtype, device), whether ``torch._grouped_mm`` runs without
    a host sync. One probe serves one pass over a model; it holds only its answers."""

    def __init__(self) -> None:
        self._known: dict[tuple[torch.dtype, torch.device], bool] = {}

    def on_device(self, weight: torch.Tensor | None) -> bool:
        """Whether grouped GEMMs with ``weight``'s dtype keep their offsets on
        ``weight``'s device. ``True`` for no weight and for weights off CUDA (no
        capture is asked of them); ``False`` when torch has no ``_grouped_mm`` or the
        op fails for this dtype (it cannot be captured either)."""
        if weight is None or weight.device.type != "cuda":
            return True
        key = (weight.dtype, weight.device)
        if key not in self._known:
            self._known[key] = _runs_on_device(*key)
            logger.debug(
                "grouped GEMM in %s on %s %s its offsets on the device",
                key[0],
                key[1],
                "keeps" if self._known[key] else "does not keep",
            )
        return self._known[key]


def _runs_on_device(dtype: torch.dtype, device: torch.device) -> bool:
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return False
    # Built before the debug mode is on: making offs is itself a host-to-device copy.
    a = torch.zeros(_ROWS, _DIM, dtype=dtype, device=device)
    b = torch.zeros(_GROUPS, _DIM, _DIM, dtype=dtype, device=device)
    offs = torch.arange(1, _GROUPS + 1, dtype=torch.int32, device=device) * (_ROWS // _GROUPS)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        prior = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            grouped_mm(a, b.transpose(-2, -1), offs=offs)
            return True
        except RuntimeError as exc:
            logger.debug("grouped GEMM probe in %s on %s: %s", dtype, device, exc)
            return False
        finally:
            torch.cuda.set_sync_debug_mode(prior)


# ---- the scan and the refusal -------------------------------------------------------------
def grouped_mm_syncs(implementation: str | None, on_device: bool) -> bool:
    """The rule: experts sync the host inside a capture exactly when ``grouped_mm`` is
    in effect and torch's grouped GEMM does not keep the offsets on the device for the
    weights' dtype there (``on_device``, :meth:`GroupedMMProbe.on_device`: ``True`` off
    CUDA). ``batched_mm`` never syncs; ``eager`` experts are another problem (host-side
    shapes), not this one."""
    return implementation == GROUPED_MM and not on_device


@dataclass(frozen=True)
class HostGroupedMM:
    """One experts module whose grouped GEMM would sync the host."""

    path: str  # qualified name of the experts module, prefixed by its root's name
    dtype: torch.dtype
    device: torch.device


def find_host_grouped_mm(
    roots: Iterable[tuple[str, nn.Module]], probe: GroupedMMProbe | None = None
) -> list[HostGroupedMM]:
    """The experts modules in ``roots`` (``(name, module)`` pairs, the name prefixing
    the paths) that :func:`grouped_mm_syncs`: each module holding an ``experts`` child,
    and a root that is an experts module itself (its own config states an
    implementation and it has ``num_experts``). An experts module reached twice is
    reported once. The probe runs only for ``grouped_mm`` experts with CUDA weights
    (``probe``: a fresh one when ``None``). Borrows everything; modifies nothing."""
    probe = probe or GroupedMMProbe()
    found: list[HostGroupedMM] = []
    seen: set[int] = set()
    for root_name, root in roots:
        for path, moe in _experts_sites(root_name, root):
            weight = experts_weight(moe)
            if weight is None or id(weight) in seen:
                continue
            seen.add(id(weight))
            implementation = experts_implementation(moe, root)
            if implementation != GROUPED_MM:  # cheap: no question asked of torch
                continue
            if grouped_mm_syncs(implementation, probe.on_device(weight)):
                found.append(HostGroupedMM(path, weight.dtype, weight.device))
    return found


def _experts_sites(root_name: str, root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path of the experts module, module to read it through)`` in ``root``."""
    sites = []
    for name, module in root.named_modules():
        if isinstance(dict(module.named_children()).get(_EXPERTS_CHILD), nn.Module):
            sites.append((_join(root_name, name, _EXPERTS_CHILD), module))
    if not sites and _is_experts(root):
        sites.append((root_name, root))
    return sites


def _is_experts(module: nn.Module) -> bool:
    # What transformers' experts forwards read: their own config's implementation and
    # num_experts (integrations/moe.py).
    config = getattr(module, "config", None)
    return hasattr(config, _IMPLEMENTATION) and isinstance(
        getattr(module, "num_experts", None), int
    )


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def host_grouped_mm_message(
    found: list[HostGroupedMM], where: str, *, bfloat16_on_device: bool = True, note: str = ""
) -> str:
    """The refusal's text: what (the experts and their dtype), where (``where``, then
    the module paths), why, and the numbered fixes, then ``note``. ``bfloat16_on_device``:
    whether torch's bfloat16 grouped GEMM stays on the device there (else the bfloat16
    fix is left out: it would not help on this GPU)."""
    assert found, "a refusal names at least one experts module"
    paths = [f.path for f in found]
    shown = ", ".join(paths[:_SHOWN]) + (
        f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else ""
    )
    kinds = ", ".join(
        sorted({f"{str(f.dtype).removeprefix('torch.')} on {f.device}" for f in found})
    )
    fixes = [
        "the batched_mm experts (static shapes in any dtype): from_pretrained(..., "
        'experts_implementation="batched_mm") (from_config takes it too), or '
        'model.set_experts_implementation("batched_mm") on the loaded model, before graphing'
    ]
    if bfloat16_on_device:
        fixes.insert(
            0,
            "bfloat16 weights (from_pretrained(..., dtype=torch.bfloat16), or "
            "model.to(torch.bfloat16)), which torch's grouped GEMM runs on the device here",
        )
    numbered = "; ".join(f"{i}. {fix}" for i, fix in enumerate(fixes, 1))
    return (
        f"{where}: the MoE experts at {shown} run transformers' grouped_mm implementation "
        f"({kinds}), and torch has no grouped-GEMM kernel for that dtype on this GPU: "
        "torch._grouped_mm falls back to one matmul per expert after copying the expert "
        "offsets to the host, a synchronizing copy that a CUDA graph capture cannot hold "
        "(it fails with 'Cannot copy between CPU and CUDA tensors'). Fixes: "
        + numbered
        + (note or ".")
    )


def check_grouped_mm_experts(
    roots: Iterable[tuple[str, nn.Module]], where: str, probe: GroupedMMProbe | None = None
) -> None:
    """Refuse, before any capture, experts in ``roots`` whose grouped GEMM would sync
    the host (:func:`find_host_grouped_mm`). Cheap where nothing runs ``grouped_mm`` on
    CUDA weights: no question is asked of torch then.

    Args:
        roots: ``(name, module)`` pairs to scan (borrowed); the name prefixes paths.
        where: the caller, as the message's first words (``"make_graphed_callables"``).
        probe: answers about torch's grouped GEMM (a fresh one when ``None``).

    Raises:
        UnsupportedModelError: naming every such experts module, the cause and the
            fixes (bfloat16 weights where that helps; the batched_mm experts).
    """
    probe = probe or GroupedMMProbe()
    found = find_host_grouped_mm(roots, probe)
    if found:
        raise grouped_mm_refusal(found, where, probe)


def grouped_mm_refusal(
    found: list[HostGroupedMM], where: str, probe: GroupedMMProbe, note: str = ""
) -> UnsupportedModelError:
    """The error for ``found`` (:func:`host_grouped_mm_message`), the bfloat16 fix
    offered where ``probe`` says torch's bfloat16 grouped GEMM stays on the device."""
    bfloat16 = all(
        probe.on_device(torch.empty(0, dtype=torch.bfloat16, device=f.device)) for f in found
    )
    return UnsupportedModelError(
        host_grouped_mm_message(found, where, bfloat16_on_device=bfloat16, note=note)
    )
