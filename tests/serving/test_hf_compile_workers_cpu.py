"""Inductor's compile workers started at a compiled capture's start (CPU): which
``compile_options`` run inductor, the start asks torch's own warm-up of the pool, and
the generator starts them only for an inductor compile."""

import pytest

from cudagraphs import torch_private
from cudagraphs.torch_private import start_compile_workers

transformers = pytest.importorskip("transformers")

from cudagraphs.serving.hf import generator as generator_module  # noqa: E402
from cudagraphs.serving.hf.generator import compiles_with_inductor  # noqa: E402
from helpers.hf_generate import captured  # noqa: E402
from helpers.hf_models import tiny  # noqa: E402


def _a_backend(gm, example_inputs):
    return gm.forward


@pytest.mark.parametrize(
    "options, want",
    [
        (None, False),
        ({}, True),
        ({"fullgraph": True}, True),
        ({"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}, True),
        ({"backend": "aot_eager"}, False),
        ({"backend": _a_backend}, False),
    ],
)
def test_which_compile_options_run_inductor(options, want):
    assert compiles_with_inductor(options) is want


def test_the_start_is_torchs_own_warm_up_of_the_pool(monkeypatch):
    import torch._inductor.async_compile as async_compile

    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    assert start_compile_workers() is True
    assert calls == [1]
    monkeypatch.delattr(async_compile, "maybe_warm_pool")
    assert start_compile_workers() is False


@pytest.mark.parametrize("inductor", [True, False])
def test_a_compiled_capture_starts_the_workers_only_for_inductor(
    monkeypatch, fresh_dynamo, inductor
):
    starts = []
    monkeypatch.setattr(generator_module, "start_compile_workers", lambda: starts.append(1))
    monkeypatch.setattr(generator_module, "compiles_with_inductor", lambda options: inductor)
    gen = captured(tiny("llama").eval(), (1,), compile_options={"backend": "aot_eager"})
    assert starts == ([1] if inductor else [])
    assert gen.stats()["capture_seconds"]["bucket(bs=1)"]["warmup_runs"] > 0, "it compiled"
    gen.close()


def test_an_eager_kernel_capture_starts_no_workers(monkeypatch):
    starts = []
    monkeypatch.setattr(torch_private, "start_compile_workers", lambda: starts.append(1))
    monkeypatch.setattr(generator_module, "start_compile_workers", lambda: starts.append(1))
    captured(tiny("llama").eval(), (1,)).close()
    assert starts == []
