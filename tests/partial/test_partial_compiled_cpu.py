"""Partial graphs over compiled targets, on the CPU: with ``compile_options`` each
target's graphed function is ``torch.compile``d (here with a counting dynamo backend
that runs the traced ops eagerly, and an eager capture backend), training stays equal
to eager bit for bit, and compiled models, compiled submodules and the Trainer's
``torch_compile=True`` are refused with the fix."""

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torch._dynamo")

import torch._dynamo.testing  # noqa: E402

from cudagraphs.errors import CudaGraphsValueError  # noqa: E402
from cudagraphs.partial import PartialCudaGraphManager  # noqa: E402
from cudagraphs.partial import graphing as graphing_module  # noqa: E402
from cudagraphs.partial.build import refuse_compiled_parts  # noqa: E402
from cudagraphs.partial.graphing import TargetCompile, graphed_function  # noqa: E402
from helpers.hf_models import tiny  # noqa: E402
from helpers.partial_training import backend, train_and_compare  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_compiled_targets_train_equal_to_eager_and_their_graphed_functions_are_compiled():
    model = tiny("llama")
    ref = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounter()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=backend, speed_check=False, compile_options={"backend": counter}
    )
    try:
        assert mgr.compile_options == {"backend": counter}
        stats = train_and_compare(model, ref, mgr, steps=3)
        assert stats["captured"] == 2 and stats["replayed"] == 4 and stats["fallbacks"] == 0
        # Each replay ran the compiled function; the two layers, alike in structure,
        # share one compiled graph (dynamo takes the modules as inputs).
        assert counter.frame_count == 1, counter.frame_count
        assert counter.op_count > 0
    finally:
        mgr.close()


def test_without_compile_options_the_graphed_function_is_the_plain_one():
    model = tiny("llama")
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend)
    try:
        assert mgr.compile_options is None
        fn = graphed_function(mgr.recordings[0])
        assert fn.__qualname__ == f"partial[{mgr.recordings[0].name}]"
        assert not hasattr(fn, "_torchdynamo_orig_callable")
    finally:
        mgr.close()


def test_compile_options_are_copied_and_a_compiled_function_keeps_the_targets_name():
    model = tiny("llama")
    options = {"backend": "eager"}
    mgr = PartialCudaGraphManager.from_model_parts(
        model, capture_backend=backend, compile_options=options
    )
    try:
        options["backend"] = "inductor"
        assert mgr.compile_options == {"backend": "eager"}
        compiler = TargetCompile(mgr.compile_options)
        fn = graphed_function(mgr.recordings[0], compiler)
        assert fn is not None and fn.__qualname__ == f"partial[{mgr.recordings[0].name}]"
        assert hasattr(fn.compiled, "_torchdynamo_orig_callable")
        # Both layers are one class: one code object, so one dynamo cache, for both.
        again = graphed_function(mgr.recordings[1], compiler)
        code = compiler.codes[type(mgr.recordings[0].target.module)]
        assert code.co_name == "partial_LlamaDecoderLayer"
        assert again.compiled._torchdynamo_orig_callable.__code__ is code
        assert fn.compiled._torchdynamo_orig_callable.__code__ is code
        # The function keeps its own name and qualified name; only the code is the class's.
        assert fn.compiled._torchdynamo_orig_callable.__name__ == "run"
        original = again.compiled._torchdynamo_orig_callable
        assert original.__qualname__ == f"partial[{mgr.recordings[1].name}]"
    finally:
        mgr.close()


@pytest.mark.parametrize(
    "options, said",
    [
        ({"mode": "reduce-overhead"}, "mode='reduce-overhead'"),
        ({"mode": "max-autotune"}, "mode='max-autotune'"),
        ({"options": {"triton.cudagraphs": True}}, "triton.cudagraphs=True"),
    ],
)
def test_compile_modes_that_record_graphs_of_their_own_are_refused(options, said):
    model = tiny("llama")
    with pytest.raises(CudaGraphsValueError) as info:
        PartialCudaGraphManager.from_model_parts(model, compile_options=options)
    assert str(info.value).startswith(f"from_model_parts: compile_options with {said} make")
    assert "mode='max-autotune-no-cudagraphs'" in str(info.value)
    assert "forward" not in model.model.layers[0].__dict__, "nothing was installed"


