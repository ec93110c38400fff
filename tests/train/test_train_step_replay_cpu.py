"""``GraphedTrainStep`` captured and replayed on the CPU: the replay path as written
(``__call__``), over stand-in graphs that run the captured step again and write where
the capture left its outputs and gradients (``helpers.stand_in_train_step``).

What is checked against the documented eager loop: every step's loss, parameters and
optimizer state, bit for bit; each call replays exactly its graphs, once per
micro-batch; ``.grad`` handed out again after ``zero_grad``; the loss borrowed; and
every refusal (another shape, a changed hyperparameter, a wrong number of
micro-batches, a released step) before any replay, with the next good call working.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from cudagraphs import (
    CudaGraphInputError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
)
from cudagraphs.errors import GraphReleasedError
from cudagraphs.train import prepare_optimizer
from cudagraphs.train.step import GraphedTrainStep, graph_train_step
from helpers.stand_in_train_step import CpuPool, install_replaying
from helpers.train_cpu import (
    OPTIMIZERS,
    _assert_same_training,
    _batches,
    _eager_loop,
    _mlp,
    _step_fn,
)


@pytest.fixture
def replaying(monkeypatch):
    """``make(optimizer)`` installs a replaying capture for ``optimizer``, returned."""
    return install_replaying(monkeypatch)


def _pair(opt_name):
    model = _mlp()
    ref = copy.deepcopy(model)
    make = OPTIMIZERS[opt_name]
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    prepare_optimizer(ref_opt)
    return model, opt, ref, ref_opt


def _counting(step_fn):
    calls = [0]

    def step(batch):
        calls[0] += 1
        return step_fn(batch)

    return step, calls


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_replayed_steps_train_as_the_eager_loop(replaying, opt_name, max_grad_norm):
    model, opt, ref, ref_opt = _pair(opt_name)
    capture = replaying(opt)
    batches = _batches(6, seed=7)
    step = graph_train_step(
        _step_fn(model), batches[0], optimizer=opt, max_grad_norm=max_grad_norm, pool=CpuPool()
    )
    assert step.graphed and step.stats.graphs == 1
    assert capture.replays() == {"train step": 0}
    losses, norms = [], []
    for i, b in enumerate(batches):
        losses.append(step(b).clone())
        norms.append(None if step.grad_norm is None else step.grad_norm.clone())
        assert capture.replays() == {"train step": i + 1}
    ref_losses = _eager_loop(_step_fn(ref), ref_opt, batches, max_grad_norm=max_grad_norm)
    _assert_same_training(model, opt, ref, ref_opt, losses, ref_losses)
    if max_grad_norm is None:
        assert all(n is None for n in norms)
    else:
        assert all(n is not None and float(n) > 0 for n in norms)


def test_the_loss_is_borrowed_and_the_gradients_are_the_graphs(replaying):
    model, opt, *_ = _pair("adamw")
    replaying(opt)
    batches = _batches(3, seed=2)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, pool=CpuPool())
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    first = step(batches[1])
    second = step(batches[2])
    assert first is second, "the loss is the graph's output, overwritten by each step"
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_handed_out_again_after_zero_grad(replaying, set_to_none):
    model, opt, ref, ref_opt = _pair("sgd_momentum")
    replaying(opt)
    batches = _batches(4, seed=4)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, pool=CpuPool())
    grads = [p.grad for p in model.parameters()]
    losses = []
    for b in batches:
        losses.append(step(b).clone())
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert all(p.grad is None for p in model.parameters())
        else:
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    losses.append(step(batches[0]).clone())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    ref_losses = _eager_loop(_step_fn(ref), ref_opt, [*batches, batches[0]])
    _assert_same_training(model, opt, ref, ref_opt, losses, ref_losses)


@pytest.mark.parametrize("accumulation", [2, 3])
def test_accumulated_steps_replay_each_graph_as_often_as_written(replaying, accumulation):
    model, opt, ref, ref_opt = _pair("adam")
    capture = replaying(opt)
    data = _batches(3 * accumulation, seed=9)
    steps = [data[i : i + accumulation] for i in range(0, len(data), accumulation)]
    step = graph_train_step(
        _step_fn(model),
        steps[0][0],
        optimizer=opt,
        accumulation_steps=accumulation,
        pool=CpuPool(),
    )
    assert step.stats.graphs == 3
    names = [
        "train step: first micro-batch",
        "train step: later micro-batches",
        "train step: update",
    ]
    assert list(capture.replays()) == names
    losses = []
    for i, micro in enumerate(steps):
        out = step(micro)
        assert out.shape[0] == accumulation
        losses.append(out.clone())
        assert capture.replays() == dict(zip(names, [i + 1, (i + 1) * (accumulation - 1), i + 1]))
    ref_losses = _eager_loop(_step_fn(ref), ref_opt, steps, accumulation=accumulation)
    _assert_same_training(model, opt, ref, ref_opt, losses, ref_losses)


def test_every_refusal_comes_before_a_replay_and_the_next_good_call_works(replaying):
    model, opt, ref, ref_opt = _pair("adamw")
    capture = replaying(opt)
    batches = _batches(3, seed=6)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, pool=CpuPool())
    losses = [step(batches[0]).clone()]
    x, y = batches[1]
    with pytest.raises(CudaGraphInputError, match=r"batch\[0\]"):
        step((torch.randn(3, 4), y))
    with pytest.raises(CudaGraphInputError):
        step((x.double(), y))
    with pytest.raises(CudaGraphInputError, match="structure"):
        step([x, y])  # a list where the sample was a tuple
    decay = opt.param_groups[0]["weight_decay"]
    opt.param_groups[0]["weight_decay"] = decay * 2
    with pytest.raises(CudaGraphsStateError, match="weight_decay"):
        step(batches[1])
    opt.param_groups[0]["weight_decay"] = decay
    assert capture.replays() == {"train step": 1}, "a refused call replayed"
    losses += [step(b).clone() for b in batches[1:]]
    assert capture.replays() == {"train step": 3}
    ref_losses = _eager_loop(_step_fn(ref), ref_opt, batches)
    _assert_same_training(model, opt, ref, ref_opt, losses, ref_losses)


def test_a_wrong_number_of_micro_batches_is_refused_before_a_replay(replaying):
    model, opt, *_ = _pair("sgd_momentum")
    capture = replaying(opt)
    data = _batches(3, seed=1)
    step = graph_train_step(
        _step_fn(model), data[0], optimizer=opt, accumulation_steps=2, pool=CpuPool()
    )
    with pytest.raises(CudaGraphsTypeError, match="2 micro-batches; got a list of 3"):
        step(data)
    with pytest.raises(CudaGraphsTypeError, match="got a Tensor$"):
        step(data[0][0])
    assert set(capture.replays().values()) == {0}
    step(data[:2])
    assert capture.replays()["train step: update"] == 1


def test_a_released_step_refuses_calls_and_the_model_trains_eagerly_on(replaying):
    model, opt, ref, ref_opt = _pair("adam")
    capture = replaying(opt)
    batches = _batches(4, seed=8)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, pool=CpuPool())
    losses = [step(b).clone() for b in batches[:2]]
    step.reset()
    with pytest.raises(GraphReleasedError, match="reset"):
        step(batches[2])
    assert capture.replays() == {"train step": 2}
    losses += _eager_loop(_step_fn(model), opt, batches[2:])
    ref_losses = _eager_loop(_step_fn(ref), ref_opt, batches)
    _assert_same_training(model, opt, ref, ref_opt, losses, ref_losses)


def test_step_fn_runs_only_in_warmup_and_capture_not_in_the_step_itself(replaying):
    # The stand-in graph re-runs step_fn to replay; a call must never run it besides.
    model, opt, *_ = _pair("adamw")
    capture = replaying(opt)
    batches = _batches(3, seed=3)
    fn, calls = _counting(_step_fn(model))
    step = graph_train_step(fn, batches[0], optimizer=opt, warmup_steps=2, pool=CpuPool())
    assert calls[0] == 3  # two warmup steps and the capture
    for i, b in enumerate(batches):
        step(b)
        assert calls[0] == 3 + capture.replays()["train step"] == 3 + i + 1


def test_the_capture_runs_on_the_pools_stream_and_device_and_accounts_for_it(
    replaying, monkeypatch, caplog
):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synced.append(a))
    model, opt, *_ = _pair("adamw")
    capture = replaying(opt)
    pool = CpuPool()
    batches = _batches(2, seed=5)
    with caplog.at_level("WARNING", logger="cudagraphs"):
        step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, pool=pool)
    cpu = torch.device("cpu")
    assert pool.asked == [("capture_stream", cpu), ("warmup_scope", cpu)]
    assert capture.places == [(pool, pool.stream)]
    assert synced == [(cpu,)], "the warmup's work is waited for on the step's device"
    stats = step.stats
    assert stats.memory.device == cpu and stats.memory.what == "graph_train_step"
    assert stats.memory.handles == pool.handles()
    # Static: the batch buffer and the loss the graph writes (the storage it views).
    batch_bytes = sum(t.numel() * t.element_size() for t in batches[0])
    loss_bytes = step(batches[0]).untyped_storage().nbytes()
    assert stats.memory.static_bytes == batch_bytes + loss_bytes > batch_bytes
    assert (stats.graphs, stats.accumulation_steps, stats.all_reduce) == (1, 1, False)
    assert 0 <= stats.warmup_seconds < 60 and 0 <= stats.capture_seconds < 60
    assert (stats.compile_seconds, stats.compiled_frames, stats.graph_breaks) == (0.0, 0, 0)
    assert stats.masks_built_in_capture == () and stats.optimizer_changes == ()
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


def test_accumulated_losses_keep_the_losses_dtype(replaying):
    model, opt, ref, ref_opt = _pair("adamw")
    model.double()
    ref.double()
    capture = replaying(opt)
    data = [(x.double(), y.double()) for x, y in _batches(4, seed=12)]
    steps = [data[0:2], data[2:4]]
    step = graph_train_step(
        _step_fn(model), data[0], optimizer=opt, accumulation_steps=2, pool=CpuPool()
    )
    losses = [step(m).clone() for m in steps]
    assert all(loss.dtype == torch.float64 for loss in losses)
    assert capture.replays()["train step: update"] == 2
    ref_losses = _eager_loop(_step_fn(ref), ref_opt, steps, accumulation=2)
    _assert_same_training(model, opt, ref, ref_opt, losses, ref_losses)


def _holding(*devices):
    return SimpleNamespace(params=[SimpleNamespace(device=torch.device(d)) for d in devices])


def test_the_step_runs_on_the_one_cuda_device_of_its_parameters():
    assert GraphedTrainStep._device(_holding("cuda:1", "cuda:1")) == torch.device("cuda:1")
    assert GraphedTrainStep._device(_holding("cuda:0")) == torch.device("cuda:0")


@pytest.mark.parametrize(
    "devices", [("cpu",), ("cpu", "cpu"), ("cuda:0", "cuda:1"), ("cuda:0", "cpu"), ("meta",)]
)
def test_parameters_off_cuda_or_on_several_devices_are_refused_naming_them(devices):
    with pytest.raises(CudaGraphsValueError, match="one CUDA device") as info:
        GraphedTrainStep._device(_holding(*devices))
    for d in set(devices):
        assert f"'{d}'" in str(info.value)
    assert "model.cuda()" in str(info.value)


def test_the_capture_hands_the_meter_a_packing_of_the_state_no_graph_holds(replaying, monkeypatch):
    # The optimizer was not capturable at construction: its state lies in no graph, and
    # the meter packs it after its release (before the warmup), counting what it gave
    # back.
    from cudagraphs.train import step as step_module
    from helpers.stand_in_train_step import CpuMeter

    monkeypatch.setattr(CpuMeter, "packs", [])
    model, opt, *_ = _pair("adamw")
    replaying(opt)
    graph_train_step(_step_fn(model), _batches(1, seed=7)[0], optimizer=opt, pool=CpuPool())
    (pack,) = CpuMeter.packs
    asked = []

    def compact(optimizers, device, what, *, in_no_graph=False):
        asked.append((optimizers, device, what, in_no_graph))
        return 5, 7

    monkeypatch.setattr(step_module, "compact_before_capture", compact)
    assert pack() == 7
    assert asked == [([opt], None, "graph_train_step", True)]
