"""Chained inputs of partial graphs on the CPU (partial/chaining.py): which recorded
calls received another target's output, the sharing a captured group asks the core
for, the eager fallback when a chained input gets another tensor, the speed check's
call, and the memory stats. The GPU tests capture real chained graphs."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import cudagraphs.core
from cudagraphs.core.sharing import BufferSharing
from cudagraphs.errors import ChainedInputError, Mismatch
from cudagraphs.partial import PartialCudaGraphManager
from cudagraphs.partial.chaining import OutputLinks, group_sharing
from cudagraphs.partial.contract import ContractSet
from cudagraphs.partial.recording import RecordedVariant, TargetRecording
from cudagraphs.partial.replay import TargetDispatcher
from cudagraphs.partial.speed import chained_call
from cudagraphs.partial.stats import stats_of
from cudagraphs.partial.vocabulary import Target
from helpers.partial_core import FakeCore
from helpers.partial_manager import NARROW, KwToy
from helpers.toy_models import Toy

LOGGER = "cudagraphs.partial.manager"


def stand_in(variants=1):
    """What OutputLinks and group_sharing read of a target: its variants."""
    return SimpleNamespace(variants=[RecordedVariant(None, None) for _ in range(variants)])


# ---- OutputLinks ------------------------------------------------------------------------
def test_an_input_that_is_an_earlier_output_object_is_linked_by_tensor_index():
    a, b, links = stand_in(), stand_in(), OutputLinks()
    t0, t1 = torch.zeros(2), torch.ones(2)
    links.note_output(a, 0, (3, t0, {"k": t1}), forward=1)  # tensor outputs 0 and 1
    params = (torch.zeros(1), torch.zeros(1))
    # Tensors: params 0-1, then args (x=2), then keywords sorted (a=3, z=4).
    links.note_call(b, b.variants[0], params, (torch.zeros(2), 5), {"z": t0, "a": t1}, forward=1)
    assert b.variants[0].chained == {3: (a, 0, 1), 4: (a, 0, 0)}
    assert a.variants[0].chained is None, "a's own call was not noted"


def test_copies_views_equal_values_and_a_targets_own_output_are_not_links():
    a, links = stand_in(), OutputLinks()
    out = torch.arange(3.0)
    links.note_output(a, 0, out, forward=1)
    links.note_call(a, a.variants[0], (), (out,), {}, forward=1)
    b = stand_in()
    links.note_call(
        b, b.variants[0], (), (out.clone(), out.view(3), out.detach(), out + 0), {}, forward=1
    )
    assert a.variants[0].chained == {} and b.variants[0].chained == {}


def test_a_link_is_kept_only_when_every_call_of_the_variant_had_it():
    a, b, links = stand_in(2), stand_in(), OutputLinks()
    for forward, (variant, keep) in enumerate([(0, True), (0, True), (1, True), (0, False)]):
        out = torch.zeros(2)
        links.note_output(a, variant, out, forward=forward)
        links.note_call(b, b.variants[0], (), (out if keep else out.clone(),), {}, forward=forward)
        if forward == 1:
            assert b.variants[0].chained == {0: (a, 0, 0)}, "same source twice: kept"
        if forward == 2:
            assert b.variants[0].chained == {}, "another source variant at 0: dropped"
    c = stand_in()
    for forward, keep in enumerate([False, True]):
        out = torch.zeros(2)
        links.note_output(a, 0, out, forward=forward)
        links.note_call(c, c.variants[0], (), (out if keep else out.clone(),), {}, forward=forward)
    assert c.variants[0].chained == {}, "a later link does not revive a missing one"


def test_a_captured_variant_keeps_the_links_it_was_captured_with():
    # A later recording (to add another variant) may call the captured one again.
    a, b, links = stand_in(), stand_in(), OutputLinks()
    b.variants[0].graph = object()
    out = torch.zeros(2)
    links.note_output(a, 0, out, forward=1)
    links.note_call(b, b.variants[0], (), (out,), {}, forward=1)
    assert b.variants[0].chained is None


def test_a_fresh_recording_links_calls_made_outside_any_forward():
    # Without model parts forward is None for every call: one forward from the start.
    a, b, links = stand_in(), stand_in(), OutputLinks()
    out = torch.zeros(2)
    links.note_output(a, 0, out, forward=None)
    links.note_call(b, b.variants[0], (), (out,), {}, forward=None)
    assert b.variants[0].chained == {0: (a, 0, 0)}


def test_group_sharing_never_links_a_call_to_itself():
    a = stand_in()
    a.variants[0].chained = {0: (a, 0, 0)}
    assert group_sharing([(a, 0)]) == BufferSharing(grad_outputs=True, chained_inputs={})


def test_outputs_of_an_earlier_forward_are_forgotten():
    a, b, links = stand_in(), stand_in(), OutputLinks()
    out = torch.zeros(2)
    links.note_output(a, 0, out, forward=1)
    links.note_call(b, b.variants[0], (), (out,), {}, forward=2)
    assert b.variants[0].chained == {}
    c = stand_in()  # forwards that cannot be told apart (None) are one forward
    links.note_output(a, 0, out, forward=None)
    links.note_call(c, c.variants[0], (), (out,), {}, forward=None)
    assert c.variants[0].chained == {0: (a, 0, 0)}
    links.clear()
    d = stand_in()
    links.note_call(d, d.variants[0], (), (out,), {}, forward=None)
    assert d.variants[0].chained == {}


# ---- group_sharing ----------------------------------------------------------------------
def test_group_sharing_links_sources_captured_earlier_in_the_group_by_position():
    a, b, c, outside = stand_in(2), stand_in(), stand_in(), stand_in()
    twin = stand_in(2)  # equal to a by ==, but another target
    assert twin == a
    b.variants[0].chained = {4: (a, 1, 0), 5: (c, 0, 0), 6: (outside, 0, 0)}
    c.variants[0].chained = {0: (b, 0, 2), 1: (a, 0, 0), 2: (twin, 1, 0)}
    group = [(a, 1), (b, 0), (c, 0)]
    assert group_sharing(group) == BufferSharing(
        grad_outputs=True, chained_inputs={(1, 4): (0, 0), (2, 0): (1, 2)}
    )
    assert group_sharing([]) == BufferSharing(grad_outputs=True, chained_inputs={})


# ---- end to end: recording, then the sharing handed to the core -------------------------
@pytest.fixture
def core(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    fake = FakeCore()
    monkeypatch.setattr(cudagraphs.core, "make_graphed_callables", fake)
    return fake


class Stepped(Toy):
    """Toy whose block 1 gets a copy of block 0's output in the forwards listed in
    ``copied``, and block 0's output of the forward before in those in ``stale``."""

    def __init__(self, copied=(), stale=()):
        super().__init__()
        self.copied, self.stale, self.n, self.last = set(copied), set(stale), 0, None

    def forward(self, x):
        self.n += 1
        h = self.layers[0](x)
        fed = h.clone() if self.n in self.copied else h
        out = self.layers[1](self.last if self.n in self.stale else fed)
        self.last = h
        return out


