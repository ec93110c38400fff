"""GraphedGenerator(compile_regions=...) on the CPU: a compiled decode step whose
decoder layers are one nested compile region (one subgraph called once per layer in
dynamo's trace), marked during decode steps only, the user's model left as it was, the
tokens HF's; ``decoder_layers`` against a plain reference; typed errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudagraphs import torch_private
from helpers.hf_models import CONFIGS, tiny, tiny_arch

transformers = pytest.importorskip("transformers")

from cudagraphs.errors import (  # noqa: E402
    CudaGraphCaptureError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
)
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from cudagraphs.serving.hf.regions import (  # noqa: E402
    LayerRegions,
    biased_projections,
    decoder_layers,
)
from helpers.hf_generate import (  # noqa: E402
    EOS,
    PAD,
    L,
    assert_serves_hf_tokens,
    captured,
    eager_backend,
    hf_generate,
    prompts,
)

NEW = 4


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


class Traces:
    """A dynamo backend that keeps every graph it is given and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def region_calls(self) -> list[list[str]]:
        """Per graph, the subgraph each invoke_subgraph call runs, in order."""
        hop = torch.ops.higher_order.invoke_subgraph
        return [[n.args[0].target for n in gm.graph.nodes if n.target is hop] for gm in self.graphs]


def _instance_forwards(model) -> list[bool]:
    return ["forward" in layer.__dict__ for layer in model.model.layers]


@pytest.fixture
def marks(monkeypatch):
    """Whether each decoder layer's forward was replaced, seen at every decode step
    (the runner's forward) and at every prefill (the model called on a prompt)."""
    record = {"decode": [], "prefill": []}
    decode_on = GraphedGenerator._decode_on
    generate = GraphedGenerator._generate

    def spy_decode(self, model, kv, input_ids, position_ids, attention_mask):
        record["decode"].append(_instance_forwards(self.model))
        return decode_on(self, model, kv, input_ids, position_ids, attention_mask)

    def spy_generate(self, request, *args):
        hook = self.model.model.layers[0].register_forward_pre_hook(
            lambda m, a: (
                record["prefill"].append(_instance_forwards(self.model))
                if a and a[0].shape[1] > 1
                else None
            )
        )
        try:
            return generate(self, request, *args)
        finally:
            hook.remove()

    monkeypatch.setattr(GraphedGenerator, "_decode_on", spy_decode)
    monkeypatch.setattr(GraphedGenerator, "_generate", spy_generate)
    return record


def test_a_compiled_decode_step_calls_one_region_once_per_layer(model, fresh_dynamo, marks):
    traces = Traces()
    gen = captured(model, (1, 2), compile_options={"backend": traces})
    calls = traces.region_calls()
    assert calls, "the capture compiled its decode step"
    # The compile of two rows or more: one body for every layer. Any other compile
    # (torch 2.11 compiles one row apart on the CPU): the layers after the first share
    # one (the first may trace apart: its input is the embedding's output).
    assert len(set(calls[0])) == 1, f"one compiled body for every layer: {calls[0]}"
    for graph_calls in calls:
        assert len(graph_calls) == len(model.model.layers)
        assert len(set(graph_calls[1:])) == 1, graph_calls
    assert gen.stats()["compile_regions"] == len(model.model.layers)
    assert marks["decode"] and all(all(m) for m in marks["decode"])
    ids, mask = prompts(2, seed=3)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert marks["prefill"] and not any(any(m) for m in marks["prefill"]), (
        "the prefill runs the layers as they were"
    )
    assert not any(_instance_forwards(model)), "the user's model is left as it was"
    assert sum(gen.stats()["replays"].values()) > 0


