"""CPU tests of graph_train_step with graphs disabled (the eager path, which must equal
the documented eager loop bit for bit, also on two gloo ranks), its argument checks
and its options."""

import copy
import logging
import os

import pytest
import torch

from cudagraphs import (
    CudaGraphInputError,
    CudaGraphsStateError,
    CudaGraphsTypeError,
    CudaGraphsValueError,
    GraphReleasedError,
    SignatureMismatchError,
)
from cudagraphs.errors import NoCudaDeviceError
from cudagraphs.train import (
    DEFAULT_BUCKET_MB,
    TrainStepOptions,
    graph_train_step,
)
from helpers.asserts import assert_bitwise_equal
from helpers.spawn import run_ranks
from helpers.train_cpu import (
    OPTIMIZERS,
    _assert_same_training,
    _batches,
    _build,
    _eager_loop,
    _make_model,
    _step_fn,
)

STEPS = 5
WORLD_SIZE = 2


@pytest.fixture
def disabled(monkeypatch):
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")


# ---- graph_train_step with graphs disabled -------------------------------------------
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_disabled_step_is_eager_and_equals_the_eager_loop(disabled, name):
    model, opt, ref_model, ref_opt = _build(name)
    initial = [p.detach().clone() for p in model.parameters()]
    batches = _batches(STEPS)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt)
    assert step.graphed is False
    assert step.stats.graphs == 0
    assert step.stats.accumulation_steps == 1
    assert step.stats.all_reduce is False
    assert step.stats.optimizer_changes == ()
    assert (step.stats.warmup_seconds, step.stats.capture_seconds) == (0.0, 0.0)
    assert step.stats.memory is None and step.stats.compile_seconds == 0.0
    assert step.grad_norm is None
    assert all(p.grad is None for p in model.parameters())  # nothing ran yet
    for p, q in zip(model.parameters(), initial):
        assert_bitwise_equal(p.detach(), q, "parameter before the first step")
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches)
    _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    assert all(loss.shape == () and not loss.requires_grad for loss in losses)
    assert not any(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), initial))
    assert all(p.grad is not None for p in model.parameters())  # the last step's


def test_an_lr_scheduler_built_after_the_step_sees_every_optimizer_step(disabled, recwarn):
    # torch's LRScheduler wraps optimizer.step when it is built; the step must call the
    # optimizer's step as it is then, not one it looked up before.
    model, opt, *_ = _build("adamw")
    batches = _batches(3)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for b in batches:
        step(b)
        sched.step()
    assert opt._opt_called  # the scheduler's wrapper ran
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)


def test_a_step_without_any_gradient_names_both_causes_and_a_good_step_works_after(disabled):
    model = torch.nn.Linear(4, 2)
    other = torch.nn.Linear(4, 2)  # the optimizer is built over another model
    opt = torch.optim.SGD(other.parameters(), lr=0.1)

    def step_fn(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    step = graph_train_step(step_fn, torch.ones(3, 4), optimizer=opt)
    with pytest.raises(CudaGraphsValueError, match=r"does not call backward.*another model"):
        step(torch.ones(3, 4))
    batch = (torch.ones(3, 4), torch.zeros(3, 2))
    good = graph_train_step(_step_fn(other), batch, optimizer=opt)
    assert good(batch).shape == ()


def test_parameters_the_step_never_uses_are_named_once_and_skipped(disabled, caplog):
    model = torch.nn.Linear(4, 2)
    unused = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [unused]}], lr=0.1)
    batch = (torch.ones(3, 4), torch.zeros(3, 2))
    step = graph_train_step(_step_fn(model), batch, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="cudagraphs.train.step"):
        step(batch)
        step(batch)
    said = [r.getMessage() for r in caplog.records if "get no gradient" in r.getMessage()]
    assert len(said) == 1, said
    assert "1 of the optimizer's 3 parameters" in said[0]
    assert "param_groups[1]['params'][0] (5,)" in said[0]
    assert unused.grad is None and torch.equal(unused.detach(), torch.ones(5))


def test_disabled_step_clips_as_the_eager_loop(disabled):
    model, opt, ref_model, ref_opt = _build("sgd_momentum")
    unclipped_model = copy.deepcopy(ref_model)
    unclipped_opt = OPTIMIZERS["sgd_momentum"](unclipped_model.parameters())
    batches = _batches(STEPS)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, max_grad_norm=0.01)
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches, max_grad_norm=0.01)
    _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    _eager_loop(_step_fn(unclipped_model), unclipped_opt, batches)
    # The clipping did clip: without it the parameters end elsewhere.
    assert not torch.equal(model.weight.detach(), unclipped_model.weight.detach())
    assert step.grad_norm is None  # only a graphed step exposes it