def captured(core, model, forwards=1, backward=True, **kwargs):
    mgr = PartialCudaGraphManager.from_model_parts(
        model, scopes=("moe_router",), include="layers.?", speed_check=False, **kwargs
    )
    mgr.start_recording()
    for _ in range(forwards):
        out = model(torch.randn(2, 8, requires_grad=True))
        if backward:  # not when a forward reuses the last one's graph
            out.sum().backward()
    mgr.capture()
    return mgr


def x_index(model):
    # Block 1's graph takes its parameters first, then x.
    return len(list(model.layers[1].parameters()))


def test_block_1_reads_block_0s_output_in_place(core):
    model = Toy()
    mgr = captured(core, model)
    assert [r.name for r in mgr.recordings] == ["layers.0", "layers.1"]
    assert x_index(model) == 4
    assert core.sharing == [
        BufferSharing(grad_outputs=True, chained_inputs={(1, x_index(model)): (0, 0)})
    ]
    assert all(v.chained is None for r in mgr.recordings for v in r.variants), "dropped"
    model(torch.randn(2, 8, requires_grad=True))
    assert core.replays == 2 and mgr.stats()["replayed"] == 2
    mgr.close()


def test_every_recorded_micro_batch_chained_keeps_the_link(core):
    model = Stepped()
    mgr = captured(core, model, forwards=2)
    assert core.sharing == [
        BufferSharing(grad_outputs=True, chained_inputs={(1, x_index(model)): (0, 0)})
    ]
    mgr.close()


