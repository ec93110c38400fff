"""The vocabulary of partial graphs (CPU): every reason the layer gives is registered
once, with what it means, under the stats() key it is counted by; the typed names
and the contract's order agree with the registry; every reason the code passes is a
registered one; and the vocabulary imports no other module of the layer."""

import ast
import typing
from pathlib import Path

import pytest
import torch

from cudagraphs.partial import MODEL_SCOPE, PartialCudaGraphManager, contract, vocabulary
from cudagraphs.partial.vocabulary import (
    CONTRACT_REASONS,
    FALLBACK,
    MODEL_REFUSED,
    NARROWED,
    OFF,
    REASON_FAMILIES,
    SKIPPED,
)
from helpers.hf_models import tiny, tiny_arch

PARTIAL = Path(vocabulary.__file__).parent
FAMILY_OF_TYPE = {
    "SkipReason": SKIPPED,
    "NarrowReason": NARROWED,
    "ModelRefusal": MODEL_REFUSED,
    "OffReason": OFF,
}
# stats() keys that are totals, not reasons (memory keys come from the core's graphs).
TOTALS = {"captured", "disabled", "replayed", "fallbacks"}


@pytest.mark.parametrize("name", sorted(FAMILY_OF_TYPE))
def test_each_typed_reason_is_its_familys_registry(name):
    family = FAMILY_OF_TYPE[name]
    assert typing.get_args(getattr(vocabulary, name)) == tuple(family.reasons)


def test_the_contract_ranks_the_first_fallback_reasons():
    assert contract.REASONS == CONTRACT_REASONS == tuple(FALLBACK.reasons)[:12]
    assert CONTRACT_REASONS[0] == "structure" and CONTRACT_REASONS[-1] == "training"


def test_every_reason_is_explained_once_and_keyed_apart():
    keys = [f.key(r) for f in REASON_FAMILIES for r in f.reasons]
    assert len(keys) == len(set(keys)) and not TOTALS & set(keys)
    prefixes = [f.key_prefix for f in REASON_FAMILIES]
    assert len(set(prefixes)) == len(prefixes) and all(p.endswith("_") for p in prefixes)
    for family in REASON_FAMILIES:
        assert family.counts
        for reason, meaning in family.reasons.items():
            assert reason.isidentifier() and meaning and not meaning.endswith("."), reason


def _reason_literals() -> list[tuple[str, str, str]]:
    """(family prefix, reason, where) for each reason literal the layer's code passes:
    turn_off / _refuse / fallback / _fall_back's first argument, and the reason field
    of a SkippedBlock or ModelScopeOff made with a literal."""
    calls = {"turn_off": OFF, "_refuse": OFF, "fallback": FALLBACK, "_fall_back": FALLBACK}
    fields = {"SkippedBlock": (2, SKIPPED), "ModelScopeOff": (1, MODEL_REFUSED)}
    found = []
    for path in sorted(PARTIAL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            args = node.args
            if name == "_refuse":
                args = args[1:]  # _refuse(target, reason, ...)
            if name in calls:
                position, family = 0, calls[name]
            elif name in fields:
                position, family = fields[name]
            else:
                continue
            if len(args) > position and isinstance(args[position], ast.Constant):
                value = args[position].value
                if isinstance(value, str):
                    found.append((family.key_prefix, value, f"{path.name}:{node.lineno}"))
    return found


@pytest.mark.skipif(
    "mutants" in PARTIAL.parts, reason="mutmut's copies of the sources carry its trampolines"
)
def test_every_reason_the_code_passes_is_registered():
    found = _reason_literals()
    assert len(found) >= 8, "the scan must see the layer's reasons"
    by_prefix = {f.key_prefix: f for f in REASON_FAMILIES}
    unknown = [(r, where) for prefix, r, where in found if r not in by_prefix[prefix].reasons]
    assert unknown == []


def _registered(key: str) -> bool:
    return any(
        key.startswith(f.key_prefix) and key[len(f.key_prefix) :] in f.reasons
        for f in REASON_FAMILIES
    )


def eager_backend(callables, sample_args, sample_kwargs):
    return list(callables)


def test_every_stats_key_is_a_total_or_a_registered_reason():
    seen = {}
    moe = tiny("qwen3_moe")
    moe.set_experts_implementation("eager")  # narrowed_eager_experts
    mgr = PartialCudaGraphManager.from_model_parts(moe, capture_backend=eager_backend)
    mgr.start_recording()
    moe(torch.randint(0, 128, (1, 8))).logits.sum().backward()
    mgr.capture()
    moe(torch.randint(0, 128, (1, 12)))  # fallback_shape
    seen.update(mgr.stats())
    mgr.close()
    hybrid = PartialCudaGraphManager.from_model_parts(
        tiny_arch("jamba"), capture_backend=eager_backend, scopes=("attention",)
    )  # skipped_no_graph_safe_scope
    seen.update(hybrid.stats())
    whole = PartialCudaGraphManager.from_model_parts(
        tiny("llama"),
        capture_backend=eager_backend,
        scopes=(MODEL_SCOPE, "attention"),
        include="model.layers.0.mlp",
    )  # model_refused_include
    seen.update(whole.stats())
    for key in ("narrowed_eager_experts", "fallback_shape", "skipped_no_graph_safe_scope"):
        assert key in seen, key
    assert "model_refused_include" in seen
    assert [k for k in seen if k not in TOTALS and not _registered(k)] == []


def test_the_vocabulary_imports_no_module_of_the_layer():
    tree = ast.parse(Path(vocabulary.__file__).read_text())
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    absolute = [
        a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
        if "cudagraphs" in (getattr(n, "module", None) or a.name)
    ]
    assert relative == [] and absolute == []