@pytest.mark.parametrize("upstream", [True, False], ids=["torch_caches", "memo"])
def test_the_layer_regions_schema_memo_is_on_only_where_torch_lacks_the_cache(
    model, fresh_dynamo, monkeypatch, upstream
):
    # Through AOTAutograd (the region mutates the cache it is given, so its schema is
    # made); where torch keeps that schema itself the memo stays out.
    monkeypatch.setattr(torch_private, "upstream_caches_subgraph_schemas", lambda: upstream)
    gen = captured(model, (1, 2), compile_options={"backend": "aot_eager"})
    memo = gen.stats()["subgraph_schemas"]
    assert memo["active"] is (not upstream)
    assert (memo["built"] >= 1) is (not upstream), memo
    ids, mask = prompts(2, seed=5)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert sum(gen.stats()["replays"].values()) > 0


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "deepseek_v3", "mistral", "gemma", "olmoe"]
)
def test_the_schema_memo_keeps_each_familys_tokens(family, fresh_dynamo, monkeypatch):
    # The memo is on for torch 2.11 (the GPU machine's), and the families' layer bodies
    # differ: MoE experts (grouped_mm), MLA attention, scaled embeddings. Forced on here,
    # each family's compiled decode through AOTAutograd gives HF's tokens.
    model = tiny(family).eval() if family in CONFIGS else tiny_arch(family).eval()
    if any(hasattr(m, "experts") for m in model.modules()):
        model.set_experts_implementation("grouped_mm")
    monkeypatch.setattr(torch_private, "upstream_caches_subgraph_schemas", lambda: False)
    gen = captured(model, (1, 2), compile_options={"backend": "aot_eager"})
    assert gen.stats()["subgraph_schemas"]["active"] is True
    assert gen.stats()["compile_regions"] == len(model.model.layers)
    ids, mask = prompts(2, seed=5)
    ids = ids % model.config.vocab_size
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert sum(gen.stats()["replays"].values()) > 0


def test_the_eager_kernel_generator_has_no_schema_memo(model):
    gen = captured(model, (1,))
    assert gen.stats()["subgraph_schemas"] == {"active": False, "built": 0, "reused": 0}


def test_compile_regions_false_compiles_the_whole_model_as_one(model, fresh_dynamo, marks):
    traces = Traces()
    gen = captured(model, (1, 2), compile_options={"backend": traces}, compile_regions=False)
    assert traces.graphs and all(calls == [] for calls in traces.region_calls())
    assert gen.stats()["compile_regions"] == 0
    assert not any(any(m) for m in marks["decode"])


def test_the_models_own_kernels_mark_nothing(model, marks):
    gen = captured(model, (1, 2))
    assert gen.stats()["compile_regions"] == 0
    assert marks["decode"] and not any(any(m) for m in marks["decode"])


def test_an_instance_forward_of_the_users_is_put_back(model):
    layer = model.model.layers[0]
    own = layer.forward  # a bound method, set on the instance as a user might
    layer.forward = own
    try:
        regions = LayerRegions.of(tuple(model.model.layers))
        with pytest.raises(RuntimeError, match="inside"), regions.marked():
            assert layer.forward is regions.forwards[0]
            raise RuntimeError("an error inside the decode step")
        assert layer.__dict__["forward"] is own
        assert "forward" not in model.model.layers[1].__dict__
    finally:
        del layer.forward


def required_regions(model, backend) -> GraphedGenerator:
    """A generator of buckets 1 and 2 whose decode step compiles through ``backend``
    with layer regions required, captured with the eager backend."""
    return GraphedGenerator(
        model,
        (1, 2),
        max_cache_len=L,
        capture_backend=eager_backend,
        require_all_buckets=True,
        compile_options={"backend": backend},
        compile_regions=True,
    )