@pytest.mark.parametrize(
    "copied, stale, forwards",
    [
        ({1}, (), 1),  # a copy between the layers
        ({2}, (), 2),  # one of two micro-batches copied
        ({1}, (), 2),  # the other one
        ((), {2}, 2),  # block 0's output of the forward before
    ],
)
def test_calls_not_fed_the_output_itself_record_no_link(core, copied, stale, forwards):
    mgr = captured(core, Stepped(copied, stale), forwards=forwards, backward=not stale)
    assert core.sharing == [BufferSharing(grad_outputs=True, chained_inputs={})]
    assert len(mgr.recordings[1].variants) == 1
    mgr.close()


def test_a_capture_backend_of_the_users_gets_no_sharing(core):
    seen = []

    def backend(callables, sample_args, sample_kwargs):
        seen.append(len(callables))
        return list(callables)

    mgr = captured(core, Toy(), capture_backend=backend)
    assert seen == [2] and core.sharing == []
    mgr.close()


# ---- dispatch: a chained input that got another tensor --------------------------------
def refusing_second(callables, sample_args, sample_kwargs):
    """Block 0 replays (eagerly); block 1's graph refuses every call as the core does
    for an input that is not its source's output."""

    def refuse(*args, **kwargs):
        mismatch = Mismatch("args[5]", "chained input", "the output of layers.0", "Tensor")
        raise ChainedInputError("layers.1: not that output", [mismatch])

    return [callables[0], refuse]


