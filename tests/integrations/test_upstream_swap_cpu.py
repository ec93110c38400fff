"""The swap that runs upstream code on cudagraphs' helper, and the pytest plugin that
does it for a whole run (CPU: what is replaced, what is called, what is put back)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch

import cudagraphs
from cudagraphs.integrations import upstream
from cudagraphs.integrations.upstream import (
    swap_make_graphed_callables,
    swapped_make_graphed_callables,
    torch_signature_helper,
)

pytest_plugins = ["pytester"]

TORCH_HELPER = torch.cuda.make_graphed_callables


def test_the_swap_replaces_torchs_helper_at_both_sites_and_restores_them():
    assert torch.cuda.graphs.make_graphed_callables is TORCH_HELPER
    swap = swap_make_graphed_callables()
    try:
        assert torch.cuda.make_graphed_callables is torch_signature_helper
        assert torch.cuda.graphs.make_graphed_callables is torch_signature_helper
        assert swap.sites[:2] == [
            "torch.cuda.make_graphed_callables",
            "torch.cuda.graphs.make_graphed_callables",
        ]
    finally:
        swap.restore()
    assert torch.cuda.make_graphed_callables is TORCH_HELPER
    assert torch.cuda.graphs.make_graphed_callables is TORCH_HELPER
    swap.restore()  # idempotent
    assert torch.cuda.make_graphed_callables is TORCH_HELPER


def test_torchs_positional_order_reaches_our_keywords(monkeypatch):
    seen = {}

    def recorder(callables, sample_args, **kwargs):
        seen.update(kwargs, callables=callables, sample_args=sample_args)
        return "graphed"

    monkeypatch.setattr(upstream, "make_graphed_callables", recorder)
    pool = (0, 1)
    # torch's order: (callables, sample_args, num_warmup_iters, allow_unused_input, pool)
    assert torch_signature_helper("f", ((1,),), 5, True, pool) == "graphed"
    assert seen == {
        "callables": "f",
        "sample_args": ((1,),),
        "num_warmup_iters": 5,
        "allow_unused_input": True,
        "pool": pool,
    }


def test_without_transformer_engine_nothing_pretends_it_is_installed():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    with swapped_make_graphed_callables() as swap:
        assert swap.te_status == "not installed"
        assert importlib.util.find_spec("transformer_engine") is None
        assert "transformer_engine" not in sys.modules


@pytest.fixture
def fake_transformer_engine(tmp_path, monkeypatch):
    """A minimal importable ``transformer_engine`` with a helper at TE's two sites."""
    pkg = tmp_path / "transformer_engine" / "pytorch"
    pkg.mkdir(parents=True)
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    (pkg / "graph.py").write_text("def make_graphed_callables(*a, **k):\n    return 'te'\n")
    (pkg / "__init__.py").write_text("from .graph import make_graphed_callables\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        del sys.modules[name]


def test_transformer_engines_helper_is_swapped_where_it_imports(fake_transformer_engine):
    import transformer_engine.pytorch as te
    import transformer_engine.pytorch.graph as te_graph

    original = te.make_graphed_callables
    with swapped_make_graphed_callables() as swap:
        assert swap.te_status == "swapped"
        assert te.make_graphed_callables is cudagraphs.make_graphed_callables
        assert te_graph.make_graphed_callables is cudagraphs.make_graphed_callables
    assert te.make_graphed_callables is original and te_graph.make_graphed_callables is original
    with swapped_make_graphed_callables(transformer_engine=False) as swap:
        assert te.make_graphed_callables is original and swap.te_status == "not installed"


def test_a_broken_transformer_engine_is_left_alone_and_said(tmp_path, monkeypatch, caplog):
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("raise OSError('libcudart')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with swapped_make_graphed_callables() as swap:
            assert swap.te_status.startswith("left alone: importing it failed (OSError")
            assert torch.cuda.make_graphed_callables is torch_signature_helper
        assert "not swapped" in caplog.text
    finally:
        sys.modules.pop("transformer_engine", None)
    assert torch.cuda.make_graphed_callables is TORCH_HELPER


def test_the_plugin_swaps_before_test_modules_import_and_restores_after(pytester):
    pytester.makepyfile(
        test_upstream_like=textwrap.dedent(
            """
            import torch
            from torch.cuda import make_graphed_callables  # bound at import

            from cudagraphs.integrations.upstream import torch_signature_helper


            def test_sees_ours(cudagraphs_swap):
                assert torch.cuda.make_graphed_callables is torch_signature_helper
                assert make_graphed_callables is torch_signature_helper
                assert "torch.cuda.make_graphed_callables" in cudagraphs_swap.sites
            """
        )
    )
    result = pytester.runpytest_inprocess(
        "-p", "cudagraphs.pytest_plugin", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["cudagraphs: make_graphed_callables swapped in at torch.cuda.*"])
    assert torch.cuda.make_graphed_callables is TORCH_HELPER, "the run must restore torch's"


def test_without_the_plugin_nothing_is_swapped(pytester):
    pytester.makepyfile(
        test_plain="import torch\n\n\ndef test_torchs():\n"
        "    assert torch.cuda.make_graphed_callables.__module__ == 'torch.cuda.graphs'\n"
    )
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