def test_a_failed_decode_step_leaves_the_layers_unmarked_and_the_next_capture_works(
    model, fresh_dynamo, monkeypatch
):
    # compile_regions=True: None would compile the whole model after the error
    gen = required_regions(model, Traces())
    decode_on = GraphedGenerator._decode_on
    calls = {"n": 0}

    def fails_once(self, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            assert all(_instance_forwards(model)), "marked inside the step"
            raise RuntimeError("boom in the first decode step")
        return decode_on(self, *args)

    monkeypatch.setattr(GraphedGenerator, "_decode_on", fails_once)
    with pytest.raises(CudaGraphCaptureError) as failed:
        gen.capture(progress=False)
    assert "boom in the first decode step" in str(failed.value) + str(failed.value.__cause__)
    assert not any(_instance_forwards(model)), "put back after the error"
    gen.close()
    gen.capture(progress=False)
    ids, mask = prompts(1, seed=4)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert sum(gen.stats()["replays"].values()) > 0


@pytest.mark.parametrize("value", ["layers", 1, 0.5])
def test_a_value_that_is_no_bool_is_refused_by_name(model, value):
    with pytest.raises(CudaGraphsTypeError, match=r"compile_regions must be True, False or None"):
        GraphedGenerator(model, (1,), max_cache_len=L, compile_options={}, compile_regions=value)
    GraphedGenerator(model, (1,), max_cache_len=L, compile_options={})  # the next good one


def test_true_without_compile_options_is_refused_with_the_fix(model):
    with pytest.raises(CudaGraphsValueError, match=r"without compile_options.*Fix: pass"):
        GraphedGenerator(model, (1,), max_cache_len=L, compile_regions=True)


def test_true_for_a_model_declaring_no_layers_is_refused_with_the_fix(model, monkeypatch):
    monkeypatch.setattr(model, "_no_split_modules", [], raising=False)
    with pytest.raises(CudaGraphsValueError, match=r"declares no decoder layers.*Fix: leave"):
        GraphedGenerator(model, (1,), max_cache_len=L, compile_options={}, compile_regions=True)
    gen = GraphedGenerator(model, (1,), max_cache_len=L, compile_options={})
    assert gen.stats()["compile_regions"] == 0, "None: the whole model when none is declared"


# ---- decoder_layers against a plain reference ------------------------------------------
KINDS = ("Block", "Attention", "Mlp", "Other")
_CLASSES = {k: type(k, (nn.Module,), {}) for k in KINDS}


def _tree(draw_spec) -> nn.Module:
    kind, children = draw_spec
    module = _CLASSES[kind]()
    for i, child in enumerate(children):
        module.add_module(f"c{i}", _tree(child))
    return module


_specs = st.recursive(
    st.tuples(st.sampled_from(KINDS), st.just(())),
    lambda inner: st.tuples(st.sampled_from(KINDS), st.lists(inner, max_size=3).map(tuple)),
    max_leaves=12,
)


def _reference(module: nn.Module, names: set[str]) -> list[nn.Module]:
    if type(module).__name__ in names:
        return [module]
    return [m for child in module.children() for m in _reference(child, names)]


@settings(max_examples=300, deadline=None)
@given(spec=_specs, names=st.sets(st.sampled_from(KINDS + ("Absent",))))
def test_decoder_layers_are_the_outermost_declared_modules_in_order(spec, names):
    root = _tree(spec)
    root._no_split_modules = sorted(names)
    assert list(decoder_layers(root)) == _reference(root, names)


def test_a_model_without_the_declaration_has_no_decoder_layers():
    assert decoder_layers(nn.Sequential(nn.Linear(2, 2))) == ()


class InductorTraces(Traces):
    """Inductor as the backend (its lowering is where the storage's size would be
    compared with the batch), keeping each graph dynamo hands it."""

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)


def test_an_inductor_capture_keeps_the_batch_dynamic_and_one_body_for_every_layer(fresh_dynamo):
    # The largest bucket's rows are not all of the storage (a spare row): were they,
    # functionalization's write-back would compare the view with the storage and
    # specialize the batch to the largest bucket, failing the capture.
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", **{**CONFIGS["llama"], "num_hidden_layers": 3}
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    traces = InductorTraces()
    gen = captured(model, (2, 4), compile_options={"backend": traces}, require_all_buckets=True)
    assert len(traces.graphs) == 1, "one compile for both buckets"
    (calls,) = traces.region_calls()
    assert len(calls) == 3 and len(set(calls)) == 1, calls
    assert_serves_hf_tokens(gen, model, new=NEW)
    assert gen.stats()["replays"]["bucket(bs=4)"] > 0


def _biased_llama():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", **{**CONFIGS["llama"], "attention_bias": True}
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_biased_projections_are_named_within_the_layer():
    layer = _biased_llama().model.layers[0]
    assert biased_projections(layer) == [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
    ]
    assert biased_projections(tiny("llama").model.layers[0]) == []
    assert biased_projections(nn.LayerNorm(4)) == [], "a norm's weight is 1-D"


def test_a_model_with_biased_projections_compiles_whole_by_default(fresh_dynamo, caplog):
    model = _biased_llama()
    traces = InductorTraces()
    with caplog.at_level("INFO", logger="cudagraphs.serving.hf.regions"):
        gen = captured(model, (2, 4), compile_options={"backend": traces}, require_all_buckets=True)
    assert "biased projections (self_attn.q_proj" in caplog.text
    assert gen.stats()["compile_regions"] == 0
    assert traces.region_calls() == [[]]
    ids, mask = prompts(3, seed=3)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert gen.stats()["replays"]["bucket(bs=4)"] > 0


