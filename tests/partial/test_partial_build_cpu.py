"""From model parts to the targets' recording stores on the CPU: argument checks, the experts switch, blocks
gathered over several parts, and the exact log lines of from_model_parts."""

import logging

import pytest
from torch import nn

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError
from cudagraphs.partial import SCOPES, PartialCudaGraphManager
from cudagraphs.partial.build import (
    BuiltTargets,
    build_recordings,
    report_blocks,
    switch_experts_implementation,
)
from cudagraphs.partial.vocabulary import NarrowedBlock, SkippedBlock
from helpers.hf_models import tiny
from helpers.toy_models import Toy

LOGGER = "cudagraphs.partial.manager"
STRUCTURE_RULE = (
    "blocks are found in a ModuleList/ModuleDict of same-typed modules that each hold an "
    "attention module"
)
FIXES = (
    "Fixes: 1. pass include= naming the modules to graph; 2. pass the model parts that "
    "hold the decoder layers"
)


def backend(callables, sample_args, sample_kwargs):
    return list(callables)


def messages(caplog, level=None):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and (level is None or r.levelno == level)
    ]


class Switchable(nn.Module):
    """A module with the transformers 5 switch; records what it was set to."""

    def __init__(self, refuse=False):
        super().__init__()
        self.refuse, self.set_to = refuse, []
        self.inner = nn.Linear(2, 2)

    def set_experts_implementation(self, implementation):
        if self.refuse:
            raise ValueError("unknown implementation")
        self.set_to.append(implementation)


# --- blocks gathered over several parts ------------------------------------------------


def test_skipped_blocks_of_every_part_are_kept():
    # DeepSeek-V3's layer 0 is dense: with scopes=("moe",) it is skipped in each part.
    parts = [tiny("deepseek_v3", seed=0), tiny("deepseek_v3", seed=1)]
    built = build_recordings(parts, include=None, max_variants=2, scopes=("moe",))
    assert [r.name for r in built.recordings] == ["model.layers.1.mlp"] * 2
    assert [(b.name, b.reason) for b in built.skipped] == [
        ("model.layers.0", "no_graph_safe_scope")
    ] * 2
    assert built.skipped[0] is not built.skipped[1] and built.narrowed == []


def test_narrowed_blocks_of_every_part_are_kept():
    parts = [tiny("qwen3_moe", seed=0), tiny("qwen3_moe", seed=1)]
    for part in parts:
        part.set_experts_implementation("eager")
    built = build_recordings(parts, include=None, max_variants=2, scopes=SCOPES)
    assert [(b.name, b.reason) for b in built.narrowed] == [
        ("model.layers.0", "eager_experts"),
        ("model.layers.1", "eager_experts"),
    ] * 2
    assert len(built.recordings) == 8 and built.skipped == []


# --- argument checks ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3])
@pytest.mark.parametrize("model", [Toy, lambda: nn.Linear(2, 2)], ids=["targets", "none"])
def test_max_variants_below_one_is_refused_before_discovery(bad, model):
    # Refused up front, also for a model with no target (no ContractSet is ever made).
    with pytest.raises(CudaGraphsValueError) as info:
        PartialCudaGraphManager.from_model_parts(model(), capture_backend=backend, max_variants=bad)
    assert str(info.value) == f"max_variants must be an int >= 1, got {bad!r}"


def test_max_variants_is_checked_before_the_experts_switch():
    part = Switchable()
    with pytest.raises(CudaGraphsValueError, match="max_variants must be an int >= 1"):
        PartialCudaGraphManager.from_model_parts(
            part, max_variants=0, experts_implementation="grouped_mm"
        )
    assert part.set_to == [], "nothing was changed"


def test_max_variants_of_one_is_accepted():
    mgr = PartialCudaGraphManager.from_model_parts(Toy(), capture_backend=backend, max_variants=1)
    assert [r.contracts.max_variants for r in mgr.recordings] == [1, 1]


# --- the experts switch -------------------------------------------------------------------


def test_a_switchable_part_is_named_by_its_type():
    part = Switchable()
    assert switch_experts_implementation([part], "grouped_mm") == ["Switchable"]
    assert part.set_to == ["grouped_mm"]


def test_nested_switchable_modules_are_named_by_path_and_all_switched():
    root = nn.Module()
    root.a = nn.Module()
    root.a.b = Switchable()
    root.a.c = Switchable()
    root.d = nn.Module()
    root.d.e = nn.Module()
    root.d.e.f = Switchable()
    root.g = Switchable()
    switched = switch_experts_implementation([root], "batched_mm")
    assert sorted(switched) == ["a.b", "a.c", "d.e.f", "g"]
    for m in (root.a.b, root.a.c, root.d.e.f, root.g):
        assert m.set_to == ["batched_mm"]


def test_the_outermost_switchable_module_switches_its_own_submodels():
    outer = Switchable()
    outer.inner = Switchable()
    root = nn.Module()
    root.model = outer
    assert switch_experts_implementation([root], "grouped_mm") == ["model"]
    assert outer.set_to == ["grouped_mm"] and outer.inner.set_to == []