def test_disabled_step_accumulates_micro_batches_as_the_eager_loop(disabled):
    model, opt, ref_model, ref_opt = _build("adamw")
    flat = _batches(2 * STEPS)
    batches = [flat[i : i + 2] for i in range(0, len(flat), 2)]
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    assert step.stats.graphs == 0 and step.stats.accumulation_steps == 2
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches, accumulation=2)
    assert losses[0].shape == (2,)
    _assert_same_training(model, opt, ref_model, ref_opt, losses, ref_losses)
    step(tuple(flat[:2]))  # a tuple of micro-batches is a batch too


def test_disabled_step_refuses_a_wrong_number_of_micro_batches(disabled):
    model, opt, *_ = _build("sgd_momentum")
    flat = _batches(3)
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    with pytest.raises(CudaGraphsTypeError, match="accumulation_steps=2.*got a list of 3"):
        step(flat)
    with pytest.raises(CudaGraphsTypeError, match="accumulation_steps=2.*got a list of 1"):
        step(flat[:1])
    with pytest.raises(CudaGraphsTypeError, match="accumulation_steps=2.*got a tuple of 3"):
        step(tuple(flat))
    assert all(p.grad is None for p in model.parameters())


def test_disabled_step_refuses_a_non_list_with_accumulation(disabled):
    model, opt, *_ = _build("sgd_momentum")
    flat = _batches(2)
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    with pytest.raises(CudaGraphsTypeError, match="list or tuple of 2 micro-batches; got a Tensor"):
        step(flat[0][0])


def test_disabled_step_refuses_a_batch_of_another_shape_before_any_work(disabled):
    model, opt, *_ = _build("adamw")
    batches = _batches(2)
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt)
    step(batches[0])
    before = [p.detach().clone() for p in model.parameters()]
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    wrong = _batches(1, rows=3)[0]
    with pytest.raises(CudaGraphInputError, match=r"batch\[0\]: shape") as info:
        step(wrong)
    assert isinstance(info.value, SignatureMismatchError)
    assert info.value.mismatches and info.value.mismatches[0].field == "shape"
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "parameter after a refused batch")
    for p, e in zip(model.parameters(), exp_avg):
        assert_bitwise_equal(opt.state[p]["exp_avg"], e, "exp_avg after a refused batch")


def test_disabled_step_names_the_bad_micro_batch(disabled):
    model, opt, *_ = _build("sgd_momentum")
    flat = _batches(2)
    step = graph_train_step(_step_fn(model), flat[0], optimizer=opt, accumulation_steps=2)
    bad = (flat[1][0].double(), flat[1][1])
    with pytest.raises(SignatureMismatchError, match=r"batch\[1\]\[0\]: dtype"):
        step([flat[0], bad])
    assert all(p.grad is None for p in model.parameters())  # refused before step_fn ran


def test_disabled_step_refuses_a_step_fn_returning_no_tensor(disabled):
    model, opt, *_ = _build("sgd_momentum")
    batch = _batches(1)[0]

    def returns_float(b):
        loss = _step_fn(model)(b)
        return loss.item()

    step = graph_train_step(returns_float, batch, optimizer=opt)
    with pytest.raises(CudaGraphsTypeError, match="returned float"):
        step(batch)


def test_disabled_step_refuses_a_step_fn_without_backward(disabled):
    model, opt, *_ = _build("sgd_momentum")
    before = [p.detach().clone() for p in model.parameters()]
    batch = _batches(1)[0]

    def forward_only(b):
        x, y = b
        return torch.nn.functional.mse_loss(model(x), y)

    step = graph_train_step(forward_only, batch, optimizer=opt)
    with pytest.raises(CudaGraphsValueError, match=r"loss\.backward\(\)"):
        step(batch)
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "parameter after a step without gradients")
    assert opt.state == {}


def test_disabled_step_after_reset_raises(disabled):
    model, opt, *_ = _build("sgd_momentum")
    batch = _batches(1)[0]
    step = graph_train_step(_step_fn(model), batch, optimizer=opt)
    step(batch)
    step.reset()
    assert step.graphed is False
    with pytest.raises(GraphReleasedError, match="reset"):
        step(batch)
    with pytest.raises(GraphReleasedError):
        step.capture()


