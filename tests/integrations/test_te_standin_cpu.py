"""The test-only Transformer Engine stand-in (``te_standin.py``) on the CPU: what it
provides (FP8 off), what it lacks, and that it leaves ``sys.modules`` exactly as it
found it, so no other test (and no code of ours) ever believes TE is installed."""

import importlib
import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

import cudagraphs
from cudagraphs.capture_state import TE_GRAPH_MODULE, capture_scope, is_graph_capturing
from helpers.te_standin import STANDIN_MARKER, TE_MODULES, TE_VERSION, te_standin


def _te_entries():
    return {k: v for k, v in sys.modules.items() if k.split(".")[0] == "transformer_engine"}


@pytest.fixture(autouse=True)
def _nothing_leaks():
    """Every test here leaves the TE entries of sys.modules, and what find_spec says,
    as they were."""
    before, spec = _te_entries(), importlib.util.find_spec("transformer_engine")
    yield
    assert _te_entries() == before, "the stand-in left transformer_engine modules behind"
    assert importlib.util.find_spec("transformer_engine") == spec


def test_installed_it_answers_the_imports_megatron_makes():
    with te_standin() as standin:
        import transformer_engine as te
        from transformer_engine.pytorch.distributed import is_fp8_activation_recompute_enabled
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        from transformer_engine.pytorch.graph import (
            make_graphed_callables,
            restore_fp8_tensors,
            save_fp8_tensors,
            set_capture_end,
            set_capture_start,
        )
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
        from transformer_engine.pytorch.utils import make_weak_ref

        assert te.__version__ == TE_VERSION == standin.version
        assert make_graphed_callables is cudagraphs.make_graphed_callables
        assert importlib.util.find_spec("transformer_engine") is not None
        assert te.pytorch.graph is sys.modules[TE_GRAPH_MODULE]  # attribute access works too
        assert all(getattr(sys.modules[name], STANDIN_MARKER) for name in TE_MODULES)
        assert callable(set_capture_start) and callable(set_capture_end)
        assert callable(save_fp8_tensors) and callable(restore_fp8_tensors)
        assert callable(TransformerEngineBaseModule) and callable(make_weak_ref)
        assert not is_fp8_activation_recompute_enabled()
        assert not FP8GlobalStateManager.is_fp8_enabled()


def test_removed_afterwards_and_find_spec_is_back():
    spec = importlib.util.find_spec("transformer_engine")
    with te_standin():
        assert "transformer_engine" in sys.modules
    assert "transformer_engine" not in sys.modules
    assert TE_GRAPH_MODULE not in sys.modules
    assert importlib.util.find_spec("transformer_engine") == spec
    if spec is None:  # no Transformer Engine on this machine (CI)
        with pytest.raises(ImportError):
            importlib.import_module("transformer_engine")


def test_fp8_is_off():
    with te_standin():
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        from transformer_engine.pytorch.graph import restore_fp8_tensors, save_fp8_tensors
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

        assert not FP8GlobalStateManager.is_fp8_enabled()
        assert not FP8GlobalStateManager.is_fp8_calibration()
        assert not FP8GlobalStateManager.is_first_fp8_module()
        layer = nn.Linear(2, 2)
        assert not any(isinstance(m, TransformerEngineBaseModule) for m in layer.modules())
        saved = save_fp8_tensors([layer], None)
        assert saved is None
        restore_fp8_tensors([layer], saved)
        with pytest.raises(ValueError, match="saved no FP8 tensors"):
            restore_fp8_tensors([layer], [torch.zeros(1)])


def test_names_it_does_not_fake_are_missing_loudly():
    with te_standin():
        with pytest.raises(ImportError):
            from transformer_engine.pytorch import Linear  # noqa: F401
        with pytest.raises(ImportError):
            from transformer_engine.pytorch.fp8 import fp8_autocast  # noqa: F401
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("transformer_engine.pytorch.attention")
        import transformer_engine

        with pytest.raises(AttributeError, match=r"te_standin\.py"):
            transformer_engine.pytorch.TransformerLayer  # noqa: B018
        from transformer_engine.pytorch.utils import make_weak_ref

        with pytest.raises(NotImplementedError, match="cuda_graph_impl='local'"):
            make_weak_ref(torch.zeros(1))


def test_our_capture_scope_drives_its_capture_flag():
    with te_standin() as standin:
        from transformer_engine.pytorch.graph import is_graph_capturing as te_capturing

        with capture_scope():
            assert is_graph_capturing() and te_capturing()
        assert not te_capturing() and standin.capture_starts == 1


def test_a_replacement_make_graphed_callables_and_version():
    calls = []

    def recorder(*args, **kwargs):
        calls.append(kwargs)
        return "graphed"

    with te_standin(version="2.7.0", make_graphed_callables=recorder):
        import transformer_engine
        from transformer_engine.pytorch.graph import make_graphed_callables

        assert transformer_engine.__version__ == "2.7.0"
        assert make_graphed_callables((), (), _order=[1, -1]) == "graphed"
    assert calls == [{"_order": [1, -1]}]


def test_what_was_there_comes_back_and_what_was_added_goes():
    sentinel = types.ModuleType("transformer_engine")
    graph = types.ModuleType(TE_GRAPH_MODULE)
    old = {name: sys.modules.get(name) for name in ("transformer_engine", TE_GRAPH_MODULE)}
    sys.modules["transformer_engine"], sys.modules[TE_GRAPH_MODULE] = sentinel, graph
    try:
        with te_standin():
            assert sys.modules["transformer_engine"] is not sentinel
            sys.modules["transformer_engine.extra"] = types.ModuleType("transformer_engine.extra")
        assert sys.modules["transformer_engine"] is sentinel
        assert sys.modules[TE_GRAPH_MODULE] is graph
        assert "transformer_engine.extra" not in sys.modules
        assert "transformer_engine.pytorch" not in sys.modules
    finally:
        for name, module in old.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_removed_when_the_block_raises():
    with pytest.raises(KeyError, match="inside"), te_standin():
        raise KeyError("inside")
    assert "transformer_engine" not in sys.modules


def test_it_does_not_nest():
    with te_standin(), pytest.raises(RuntimeError, match="does not nest"), te_standin():
        pass
    assert "transformer_engine" not in sys.modules