def test_a_model_compiled_whole_is_refused_and_the_uncompiled_one_then_graphs():
    model = tiny("llama")
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(CudaGraphsValueError) as info:
        PartialCudaGraphManager.from_model_parts(compiled, capture_backend=backend)
    msg = str(info.value)
    assert msg.startswith(
        "from_model_parts: compiled modules in the model parts: model part 0 "
        "(torch.compile(module)). A compiled model would trace"
    )
    assert "compile_options={}" in msg and "not its wrapper" in msg
    mgr = PartialCudaGraphManager.from_model_parts(model, capture_backend=backend)
    assert mgr is not None and len(mgr.recordings) == 2
    mgr.close()


def test_every_compiled_submodule_is_named_with_how_it_was_compiled():
    first, second = tiny("llama"), tiny("llama")
    first.model.layers[1].compile(backend="eager")
    second.model.layers[0].self_attn.compile(backend="eager")
    with pytest.raises(CudaGraphsValueError) as info:
        refuse_compiled_parts([first, second])
    assert (
        "model part 0 'model.layers.1' (module.compile()); "
        "model part 1 'model.layers.0.self_attn' (module.compile())."
    ) in str(info.value)
    refuse_compiled_parts([tiny("llama")])  # nothing compiled: no error


def test_a_trainers_torch_compile_is_refused_with_the_callbacks_compile_options():
    pytest.importorskip("transformers")
    from cudagraphs.integrations.hf import PartialGraphsCallback, refuse_trainer_compile

    args = SimpleNamespace(
        torch_compile=True, torch_compile_backend="inductor", torch_compile_mode="reduce-overhead"
    )
    with pytest.raises(CudaGraphsValueError) as info:
        refuse_trainer_compile(args)
    assert str(info.value) == (
        "PartialGraphsCallback: TrainingArguments(torch_compile=True) compiles the whole "
        "model, whose compiled code would trace the partial graphs' dispatching forwards. "
        "Fix: set torch_compile=False and pass PartialGraphsCallback(compile_options="
        "{'backend': 'inductor'}): each graphed target then records its compiled forward "
        "and backward."
    )
    # dynamo's "cudagraphs" backend records graphs of its own too: not suggested.
    args = SimpleNamespace(
        torch_compile=True, torch_compile_backend="cudagraphs", torch_compile_mode=None
    )
    with pytest.raises(CudaGraphsValueError, match=r"compile_options=\{\}\)"):
        refuse_trainer_compile(args)
    refuse_trainer_compile(SimpleNamespace(torch_compile=False))
    refuse_trainer_compile(SimpleNamespace())
    callback = PartialGraphsCallback(compile_options={"mode": "max-autotune-no-cudagraphs"})
    assert callback._options["compile_options"] == {"mode": "max-autotune-no-cudagraphs"}
    with pytest.raises(CudaGraphsValueError, match="PartialGraphsCallback: compile_options"):
        PartialGraphsCallback(compile_options={"mode": "reduce-overhead"})
    with pytest.raises(CudaGraphsValueError, match="torch_compile=True"):
        callback.on_train_begin(args, SimpleNamespace(), SimpleNamespace(), model=tiny())
    assert callback.manager is None