def test_every_part_is_switched():
    first, second = Switchable(), nn.Sequential(nn.Linear(2, 2), Switchable())
    assert switch_experts_implementation([first, second], "grouped_mm") == ["Switchable", "1"]


def test_a_refusal_names_the_top_level_module_by_type():
    with pytest.raises(CudaGraphsValueError) as info:
        switch_experts_implementation([Switchable(refuse=True)], "nope")
    assert str(info.value) == (
        "Switchable refused experts_implementation='nope': unknown implementation. Fix: "
        "pass an implementation the installed transformers supports ('grouped_mm', "
        "'batched_mm')."
    )
    assert isinstance(info.value.__cause__, ValueError)


def test_a_refusal_names_a_nested_module_by_path():
    root = nn.Module()
    root.model = Switchable(refuse=True)
    with pytest.raises(CudaGraphsValueError, match=r"^model refused experts_implementation="):
        switch_experts_implementation([root], "nope")


def test_a_non_string_implementation_is_a_type_error():
    with pytest.raises(CudaGraphsTypeError) as info:
        switch_experts_implementation([Switchable()], 3)
    assert str(info.value) == "experts_implementation must be a str such as 'grouped_mm', got int 3"


def test_the_switch_is_said_with_the_names_and_the_value(caplog):
    model = tiny("qwen3_moe")
    model.set_experts_implementation("eager")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr = PartialCudaGraphManager.from_model_parts(
            model, capture_backend=backend, experts_implementation="grouped_mm"
        )
    said = messages(caplog, logging.INFO)
    assert said == [
        "partial graphs: experts implementation of ['Qwen3MoeForCausalLM'] set to 'grouped_mm'",
        "partial graphs: 2 target(s): ['model.layers.0', 'model.layers.1']",
    ]
    mgr.close()


# --- what from_model_parts says ----------------------------------------------------------


def test_the_targets_are_said_at_info(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        mgr = PartialCudaGraphManager.from_model_parts(Toy(), capture_backend=backend)
    assert messages(caplog) == ["partial graphs: 2 target(s): ['layers.0', 'layers.1']"]
    mgr.close()


EVERY_SCOPE = "attention, moe_router, mlp, moe, layer"  # the default: SCOPES


def nothing_found(why):
    return (
        f"partial graphs: nothing graphable found ({why}); the model trains eagerly and "
        "from_model_parts returns None"
    )


@pytest.mark.parametrize(
    "kwargs, asked",
    [
        (dict(), f"scopes {EVERY_SCOPE}"),
        (dict(scopes=("moe_router",)), "scopes moe_router"),
        (dict(scopes=("attention",)), "scopes attention"),
        (dict(scopes=("attention",), include="no.such"), "scopes attention, include='no.such'"),
        (dict(include=["x.*"]), f"scopes {EVERY_SCOPE}, include=['x.*']"),
    ],
    ids=["default", "router", "scopes", "scopes-include", "default-include"],
)
def test_nothing_found_says_what_was_looked_for(caplog, kwargs, asked):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert PartialCudaGraphManager.from_model_parts(nn.Linear(2, 2), **kwargs) is None
    why = f"in Linear with 0 block(s), looking for {asked}; {STRUCTURE_RULE}. {FIXES}"
    assert messages(caplog) == [nothing_found(why)]


def test_nothing_asked_for_is_said(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert PartialCudaGraphManager.from_model_parts(Toy(), scopes=()) is None
    assert messages(caplog) == [
        nothing_found("in Toy with 2 block(s): scopes=() and no include: nothing asked for")
    ]


# --- report_blocks -------------------------------------------------------------------------


def blocks():
    skipped = [
        SkippedBlock("m.0", "Mamba", "no_graph_safe_scope", "no attention"),
        SkippedBlock("m.2", "Mamba", "no_graph_safe_scope", "still none"),
    ]
    narrowed = [NarrowedBlock("m.1", "Moe", "layer", ("attention",), "eager_experts", "eager")]
    return BuiltTargets(skipped=skipped, narrowed=narrowed)


def test_report_blocks_says_skipped_and_narrowed_blocks(caplog):
    log = logging.getLogger("test.report_blocks")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        report_blocks(blocks(), log, narrowed_level=logging.INFO)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "partial graphs: 2 block(s) hold nothing graph-safe of the kinds asked for and "
            "run eagerly (counted in stats()['skipped_<reason>']):\n"
            "  m.0 (Mamba): no attention\n  m.2 (Mamba): still none",
        ),
        (
            logging.INFO,
            "partial graphs: 1 block(s) are graphed at narrower scopes than asked for "
            "(counted in stats()['narrowed_<reason>']):\n  m.1 (Moe): eager",
        ),
    ]


def test_report_blocks_says_nothing_without_blocks(caplog):
    log = logging.getLogger("test.report_blocks")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        report_blocks(BuiltTargets(), log)
    assert caplog.records == []
