"""From model parts to the targets' recording stores, the work of
:meth:`~.manager.PartialCudaGraphManager.from_model_parts` before the manager is made:
the argument checks, the experts implementation switched where asked, a plan per part
(:func:`~.planning.plan_targets`), FSDP2 detection and parameter checks per target
(:mod:`.fsdp`), one :class:`~.recording.TargetRecording` per target, and the blocks that
yield none, said on the manager's logger."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..checks import check_bool, check_callable, check_int
from ..compile_watch import check_compile_options
from ..errors import CudaGraphsTypeError, CudaGraphsValueError, TargetSelectionError
from ..torch_private import compiled_module
from .arguments import Predicate, Selector, as_model_parts, include_predicate
from .contract import ContractSet
from .fsdp import check_target_parameters, fsdp_managed_modules
from .graphing import TargetsBackend
from .model_scope import fsdp_refusal
from .planning import plan_targets, why_nothing_found
from .recording import InferenceCalls, TargetRecording, check_inference_calls
from .scopes import requested_scopes
from .speed import SpeedCheck, speed_check_of
from .vocabulary import MODEL_KIND, ModelScopeOff, NarrowedBlock, SkippedBlock

__all__ = [
    "BuiltTargets",
    "build_recordings",
    "recordings_from_model_parts",
    "refuse_compiled_parts",
    "report_blocks",
    "switch_experts_implementation",
]


@dataclass
class BuiltTargets:
    """What planning gave over all parts: one recording store per target, in part and
    module order, and every block skipped or narrowed (with its reason)."""

    recordings: list[TargetRecording] = field(default_factory=list)
    skipped: list[SkippedBlock] = field(default_factory=list)
    narrowed: list[NarrowedBlock] = field(default_factory=list)
    # The parts not graphed whole although the "model" scope was asked for.
    model_off: list[ModelScopeOff] = field(default_factory=list)


def build_recordings(
    parts: Sequence[nn.Module],
    *,
    include: Predicate | None,
    max_variants: int,
    scopes: Sequence[str] | None = None,
) -> BuiltTargets:
    """One recording store per target of every part.

    Raises:
        TargetSelectionError: a module that is a target in two parts (one graph cannot
            stand for both calls), or what :func:`~.planning.plan_targets` and
            :func:`~.fsdp.check_target_parameters` raise.
        CudaGraphsValueError: meta-device parameters in a target.
    """
    out, seen = BuiltTargets(), {}
    for part in parts:
        sharded = fsdp_managed_modules(part)
        plan = plan_targets(part, include=include, scopes=scopes)
        out.skipped += plan.skipped
        out.narrowed += plan.narrowed
        targets = plan.targets
        if plan.model_off is not None:
            out.model_off.append(plan.model_off)
        elif sharded and targets and targets[0].kind == MODEL_KIND:
            out.model_off.append(fsdp_refusal(part))
            targets = targets[1:]
        for target in targets:
            if id(target.module) in seen:
                raise TargetSelectionError(
                    f"{target.name} is the same module as {seen[id(target.module)]} in "
                    "another model part; one graph cannot stand for both calls. Fix: "
                    "leave it out of the targets of one part."
                )
            seen[id(target.module)] = target.name
            fsdp = id(target.module) in sharded
            params = check_target_parameters(target, fsdp)
            out.recordings.append(
                TargetRecording(
                    target=target,
                    contracts=ContractSet(max_variants),
                    param_names=tuple(n for n, _ in params),
                    fsdp=fsdp,
                )
            )
    return out


def switch_experts_implementation(parts: Sequence[nn.Module], implementation: str) -> list[str]:
    """Switch every Hugging Face model in ``parts`` to the MoE experts implementation
    ``implementation`` with the model's own ``set_experts_implementation`` (the
    outermost module of each subtree that has the method); returns their names.

    Why here: graph-safety of an MoE block depends on its experts implementation
    (``grouped_mm`` / ``batched_mm`` keep shapes static; ``eager`` loops over experts
    with host-side shapes), and discovery reads the implementation in effect, so the
    switch must happen before targets are chosen.

    Raises:
        CudaGraphsTypeError: ``implementation`` is not a str.
        CudaGraphsValueError: no module in ``parts`` has ``set_experts_implementation``
            (not a transformers 5 MoE model), or the model refused the value (its
            message is chained).
    """
    if not isinstance(implementation, str):
        raise CudaGraphsTypeError(
            "experts_implementation must be a str such as 'grouped_mm', got "
            f"{type(implementation).__name__} {implementation!r}"
        )
    switched = []
    for part in parts:
        stack = [("", part)]
        while stack:
            name, module = stack.pop()
            setter = getattr(module, "set_experts_implementation", None)
            if callable(setter):
                try:
                    setter(implementation)
                except Exception as exc:
                    raise CudaGraphsValueError(
                        f"{name or type(module).__name__} refused experts_implementation="
                        f"{implementation!r}: {exc}. Fix: pass an implementation the "
                        "installed transformers supports ('grouped_mm', 'batched_mm')."
                    ) from exc
                switched.append(name or type(module).__name__)
                continue  # the model switches its own submodels
            stack += [(f"{name}.{n}" if name else n, c) for n, c in module.named_children()]
    if not switched:
        raise CudaGraphsValueError(
            f"experts_implementation={implementation!r} was given, but no module in the "
            "model parts has set_experts_implementation (a transformers 5 MoE model "
            "does). Fix: leave experts_implementation out for this model."
        )
    return switched


def report_blocks(
    built: BuiltTargets, logger: logging.Logger, narrowed_level: int = logging.WARNING
) -> None:
    """Say, once each, which blocks run eagerly (skipped, at WARNING), which are
    graphed at narrower scopes than asked for and which parts are not graphed whole
    though asked (both at ``narrowed_level``), with the reason and the fix of each."""
    for blocks, what, key, level in (
        (
            built.skipped,
            "hold nothing graph-safe of the kinds asked for and run eagerly",
            "skipped",
            logging.WARNING,
        ),
        (
            built.narrowed,
            "are graphed at narrower scopes than asked for",
            "narrowed",
            narrowed_level,
        ),
    ):
        if blocks:
            logger.log(
                level,
                "partial graphs: %d block(s) %s (counted in stats()['%s_<reason>']):\n  %s",
                len(blocks),
                what,
                key,
                "\n  ".join(f"{b.name} ({b.block_type}): {b.detail}" for b in blocks),
            )
    for off in built.model_off:
        logger.log(
            narrowed_level,
            "partial graphs: %s is not graphed whole (stats()['model_refused_%s']): %s",
            off.part,
            off.reason,
            off.detail,
        )


def refuse_compiled_parts(parts: Sequence[nn.Module]) -> None:
    """Refuse model parts that are compiled, or hold a compiled module.

    Why: a target's graph is replayed by the dispatching ``forward`` installed on it, in
    Python. A compiled part (``torch.compile(model)``) or a compiled module in it
    (``module.compile()``) would have dynamo trace those dispatchers into its own
    graphs, breaking them at each replay, or compile the eager forward around them.

    Raises:
        CudaGraphsValueError: naming each compiled module, how it was compiled, and
            the fix.
    """
    found = [
        f"model part {i}{'' if not name else ' ' + repr(name)} ({how})"
        for i, part in enumerate(parts)
        for name, module in part.named_modules()
        if (how := compiled_module(module)) is not None
    ]
    if found:
        raise CudaGraphsValueError(
            f"from_model_parts: compiled modules in the model parts: {'; '.join(found)}. "
            "A compiled model would "
            "trace the partial graphs' dispatching forwards into its own code. Fix: "
            "pass the model uncompiled (the module given to torch.compile, not its "
            "wrapper; no module.compile()) with compile_options={} (or the keywords "
            "you gave torch.compile): each target's graph then records its compiled "
            "forward and backward."
        )


def recordings_from_model_parts(
    model_parts: nn.Module | Sequence[nn.Module],
    *,
    activation_checkpointing: bool,
    include: Selector | None,
    max_variants: int,
    capture_backend: TargetsBackend | None,
    inference_calls: InferenceCalls,
    speed_check: bool | SpeedCheck,
    experts_implementation: str | None,
    scopes: Sequence[str] | None,
    logger: logging.Logger,
    compile_options: Mapping[str, Any] | None = None,
) -> tuple[list[nn.Module], BuiltTargets] | None:
    """The work of :meth:`~.manager.PartialCudaGraphManager.from_model_parts` before
    the manager is made (its docs describe the arguments): check them, switch the
    experts implementation, build the recording stores, and say on ``logger`` what was
    found.

    Returns:
        The model parts as a list and what was built, or ``None`` when nothing is
        graphable (said at WARNING).

    Raises:
        What ``from_model_parts`` documents.
    """
    parts = as_model_parts(model_parts)
    check_compile_options("from_model_parts", compile_options)
    refuse_compiled_parts(parts)
    check_bool("activation_checkpointing", activation_checkpointing)
    max_variants = check_int("max_variants", max_variants, minimum=1)
    check_inference_calls(inference_calls)
    speed_check_of(speed_check)
    if experts_implementation is not None:
        switched = switch_experts_implementation(parts, experts_implementation)
        logger.info(
            "partial graphs: experts implementation of %s set to %r",
            switched,
            experts_implementation,
        )
    if capture_backend is not None:
        check_callable("capture_backend", capture_backend)
    asked = scopes is not None
    requested = requested_scopes(scopes)
    built = build_recordings(
        parts, include=include_predicate(include), max_variants=max_variants, scopes=requested
    )
    recordings = built.recordings
    if not recordings:
        logger.warning(
            "partial graphs: nothing graphable found (%s); the model trains eagerly "
            "and from_model_parts returns None",
            why_nothing_found(parts, include=include, scopes=requested),
        )
        return None
    logger.info("partial graphs: %d target(s): %s", len(recordings), [r.name for r in recordings])
    # Narrowing is a WARNING when scopes were asked for, news (INFO) by default.
    report_blocks(built, logger, narrowed_level=logging.WARNING if asked else logging.INFO)
    return parts, built
