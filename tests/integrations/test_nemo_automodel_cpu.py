"""NeMo Automodel's partial graphs on cudagraphs' helper (CPU): which helper its
manager gets, that nothing pretends Transformer Engine is installed, and that the
manager's own capture reaches our helper."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

import cudagraphs
from cudagraphs import MissingDependencyError, NoCudaDeviceError, UnsupportedModelError
from cudagraphs.integrations.nemo_automodel import NEMO_PARTIAL_MODULE, use_cudagraphs

partial = pytest.importorskip(NEMO_PARTIAL_MODULE, reason="nemo-automodel is not installed")

needs_no_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="Transformer Engine is installed here",
)


@needs_no_te
def test_without_transformer_engine_nemo_refuses_and_then_gets_ours():
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        partial._get_make_graphed_callables()
    with use_cudagraphs():
        assert partial._get_make_graphed_callables() is cudagraphs.make_graphed_callables
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        partial._get_make_graphed_callables()  # restored


@needs_no_te
def test_nothing_makes_other_code_believe_transformer_engine_is_installed():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    with use_cudagraphs(force=True):
        partial._get_make_graphed_callables()
        assert importlib.util.find_spec("transformer_engine") is None
        assert not any(m.startswith("transformer_engine") for m in sys.modules)
        assert not accelerate_utils.is_transformer_engine_available()


def test_a_loading_transformer_engine_is_kept_unless_forced(monkeypatch):
    te_helper = object()
    monkeypatch.setattr(partial, "safe_import_te", lambda: (True, SimpleNamespace()))
    monkeypatch.setattr(partial, "safe_import_from", lambda module, name: (True, te_helper))
    with use_cudagraphs():
        assert partial._get_make_graphed_callables() is te_helper
    with use_cudagraphs(force=True):
        assert partial._get_make_graphed_callables() is cudagraphs.make_graphed_callables


def test_a_second_call_replaces_the_first_and_restore_gives_nemos_own_back(monkeypatch):
    own = partial._get_make_graphed_callables
    first = use_cudagraphs()
    second = use_cudagraphs(force=True)
    assert partial._get_make_graphed_callables.__wrapped__ is own
    second.restore()
    first.restore()
    second.restore()
    assert partial._get_make_graphed_callables is own


def test_a_nemo_without_the_lookup_is_refused_and_left_unchanged(monkeypatch):
    monkeypatch.delattr(partial, "_get_make_graphed_callables")
    with pytest.raises(UnsupportedModelError, match="_get_make_graphed_callables"):
        use_cudagraphs()
    assert not hasattr(partial, "_get_make_graphed_callables")


def test_without_nemo_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, NEMO_PARTIAL_MODULE, None)  # import raises
    with pytest.raises(MissingDependencyError, match="pip install nemo-automodel"):
        use_cudagraphs()


def test_nemos_own_capture_reaches_our_helper():
    # On the CPU our helper stops at its CUDA check, which proves the manager called it
    # (Transformer Engine is absent, so nothing else could have answered).
    tiny = pytest.importorskip("helpers.hf_models").tiny
    model = tiny("llama")
    model.backend = SimpleNamespace(cuda_graph=SimpleNamespace(modules=["attn"]))
    manager = partial.PartialCudaGraphManager.from_model_parts([model])
    assert manager is not None and len(manager.entries) == 2  # one attention per layer
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids).logits.sum().backward()  # the recorded iteration 0
    with use_cudagraphs(force=True), pytest.raises(RuntimeError) as err:
        manager.capture()
    assert isinstance(err.value.__cause__, NoCudaDeviceError), err.value.__cause__
    manager.close()
