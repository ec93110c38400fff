"""CPU tests of ``benchmarks/_compiled.py``: torch's compiled training recipe as the
benchmarks build it (``torch.compile`` stood in for by the identity, so the structure
is what is tested): a device learning rate with a capturable foreach AdamW, one
``cudagraph_mark_step_begin`` per step under ``reduce-overhead`` only, the warmup
steps, and caches reset when building fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import script


@pytest.fixture
def recipe(monkeypatch):
    """The module, with what it compiled (the modes), marked, reset and asked of AdamW."""
    seen = SimpleNamespace(mod=script("_compiled"), compiled=[], marks=[], resets=[], asked=[])

    def fake_compile(fn, mode=None):
        seen.compiled.append(mode)
        return fn

    class AdamW(torch.optim.AdamW):
        # What the recipe asks for is recorded; a capturable AdamW needs a GPU, so the
        # stand-in steps the CPU's way.
        def __init__(self, params, **kwargs):
            seen.asked.append(dict(kwargs))
            super().__init__(params, lr=float(kwargs["lr"]), foreach=False)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: seen.marks.append(1))
    monkeypatch.setattr(torch.compiler, "reset", lambda: seen.resets.append(1))
    return seen


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize("mode, marked", [("reduce-overhead", True), ("default", False)])
def test_the_recipe_compiles_both_in_one_mode_and_marks_steps_only_with_trees(recipe, mode, marked):
    mod, compiled, marks, resets = recipe.mod, recipe.compiled, recipe.marks, recipe.resets
    net, x = _model(), torch.randn(4, 3)
    runs = []

    def run(forward):
        runs.append(forward)
        loss = forward(x).pow(2).mean()
        loss.backward()
        return loss.detach()

    built = mod.torch_compiled_recipe(net.parameters(), net, run, mode=mode, lr=0.1, device="cpu")
    assert compiled == [mode, mode]  # the forward, then the optimizer step
    assert len(runs) == mod.WARM_STEPS and all(f is net for f in runs)
    assert len(marks) == (mod.WARM_STEPS if marked else 0)
    (asked,) = recipe.asked
    assert isinstance(asked["lr"], torch.Tensor) and float(asked["lr"]) == pytest.approx(0.1)
    assert asked["capturable"] is True and asked["foreach"] is True
    assert all(p.grad is None for p in net.parameters()), "warmup ends with zero_grad"
    before = [p.detach().clone() for p in net.parameters()]
    loss = built.step()
    assert loss.shape == () and all(p.grad is None for p in net.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters())), "it stepped"
    built.compute()
    assert all(p.grad is not None for p in net.parameters()), "compute keeps the gradients"
    assert built.setup_s >= 0 and built.notes["optimizer"] == "compiled"
    assert resets == []


def test_a_failed_build_resets_torchs_compile_caches_and_raises(recipe):
    mod, resets = recipe.mod, recipe.resets
    net = _model()

    def run(forward):
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        mod.torch_compiled_recipe(net.parameters(), net, run, mode="default", lr=0.1, device="cpu")
    assert resets == [1]


def test_ours_compiled_graphs_the_step_over_the_compiled_forward(recipe, monkeypatch):
    import cudagraphs

    mod = recipe.mod
    got = {}

    class Graphed:
        stats = SimpleNamespace(compile_seconds=1.234, optimizer_changes=["fused", "lr"])
        resets = 0

        def __init__(self, optimizer_compiled):
            self.optimizer_compiled = optimizer_compiled

        def reset(self):
            Graphed.resets += 1

    def fake_graph_train_step(step_fn, sample, *, optimizer, optimizer_impl):
        got.update(loss=step_fn(sample), sample=sample, optimizer=optimizer, impl=optimizer_impl)
        # What the real step reports: "compiled" (or "auto" on a compiling step) compiles.
        return Graphed(optimizer_impl == "compiled")

    monkeypatch.setattr(cudagraphs, "graph_train_step", fake_graph_train_step)
    net, x = _model(), torch.randn(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ours = mod.ours_compiled(net, lambda f, b: f(b).sum(), x, opt, "model")
    assert recipe.compiled == [None]  # mode="default": torch.compile's own default
    assert torch.equal(got["loss"], net(x).sum()) and got["sample"] is x and got["optimizer"] is opt
    assert got["impl"] == "fused", "the fused variant asks for the fused kernel by name"
    assert ours.notes == {
        "compile": 'torch.compile(model), mode="default"',
        "compile_seconds": 1.23,
        "optimizer": "fused; lr",
    }
    ours.release()
    assert Graphed.resets == 1 and recipe.resets == [1]
    # optimizer_impl="compiled" reaches graph_train_step and the notes say so.
    ours = mod.ours_compiled(net, lambda f, b: f(b).sum(), x, opt, "model", "compiled")
    assert got["impl"] == "compiled"
    assert ours.notes["compile"] == 'torch.compile(model), mode="default"; optimizer step compiled'
    ours.release()

    def failing(step_fn, sample, *, optimizer, optimizer_impl):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(cudagraphs, "graph_train_step", failing)
    with pytest.raises(RuntimeError, match="capture failed"):
        mod.ours_compiled(net, lambda f, b: f(b).sum(), x, opt, "model")
    assert recipe.resets == [1, 1, 1]
