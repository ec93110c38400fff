"""The retired arguments (CPU): ``attention=`` / ``router=`` of plan_targets,
select_targets and from_model_parts, and from_model_parts' ``pipeline_parallel`` (by
keyword or in its third positional place), are refused with a typed error that names
what to pass instead; nothing is changed by the refused call, so the next good call
works."""

import pytest
import torch

from cudagraphs.errors import CudaGraphsError, CudaGraphsTypeError
from cudagraphs.partial import PartialCudaGraphManager, plan_targets, select_targets
from helpers.toy_models import Toy

RETIRED_SWITCHES = "attention= and router= are retired: scopes= says what is graphed"


def eager_backend(callables, sample_args, sample_kwargs):
    return list(callables)


def from_model_parts(*args, **kwargs):
    return PartialCudaGraphManager.from_model_parts(*args, capture_backend=eager_backend, **kwargs)


ENTRY_POINTS = {
    "plan_targets": plan_targets,
    "select_targets": select_targets,
    "from_model_parts": from_model_parts,
}


@pytest.mark.parametrize(
    "switches, fixes",
    [
        (
            dict(attention=False),
            "Fixes: 1. scopes=('moe_router',) graphs what the switches chose; 2. "
            "scopes=('moe_router', 'mlp', 'moe') graphs every scope without what they "
            "turned off.",
        ),
        (
            dict(router=False),
            "Fixes: 1. scopes=('attention',) graphs what the switches chose; 2. "
            "scopes=('attention', 'mlp') graphs every scope without what they turned off.",
        ),
        (
            dict(attention=False, router=False),
            "Fixes: 1. scopes=() graphs what the switches chose, with include= naming the "
            "modules to graph; 2. scopes=('mlp',) graphs every scope without what they "
            "turned off.",
        ),
        (
            dict(attention=True, router=True),
            "Fixes: 1. drop them: scopes=None graphs each layer as widely as is graph-safe; "
            "2. scopes=('attention', 'moe_router') graphs the attention and router alone.",
        ),
    ],
    ids=["attention-off", "router-off", "both-off", "both-on"],
)
@pytest.mark.parametrize("where", sorted(ENTRY_POINTS))
def test_a_retired_switch_names_the_scopes_to_pass(where, switches, fixes):
    named = " and ".join(f"{k}={v!r}" for k, v in switches.items())
    with pytest.raises(CudaGraphsTypeError) as caught:
        ENTRY_POINTS[where](Toy(), **switches)
    assert str(caught.value) == f"{where} got {named}; {RETIRED_SWITCHES}. {fixes}"
    assert isinstance(caught.value, (CudaGraphsError, TypeError))


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_pipeline_parallel_is_refused_by_keyword_and_in_its_place(how):
    args, kwargs = ((Toy(), False, False), {}) if how == "positional" else ((Toy(),), {})
    if how == "keyword":
        kwargs = dict(pipeline_parallel=False)
    with pytest.raises(CudaGraphsTypeError) as caught:
        from_model_parts(*args, **kwargs)
    assert str(caught.value) == (
        "from_model_parts got pipeline_parallel=False; pipeline_parallel is retired: each "
        "model part is graphed on its own. Fix: drop pipeline_parallel."
    )


def test_every_retired_argument_passed_is_named_at_once():
    with pytest.raises(CudaGraphsTypeError) as caught:
        from_model_parts(Toy(), pipeline_parallel=True, router=False)
    message = str(caught.value)
    assert message.startswith("from_model_parts got pipeline_parallel=True and router=False; ")
    assert RETIRED_SWITCHES in message and "pipeline_parallel is retired" in message
    assert message.endswith("; 3. drop pipeline_parallel.")


def test_after_a_refusal_the_next_good_call_works():
    model = Toy()
    with pytest.raises(CudaGraphsTypeError):
        from_model_parts(model, attention=False)
    with pytest.raises(CudaGraphsTypeError):
        plan_targets(model, router=False)
    assert [t.name for t in plan_targets(model, scopes=("attention",)).targets] == [
        "layers.0.self_attn",
        "layers.1.self_attn",
    ]
    mgr = from_model_parts(model, scopes=("attention",))
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    model(torch.randn(2, 8))
    assert mgr.stats()["replayed"] == 2 and mgr.stats()["fallbacks"] == 0
    mgr.close()


def test_the_former_names_of_the_dispatcher_stay_for_one_release():
    from cudagraphs.partial import PartialGraphEntry, TargetDispatcher

    assert PartialGraphEntry is TargetDispatcher
    mgr = from_model_parts(Toy(), scopes=("attention",))
    assert mgr.entries is mgr.dispatchers
    assert all(isinstance(d, PartialGraphEntry) for d in mgr.entries)
    assert [d.recording for d in mgr.dispatchers] == mgr.recordings
    mgr.close()


def test_the_retired_default_reads_as_retired_in_signatures():
    import inspect

    from cudagraphs.partial import plan_targets
    from cudagraphs.partial.arguments import RETIRED

    assert repr(RETIRED) == "<retired>"
    assert repr(inspect.signature(plan_targets).parameters["attention"].default) == "<retired>"
