"""Partial graphs tell the core which outputs of a whole model part no recorded
backward reached (an HF model's logits beside the loss it computes from labels), so
that its backward graph is captured without an incoming-gradient buffer for them.
On the CPU, with a stand-in for the core's ``make_graphed_callables``."""

import pytest
import torch

import cudagraphs
from cudagraphs.partial import MODEL_SCOPE, PartialCudaGraphManager
from helpers.hf_models import tiny
from helpers.partial_core import FakeCore


@pytest.fixture
def core(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    fake = FakeCore(bare=True)
    monkeypatch.setattr(cudagraphs.core, "make_graphed_callables", fake)
    return fake


def _recorded(step):
    model = tiny("llama")
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], scopes=(MODEL_SCOPE,), speed_check=False
    )
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mgr.start_recording()
    step(model, ids)
    mgr.capture()
    return model, mgr, ids


def _outputs(model, ids):
    out = model(input_ids=ids, labels=ids)
    return [k for k, v in out.items() if isinstance(v, torch.Tensor)]


def test_a_loss_only_step_leaves_the_logits_unreached(core):
    model, mgr, ids = _recorded(lambda m, x: m(input_ids=x, labels=x).loss.backward())
    try:
        assert _outputs(model, ids)[:2] == ["loss", "logits"]
        assert core.unreached == [{0: frozenset({1})}]
    finally:
        mgr.close()


def test_a_loss_that_uses_the_logits_leaves_nothing_unreached(core):
    def step(m, x):
        out = m(input_ids=x, labels=x)
        (out.loss + out.logits.float().square().mean()).backward()

    _, mgr, _ = _recorded(step)
    try:
        assert core.unreached == [None]
    finally:
        mgr.close()


def test_without_a_recorded_backward_nothing_is_known_and_nothing_is_left_out(core):
    _, mgr, _ = _recorded(lambda m, x: m(input_ids=x, labels=x))
    try:
        assert core.unreached == [None]
    finally:
        mgr.close()


def test_inner_targets_are_not_watched(core):
    # The default scopes graph parts inside the layers: their outputs always feed on.
    model = tiny("llama")
    model.config.use_cache = False
    mgr = PartialCudaGraphManager.from_model_parts([model], speed_check=False)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mgr.start_recording()
    model(input_ids=ids, labels=ids).loss.backward()
    mgr.capture()
    try:
        assert core.unreached and all(u is None for u in core.unreached)
    finally:
        mgr.close()


# ---- RecordedVariant.watch_gradients, directly ----------------------------------------


def test_watched_outputs_are_views_by_position_among_the_tensors_alone():
    from cudagraphs.partial.recording import RecordedVariant

    variant = RecordedVariant(args=None, kwargs=None)
    a = torch.randn(2, requires_grad=True) * 1.0
    frozen = torch.randn(2)
    b = torch.randn(3, requires_grad=True) * 1.0
    c = torch.randn(4, requires_grad=True) * 1.0
    out = variant.watch_gradients({"a": a, "note": "text", "frozen": frozen, "b": b, "c": c})
    # Tensor positions 0 (a), 2 (b), 3 (c) require grad; the string is no position and
    # the frozen tensor is position 1, passed as it is.
    assert variant.grad_outputs == {0, 2, 3}
    assert out["note"] == "text" and out["frozen"] is frozen
    for key, t in (("a", a), ("b", b), ("c", c)):
        assert out[key] is not t and out[key]._base is t and torch.equal(out[key], t)
    assert variant.unreached_outputs() == frozenset()  # no backward yet: nothing known
    out["c"].sum().backward(retain_graph=True)
    assert variant.unreached_outputs() == {0, 2}
    # A gradient through the original tensor (inside the part) is not the caller's.
    (b * 2).sum().backward()
    assert variant.unreached_outputs() == {0, 2}
    out["a"].sum().backward()
    assert variant.unreached_outputs() == {2}


def test_a_loss_computed_from_the_logits_alone_leaves_the_loss_unreached(core):
    _, mgr, _ = _recorded(lambda m, x: m(input_ids=x, labels=x).logits.float().mean().backward())
    try:
        assert core.unreached == [{0: frozenset({0})}]
    finally:
        mgr.close()


def test_every_hidden_state_beside_the_loss_is_left_unreached(core):
    def step(m, x):
        m(input_ids=x, labels=x, output_hidden_states=True).loss.backward()

    model, mgr, ids = _recorded(step)
    try:
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
        n = len(out.hidden_states)
        assert core.unreached == [{0: frozenset(range(1, 2 + n))}]
    finally:
        mgr.close()
