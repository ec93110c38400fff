"""A whole model part's outputs under the "model" scope (CPU): the core's graphs hand
them out owned (no copy here, ``cudagraphs.core.deferred_grads``), any other graph's
are copied; an output kept where this torch cannot move it makes that call run
eagerly, counted and said, and the next call replays."""

import logging

import pytest
import torch

from cudagraphs.core.graphed import GraphedCallable
from cudagraphs.core.lent_grads import LentGrads
from cudagraphs.errors import KeptOutputViewError
from cudagraphs.partial import SCOPES, PartialCudaGraphManager
from cudagraphs.partial import graphing as graphing_module
from cudagraphs.partial import replay as replay_module
from cudagraphs.partial.replay import owns_outputs
from helpers.hf_models import tiny
from helpers.stand_in_graphs import ScaleForward, positional_entry

WIDEST = (*SCOPES, "model")
LOGGER = "cudagraphs.partial.manager"


def _graphed(owned: bool) -> GraphedCallable:
    w, x, out = torch.ones(3), torch.zeros(3), torch.zeros(3)
    graphs = positional_entry(
        "f", x, out, ScaleForward(w, x, out), lent=LentGrads(), owned_outputs=owned
    )
    return GraphedCallable(graphs, eager=lambda t: w * t, module=None, captured_training=None)


def test_only_the_cores_graphs_with_owned_outputs_own_them():
    assert owns_outputs(_graphed(owned=True))
    assert not owns_outputs(_graphed(owned=False))
    assert not owns_outputs(lambda *a: a), "a backend of the user's: copied"


def _ids():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _record_and_capture(mgr, model):
    mgr.start_recording()
    model(input_ids=_ids(), labels=_ids(), use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    mgr.capture()


@pytest.mark.parametrize("scopes, owned", [(WIDEST, {0}), (SCOPES, set())])
def test_the_core_backend_owns_the_outputs_of_whole_parts_only(monkeypatch, scopes, owned):
    seen = []

    def core_stand_in(callables, sample_args, **kwargs):
        seen.append(set(kwargs["_owned_outputs"]))
        return tuple(callables)

    monkeypatch.setattr(graphing_module.core, "make_graphed_callables", core_stand_in)
    model = tiny("llama")
    mgr = PartialCudaGraphManager.from_model_parts(model, scopes=scopes, speed_check=False)
    _record_and_capture(mgr, model)
    assert seen and all(s == owned for s in seen), seen
    assert mgr.stats()["captured"] >= 1


def test_a_kept_output_out_of_reach_runs_the_call_eagerly_and_the_next_replays(caplog):
    refusals = [1]

    def backend(callables, sample_args, sample_kwargs):
        def run(fn):
            def call(*args, **kwargs):
                if refusals[0]:
                    refusals[0] -= 1
                    raise KeptOutputViewError("outputs of the part: a view is kept")
                return fn(*args, **kwargs)

            return call

        return [run(c) for c in callables]

    model = tiny("llama")
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=backend, scopes=WIDEST, speed_check=False
    )
    refusals[0] = 0
    _record_and_capture(mgr, model)
    assert mgr.stats()["captured"] == 1
    refusals[0] = 1
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ref = model(input_ids=_ids(), labels=_ids(), use_cache=False).logits  # refused: eager
    stats = mgr.stats()
    assert stats["fallback_kept_output"] == 1 and stats["replayed"] == 0
    (said,) = [r.getMessage() for r in caplog.records if "kept_output" in r.getMessage()]
    assert said == (
        "partial graphs: LlamaForCausalLM ran eagerly (reason 'kept_output'): an output its "
        "last replay handed out (graph memory, which this replay would overwrite) is still "
        f"referenced by a tensor that torch {torch.__version__} cannot move.\n"
        "outputs of the part: a view is kept\n"
        "Fixes: 1. keep a .clone() of the output instead of a view or .detach() of it; "
        "2. use a torch with UntypedStorage._swap_data_ptr_ (2.13 has it). That output is "
        "copied at every replay from now on, and the graph replays again once that tensor "
        "is dropped.\nLater eager runs for this reason (this or any other target) are not "
        "logged again; stats()['fallback_kept_output'] counts them all."
    )
    again = model(input_ids=_ids(), labels=_ids(), use_cache=False).logits
    assert mgr.stats()["replayed"] == 1, "the next call replays"
    assert torch.equal(again, ref)


@pytest.mark.parametrize("owned", [True, False])
def test_a_whole_parts_outputs_are_copied_unless_its_graph_owns_them(monkeypatch, owned):
    returned = []

    def core_stand_in(callables, sample_args, **kwargs):
        def keep(fn):
            def run(*args, **kw):
                returned.append(fn(*args, **kw))
                return returned[-1]

            return run

        return tuple(keep(c) for c in callables)

    monkeypatch.setattr(graphing_module.core, "make_graphed_callables", core_stand_in)
    model = tiny("llama")
    mgr = PartialCudaGraphManager.from_model_parts(model, scopes=WIDEST, speed_check=False)
    _record_and_capture(mgr, model)
    asked = []
    monkeypatch.setattr(replay_module, "owns_outputs", lambda g: asked.append(g) or owned)
    returned.clear()
    out = model(input_ids=_ids(), labels=_ids(), use_cache=False)
    assert asked == [mgr.recordings[0].variants[0].graph]
    (graph_out,) = returned
    assert (out.logits is graph_out.logits) == owned, "the graph's own, or a copy"
    assert torch.equal(out.logits, graph_out.logits)