def test_the_callbacks_compile_options_reach_every_targets_graphed_function(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from cudagraphs.integrations.hf import PartialGraphsCallback
    from helpers.trainer import Backend, losses, train

    model = tiny("llama")
    ref = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounter()
    callback = PartialGraphsCallback(
        capture_backend=Backend(), compile_options={"backend": counter}
    )
    trainer = train(tmp_path, model, [callback], steps=4)
    reference = train(tmp_path, ref, steps=4)
    assert losses(trainer) == losses(reference)
    stats = callback.stats()
    assert stats["captured"] == 2 and stats["replayed"] > 0 and stats["fallbacks"] == 0, stats
    assert counter.frame_count == 1 and counter.op_count > 0


# mutmut's copies of the sources call each function through a trampoline that reads
# the environment, where dynamo breaks the graph: the resumed frames are the
# trampoline's, shared by every class, and fill one cache after all.
@pytest.mark.skipif(
    "mutants" in Path(graphing_module.__file__).parts, reason="mutmut's copy of the sources"
)
def test_targets_of_other_classes_fill_dynamo_caches_of_their_own():
    # dynamo holds at most recompile_limit (8) entries per code object, then runs the
    # frame eagerly, said only in its log: ten target classes through one shared code
    # object would leave two uncompiled.
    from torch import nn

    counter = torch._dynamo.testing.CompileCounter()
    compiler = TargetCompile({"backend": counter})

    def layer_class(width):
        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(8, width)

            def forward(self, x):
                return torch.relu(self.proj(x))

        Layer.__name__ = f"Layer{width}"
        return Layer

    recs = []
    for width in range(4, 14):
        layer = layer_class(width)()
        names = tuple(n for n, _ in layer.named_parameters())
        recs.append((layer, names))
    x = torch.randn(2, 8)
    for layer, names in recs:
        rec = SimpleNamespace(
            target=SimpleNamespace(module=layer), param_names=names, name=type(layer).__name__
        )
        fn = graphed_function(rec, compiler)
        out = fn(tuple(layer.parameters()), x)
        assert torch.equal(out, layer(x))
    assert counter.frame_count == 10, "a target ran uncompiled"
    assert len(compiler.codes) == 10


@pytest.mark.parametrize(
    "args, suggested",
    [
        # Arguments with torch_compile alone: no backend or mode to carry over.
        (SimpleNamespace(torch_compile=True), {}),
        (
            SimpleNamespace(
                torch_compile=True,
                torch_compile_backend="inductor",
                torch_compile_mode="max-autotune-no-cudagraphs",
            ),
            {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
        ),
        (
            SimpleNamespace(
                torch_compile=True, torch_compile_backend=None, torch_compile_mode="max-autotune"
            ),
            {},
        ),
    ],
)
def test_the_trainer_refusal_carries_over_what_may_go_inside_our_graphs(args, suggested):
    pytest.importorskip("transformers")
    from cudagraphs.integrations.hf import refuse_trainer_compile

    with pytest.raises(CudaGraphsValueError) as info:
        refuse_trainer_compile(args)
    assert f"PartialGraphsCallback(compile_options={suggested!r})" in str(info.value)


@pytest.mark.usefixtures("fresh_dynamo")
def test_targets_of_a_class_reading_their_own_index_each_compile_none_given_up():
    # dynamo guards on each layer's own int: one compile per target in the class's one
    # cache, twelve in all, past dynamo's default limit of 8 and none run eagerly.
    from torch import nn

    from cudagraphs.compile_watch import CompileWatch

    class Indexed(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.layer_idx = index
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.proj(x) / (self.layer_idx + 1) ** 0.5

    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    layers = [Indexed(i) for i in range(12)]
    compiler = TargetCompile({"backend": backend})
    functions = [
        graphed_function(
            SimpleNamespace(
                target=SimpleNamespace(module=layer),
                param_names=("proj.weight", "proj.bias"),
                name=f"layers.{i}",
            ),
            compiler,
        )
        for i, layer in enumerate(layers)
    ]
    x = torch.randn(2, 8)
    watch = CompileWatch.start()
    for _ in range(2):
        for layer, function in zip(layers, functions):
            torch.testing.assert_close(function(tuple(layer.parameters()), x), layer(x))
    report = watch.finish()
    assert len(compiler.codes) == 1 and compiler.targets == {Indexed: 12}
    assert len(compiled) == 12 and report.failures == ()