def test_an_invalid_disable_flag_is_refused_naming_it(monkeypatch):
    model, opt, *_ = _build("sgd_momentum")
    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "maybe")
    with pytest.raises(CudaGraphsValueError, match="CUDAGRAPHS_DISABLE='maybe'"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable GPU")
def test_without_a_gpu_graph_train_step_raises_no_cuda_device(monkeypatch):
    monkeypatch.delenv("CUDAGRAPHS_DISABLE", raising=False)
    model, opt, *_ = _build("adamw")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NoCudaDeviceError, match="graph_train_step needs a CUDA device") as info:
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)
    assert isinstance(info.value, CudaGraphsStateError)
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "parameter after the refusal")
    assert all(p.grad is None for p in model.parameters())
    assert opt.state == {}


# ---- argument checks -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_grad_norm": 0.0}, CudaGraphsValueError, "max_grad_norm must be positive"),
        ({"max_grad_norm": -1.0}, CudaGraphsValueError, "max_grad_norm must be positive"),
        ({"max_grad_norm": float("nan")}, CudaGraphsValueError, "max_grad_norm must be positive"),
        ({"max_grad_norm": "1.0"}, CudaGraphsTypeError, "max_grad_norm must be a number"),
        (
            {"accumulation_steps": 0},
            CudaGraphsValueError,
            r"accumulation_steps must be an int >= 1",
        ),
        ({"accumulation_steps": 2.0}, CudaGraphsTypeError, "accumulation_steps must be an int"),
        ({"warmup_steps": 0}, CudaGraphsValueError, r"warmup_steps must be an int >= 1"),
        ({"warmup_steps": True}, CudaGraphsTypeError, "warmup_steps must be an int"),
        ({"all_reduce": "yes"}, CudaGraphsTypeError, "all_reduce must be a bool"),
        ({"all_reduce": 1}, CudaGraphsTypeError, "all_reduce must be a bool"),
    ],
)
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainStepOptions(**kwargs)
    model, opt, *_ = _build("adamw")
    with pytest.raises(error, match=match):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt, **kwargs)
    assert opt.state == {}


def test_good_options_are_kept():
    options = TrainStepOptions(max_grad_norm=1, accumulation_steps=4, warmup_steps=1)
    assert (options.max_grad_norm, options.accumulation_steps, options.warmup_steps) == (1, 4, 1)
    assert TrainStepOptions().optimizer_impl == "auto"
    assert TrainStepOptions().bucket_mb == DEFAULT_BUCKET_MB


def test_a_step_fn_that_is_not_callable_is_refused(disabled):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsTypeError, match="step_fn must be callable"):
        graph_train_step("step", _batches(1)[0], optimizer=opt)


def test_an_optimizer_that_is_not_a_torch_optimizer_is_refused(disabled):
    model, _, *_ = _build("adamw")
    with pytest.raises(CudaGraphsTypeError, match="optimizer must be a torch optimizer"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=list(model.parameters()))


def test_an_unsupported_optimizer_is_refused_naming_its_type(disabled):
    model = _make_model()
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(CudaGraphsTypeError, match="got RMSprop"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)


def test_an_unknown_optimizer_impl_is_refused(disabled):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsValueError, match="optimizer_impl must be one of"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt, optimizer_impl="fast")


@pytest.mark.parametrize("sample", [None, [], {"a": None}, ((),)])
def test_a_sample_batch_without_a_tensor_is_refused(disabled, sample):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsValueError, match="sample_batch holds no tensor"):
        graph_train_step(_step_fn(model), sample, optimizer=opt)


def test_a_sample_batch_with_a_python_number_is_refused_by_path(disabled):
    model, opt, *_ = _build("adamw")
    with pytest.raises(CudaGraphsTypeError, match=r"sample_batch\[1\]: unsupported leaf"):
        graph_train_step(_step_fn(model), (torch.zeros(2, 4), 3), optimizer=opt)


def test_an_optimizer_without_parameters_is_refused(disabled):
    model, opt, *_ = _build("adamw")
    opt.param_groups[0]["params"] = []
    with pytest.raises(CudaGraphsValueError, match="holds no parameters"):
        graph_train_step(_step_fn(model), _batches(1)[0], optimizer=opt)


# ---- TrainStepOptions.reduces --------------------------------------------------------
def test_reduces_as_asked_else_only_when_distributed():
    assert not torch.distributed.is_initialized()
    # all_reduce=True without a process group is refused (test_train_records_cpu.py).
    assert TrainStepOptions(all_reduce=False).reduces() is False
    assert TrainStepOptions().reduces() is False