def test_a_refused_chained_input_runs_eagerly_counted_and_said_once(caplog, monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        model, scopes=("moe_router",), include="layers.?", capture_backend=refusing_second
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = model(x)
        model(x)
    stats = mgr.stats()
    assert stats["fallback_unchained_input"] == 2 and stats["fallbacks"] == 2
    assert stats["replayed"] == 2 and "fallback_param_storage" not in stats
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [
        "partial graphs: layers.1 ran eagerly (reason 'unchained_input'): its graph reads "
        "an input in place from another target's graph output (no copy), and this call "
        "passed another tensor there, usually because that target ran eagerly for this "
        "call.\nlayers.1: not that output\nFix: none needed, the eager run is correct; "
        "remove the first target's own fallback to graph both again.\nLater eager runs for "
        "this reason (this or any other target) are not logged again; "
        "stats()['fallback_unchained_input'] counts them all."
    ]
    mgr.close()
    assert torch.equal(out, model(x)), "the eager run computed the block"


def test_the_eager_run_of_a_refused_chained_input_gets_the_keywords(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    model = KwToy()  # its attention multiplies by the attention_mask keyword
    mgr = PartialCudaGraphManager.from_model_parts(
        [model], capture_backend=refusing_second, scopes=NARROW
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    x = torch.randn(2, 8)
    out = model(x)
    assert mgr.stats()["fallback_unchained_input"] == 1
    mgr.close()
    assert torch.equal(out, model(x)), "the eager run got the mask keyword"


# ---- the speed check's call -------------------------------------------------------------
def test_chained_call_passes_the_static_buffer_at_chained_positions():
    p0, p1 = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    x, mask = torch.randn(3, requires_grad=True), torch.randn(3)
    buf_x = torch.zeros(3, requires_grad=True)
    buf_mask = torch.zeros(3, requires_grad=True)
    graphs = SimpleNamespace(chained=((2, "a"), (3, "b")), static_inputs=[p0, p1, buf_x, buf_mask])
    args, kwargs = chained_call(SimpleNamespace(graphs=graphs), ((p0, p1), x, 7), {"mask": mask})
    assert args[0][0] is p0 and args[0][1] is p1 and args[2] == 7 and list(kwargs) == ["mask"]
    for got, buf, sample in ((args[1], buf_x, x), (kwargs["mask"], buf_mask, mask)):
        assert got is not buf and got.data_ptr() == buf.data_ptr()
        assert got.is_leaf and got.requires_grad == sample.requires_grad
    assert buf_mask.requires_grad, "the buffer itself is untouched"


def test_chained_call_keeps_the_sample_call_otherwise():
    args, kwargs = ((), torch.zeros(2)), {"k": 1}
    for graph in (lambda *a: None, SimpleNamespace(graphs=SimpleNamespace(chained=()))):
        got = chained_call(graph, args, kwargs)
        assert got[0] is args and got[1] is kwargs


def test_the_speed_check_times_a_chained_graph_with_its_buffer(monkeypatch):
    from cudagraphs.partial import speed

    buffer = torch.zeros(2, 8)
    seen = []

    class Graph:
        graphs = SimpleNamespace(chained=((0, "layers.0"),), static_inputs=[buffer])

        def __call__(self, params, x):  # parameters first, as the adapter takes them
            seen.append(x.data_ptr())
            return x * 2

    variant = RecordedVariant((torch.randn(2, 8, requires_grad=True),), {})
    target = recording("layer")
    target.variants = [variant]
    target.params = ()
    target.contracts = SimpleNamespace(variants=[SimpleNamespace(grad_enabled=True)])
    check = speed.SpeedCheck(rounds=1, iters=1, warmup=0, synchronize=lambda: None)
    monkeypatch.setattr(target, "capture_params", lambda i: ())
    speed.measure_group(check, [(target, 0)], [Graph()], [lambda params, x: x * 2])
    assert seen == [buffer.data_ptr()]


# ---- memory in stats() ------------------------------------------------------------------
def fake_graph(pool, buffers, eager_only=False):
    return SimpleNamespace(
        graphs=SimpleNamespace(eager_only=eager_only, pool_bytes=pool, buffer_bytes=buffers)
    )


def recording(kind, *graphs):
    rec = TargetRecording(Target(f"t_{kind}", nn.Linear(2, 2), kind), ContractSet())
    rec.variants = [RecordedVariant(None, None, graph=g) for g in graphs]
    return rec


def dispatcher(kind, *graphs):
    return TargetDispatcher(recording(kind, *graphs))


def test_stats_add_pool_and_buffer_bytes_per_scope():
    entries = [
        dispatcher("attention", fake_graph(100, 10), fake_graph(50, 5)),
        dispatcher("router", fake_graph(7, 1)),
        # Graphs that say nothing come first: the ones after them still count.
        dispatcher("custom", object(), fake_graph(9, 9, eager_only=True), fake_graph(1000, 0)),
        dispatcher("mlp", SimpleNamespace(graphs=SimpleNamespace(eager_only=False))),
        dispatcher("layer", SimpleNamespace(graphs=SimpleNamespace(pool_bytes=3))),  # no flag
    ]
    assert stats_of(entries, [], [], False) == {
        "captured": 8,
        "disabled": 0,
        "replayed": 0,
        "fallbacks": 0,
        "pool_bytes": 1157,
        "buffer_bytes": 16,
        "pool_bytes_attention": 150,
        "buffer_bytes_attention": 15,
        "pool_bytes_moe_router": 7,
        "buffer_bytes_moe_router": 1,
        "pool_bytes_include": 1000,
        "buffer_bytes_include": 0,
        "pool_bytes_mlp": 0,
        "buffer_bytes_mlp": 0,
    }


def test_graphs_without_memory_figures_add_no_keys():
    entries = [dispatcher("attention", object(), fake_graph(5, 5, eager_only=True))]
    assert stats_of(entries, [], [], False) == {
        "captured": 2,
        "disabled": 0,
        "replayed": 0,
        "fallbacks": 0,
    }


def test_a_managers_stats_report_its_graphs_memory(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)

    class Graphed:
        def __init__(self, fn, pool):
            self.fn, self.graphs = fn, fake_graph(pool, 8).graphs

        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    model = Toy()
    mgr = PartialCudaGraphManager.from_model_parts(
        model,
        scopes=("moe_router",),
        include="layers.?",
        capture_backend=lambda c, a, k: [Graphed(fn, 64 * (n + 1)) for n, fn in enumerate(c)],
    )
    mgr.start_recording()
    model(torch.randn(2, 8))
    mgr.capture()
    model(torch.randn(2, 8))
    stats = mgr.stats()
    assert {k: v for k, v in stats.items() if "bytes" in k} == {
        "pool_bytes": 192,
        "buffer_bytes": 16,
        "pool_bytes_include": 192,
        "buffer_bytes_include": 16,
    }
    assert stats["replayed"] == 2
    mgr.close()