def test_true_for_biased_projections_is_refused_naming_them():
    model = _biased_llama()
    with pytest.raises(
        CudaGraphsValueError, match=r"biased projections \(self_attn\.q_proj.*Fix: leave"
    ):
        GraphedGenerator(model, (1,), max_cache_len=L, compile_options={}, compile_regions=True)
    GraphedGenerator(model, (1,), max_cache_len=L, compile_options={}, compile_regions=False)


class RefusesRegions(Traces):
    """A backend that fails any graph calling a layer body, as torch does for some
    models and versions, and runs the others as traced."""

    def __call__(self, gm, example_inputs):
        hop = torch.ops.higher_order.invoke_subgraph
        if any(n.target is hop for n in gm.graph.nodes):
            raise RuntimeError("no nested regions here")
        return super().__call__(gm, example_inputs)


def test_a_region_compile_that_fails_falls_back_to_the_whole_model(model, fresh_dynamo, caplog):
    backend = RefusesRegions()
    with caplog.at_level("WARNING", logger="cudagraphs.serving.hf.generator"):
        gen = captured(
            model, (1, 2), compile_options={"backend": backend}, require_all_buckets=True
        )
    assert "did not compile as one body" in caplog.text and "no nested regions here" in caplog.text
    stats = gen.stats()
    assert stats["compile_regions"] == 0
    assert "no nested regions here" in stats["compile_regions_error"]
    assert backend.graphs and all(calls == [] for calls in backend.region_calls())
    # The fallback happens in the largest bucket's first warmup: the storage keeps its
    # spare row, and the views are marked dynamic as the whole model's compile needs.
    assert gen.kv.keys[0].shape[0] == 3 and gen.kv.dynamic_rows
    frames = {b.rows: t.compiled_frames for b, t in gen.runner.capture_times.items()}
    assert frames[2] >= 1, "the compiles are the largest bucket's"
    ids, mask = prompts(2, seed=5)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert stats["replays"] is not None and sum(gen.stats()["replays"].values()) > 0


def test_true_turns_a_failed_region_compile_into_a_capture_error(model, fresh_dynamo):
    gen = required_regions(model, RefusesRegions())
    with pytest.raises(CudaGraphCaptureError, match=r"did not compile as one body.*Fix: leave"):
        gen.capture(progress=False)
    assert not any(_instance_forwards(model))
    gen.close()
    ok = captured(model, (1, 2), compile_options={"backend": Traces()}, compile_regions=True)
    assert ok.stats()["compile_regions"] == len(model.model.layers)


# ---- check_compile_regions against a plain decision table ------------------------------
def _toy(layers: int, biased: bool) -> nn.Module:
    root = nn.Module()
    root.blocks = nn.ModuleList(_CLASSES["Block"]() for _ in range(layers))
    for block in root.blocks:
        block.proj = nn.Linear(2, 2, bias=biased)
    root._no_split_modules = ["Block"]
    return root


def _table(value, compiled: bool, layers: int, biased: bool) -> str:
    """What the check answers for None, True or False: "value" (an error), "none" or
    "regions"."""
    if value is False or (value is None and not compiled):
        return "none"
    if value is True and not compiled:
        return "value"
    if value is None:
        return "regions" if layers >= 2 and not biased else "none"
    return "value" if layers == 0 or biased else "regions"


@settings(max_examples=200, deadline=None)
@given(
    value=st.sampled_from([None, True, False, "yes", 1.0, 2]),
    compiled=st.booleans(),
    layers=st.integers(0, 3),
    biased=st.booleans(),
)
def test_the_regions_check_answers_as_a_plain_table(value, compiled, layers, biased):
    from cudagraphs.serving.hf.regions import check_compile_regions

    if not isinstance(value, (bool, type(None))):
        want = "type"
    else:
        want = _table(value, compiled, layers, biased)
    model = _toy(layers, biased)
    try:
        got = check_compile_regions(value, model, compiled)
    except CudaGraphsTypeError:
        answer = "type"
    except CudaGraphsValueError:
        answer = "value"
    else:
        answer = "none" if got is None else "regions"
        if got is not None:
            assert got.layers == tuple(model.blocks)
    assert answer == want, (value, compiled, layers, biased)