# ---- TrainStepOptions: bucket_mb ------------------------------------------------------
def test_options_refuse_a_bucket_size_that_is_not_positive():
    with pytest.raises(CudaGraphsValueError, match="bucket_mb must be positive"):
        TrainStepOptions(bucket_mb=0)
    with pytest.raises(CudaGraphsTypeError, match="bucket_mb"):
        TrainStepOptions(bucket_mb="25")


# ---- the disabled step on two gloo ranks ---------------------------------------------
def _train_step_worker(rank):
    os.environ["CUDAGRAPHS_DISABLE"] = "1"
    singles = [torch.distributed.new_group([r]) for r in range(WORLD_SIZE)]
    model = _make_model()
    ref_model = copy.deepcopy(model)
    opt = OPTIMIZERS["adamw"](model.parameters())
    ref_opt = OPTIMIZERS["adamw"](ref_model.parameters())
    batches = _batches(STEPS, seed=10 + rank)  # each rank its own data
    step = graph_train_step(_step_fn(model), batches[0], optimizer=opt, max_grad_norm=0.5)
    losses = [step(b).clone() for b in batches]
    ref_losses = _eager_loop(_step_fn(ref_model), ref_opt, batches, max_grad_norm=0.5, reduce=True)
    return {
        "reduces_default": TrainStepOptions().reduces(),
        "reduces_own_group": TrainStepOptions(process_group=singles[rank]).reduces(),
        "reduces_false": TrainStepOptions(all_reduce=False).reduces(),
        "stats_all_reduce": step.stats.all_reduce,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
        "params_equal": all(
            torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())
        ),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "losses": [loss.item() for loss in losses],
    }


@pytest.mark.spawns
def test_disabled_step_on_two_ranks_averages_gradients_as_the_eager_loop(tmp_path):
    results = run_ranks(_train_step_worker, WORLD_SIZE, tmp_path)
    for r in results:
        assert r["reduces_default"] is True
        assert r["reduces_own_group"] is False
        assert r["reduces_false"] is False
        assert r["stats_all_reduce"] is True
        assert r["losses_equal"] and r["params_equal"]
    # Averaged gradients: both ranks end with the same model from different data.
    assert results[0]["losses"] != results[1]["losses"]
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.parametrize("n_unused, listed, more", [(3, 3, False), (4, 3, True)])
def test_the_unused_parameters_message_lists_three_then_says_there_are_more(
    disabled, caplog, n_unused, listed, more
):
    model = torch.nn.Linear(4, 2)
    unused = [torch.nn.Parameter(torch.ones(i + 1)) for i in range(n_unused)]
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": unused}], lr=0.1)
    batch = (torch.ones(3, 4), torch.zeros(3, 2))
    with caplog.at_level(logging.WARNING, logger="cudagraphs.train.step"):
        graph_train_step(_step_fn(model), batch, optimizer=opt)(batch)
    (said,) = [r.getMessage() for r in caplog.records if "get no gradient" in r.getMessage()]
    named = [f"param_groups[1]['params'][{i}] ({i + 1},)" for i in range(n_unused)]
    assert [n in said for n in named] == [True] * listed + [False] * (n_unused - listed)
    assert (", ...)" in said) == more


def test_graph_train_step_hands_every_argument_to_the_step_and_the_pool_to_capture(
    monkeypatch,
):
    from cudagraphs.train.step import GraphedTrainStep

    pools = []
    monkeypatch.setattr(
        GraphedTrainStep, "capture", lambda self, pool=None: pools.append(pool) or self
    )
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.ones(3, 4), torch.zeros(3, 2))
    group, pool = object(), object()
    step = graph_train_step(
        _step_fn(model),
        batch,
        optimizer=opt,
        max_grad_norm=0.5,
        accumulation_steps=2,
        optimizer_impl="keep",
        all_reduce=False,
        process_group=group,
        bucket_mb=7.0,
        warmup_steps=5,
        pool=pool,
    )
    assert pools == [pool]
    assert step.options == TrainStepOptions(
        max_grad_norm=0.5,
        accumulation_steps=2,
        optimizer_impl="keep",
        all_reduce=False,
        process_group=group,
        bucket_mb=7.0,
        warmup_steps=5,
    )
    default = graph_train_step(_step_fn(model), batch, optimizer=opt)
    assert default.options == TrainStepOptions(
        max_grad_norm=None,
        accumulation_steps=1,
        optimizer_impl="auto",
        all_reduce=None,
        process_group=None,
        bucket_mb=DEFAULT_BUCKET_MB,
        warmup_steps=3,
    )
    assert pools == [pool, None]
