"""graph_train_step on float32 grouped_mm MoE models, on the CPU: the modules a step
function can be seen to run (closure, bound method, functools.partial, an object's
attribute, a global, a helper function), kept only when they hold an optimizer
parameter; and, with the device checks stood in for and the probe answering as torch
2.11 on an H200, the step refused before its warmup with an UnsupportedModelError
naming the experts and the fixes, while bfloat16 and batched_mm models pass the check.
The refusal and the replays on a GPU are in test_cuda_train_moe_fp32.py."""

import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from cudagraphs.errors import UnsupportedModelError
from cudagraphs.train import graph_train_step, step
from cudagraphs.train.step_modules import step_modules
from helpers.moe_models import FIXES, moe, probe_says

MODEL = nn.Linear(2, 2)  # a global a step function names


def params_of(*modules):
    return [p for m in modules for p in m.parameters()]


def names(found):
    return [name for name, _ in found]


# ---- which modules a step function is seen to run -----------------------------------------
def test_a_closure_variable_is_found_by_its_name():
    model = nn.Sequential(nn.Linear(2, 2))

    def step_fn(batch):
        return model(batch).sum()

    assert step_modules(step_fn, params_of(model)) == [("model", model)]


def test_bound_methods_partials_objects_and_globals_are_followed():
    class Trainer:
        def __init__(self):
            self.model = nn.Linear(2, 2)

        def step(self, batch):
            return self.model(batch).sum()

        def __call__(self, batch):
            return self.step(batch)

    trainer = Trainer()
    wanted = params_of(trainer.model)
    assert names(step_modules(trainer.step, wanted)) == ["self.model"]
    assert names(step_modules(trainer, wanted)) == ["step_fn.model"]
    holder = SimpleNamespace(net=trainer.model)
    assert names(step_modules(lambda b: holder.net(b), wanted)) == ["holder.net"]

    def loss(net, batch):
        return net(batch).sum()

    assert names(step_modules(functools.partial(loss, trainer.model), wanted)) == [
        "step_fn.args[0]"
    ]

    def global_step(batch):
        return helper(batch)

    def helper(batch):
        return MODEL(batch).sum()

    assert names(step_modules(global_step, params_of(MODEL))) == ["MODEL"]


def test_only_the_outermost_modules_holding_optimizer_parameters_count():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    frozen = nn.Linear(2, 2)
    inner = model[0]

    def step_fn(batch):
        return model(frozen(inner(batch))).sum()

    assert step_modules(step_fn, params_of(model)) == [("model", model)]
    assert step_modules(step_fn, params_of(frozen)) == [("frozen", frozen)]
    assert step_modules(step_fn, []) == []


def test_cycles_and_large_containers_end_the_walk():
    model = nn.Linear(2, 2)
    box = SimpleNamespace()
    box.self = box
    box.items = list(range(100_000)) + [model]  # past the entries read per container

    def step_fn(batch):
        return box

    assert step_modules(step_fn, params_of(model)) == []


# ---- the check at capture -------------------------------------------------------------------
class PastTheCheck(Exception):
    pass


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The CUDA checks pass on the CPU; the first step after the experts check (the
    graph pool) raises PastTheCheck."""
    monkeypatch.setattr(step, "require_cuda", lambda what: None)
    monkeypatch.setattr(step.GraphedTrainStep, "_device", lambda self: torch.device("cpu"))

    def pool(value):
        raise PastTheCheck

    monkeypatch.setattr(step, "as_graph_pool", pool)


def lm_step(model):
    def step_fn(batch):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss

    return step_fn


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral"])
def test_a_float32_grouped_mm_step_is_refused_before_its_warmup(monkeypatch, on_a_gpu, family):
    probe_says(monkeypatch)
    model = moe(family).train()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 64, (2, 8))
    with pytest.raises(UnsupportedModelError) as err:
        graph_train_step(lm_step(model), batch, optimizer=opt)
    text = str(err.value)
    assert text.startswith("graph_train_step: the MoE experts at model.model.layers.0.mlp.experts")
    assert all(fix in text for fix in FIXES), text
    assert all(p.grad is None for p in model.parameters())  # no warmup step ran
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize(
    "dtype, implementation", [(torch.bfloat16, None), (torch.float32, "batched_mm")]
)
def test_fixed_models_pass_the_check(monkeypatch, on_a_gpu, dtype, implementation):
    probe_says(monkeypatch)
    model = moe(dtype=dtype, implementation=implementation).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(PastTheCheck):
        graph_train_step(lm_step(model), torch.randint(0, 64, (2, 8)), optimizer=opt)


def test_a_frozen_moe_beside_the_trained_model_is_not_checked(monkeypatch, on_a_gpu):
    asked = probe_says(monkeypatch)
    teacher = moe()  # float32 grouped_mm, not trained by this step
    student = nn.Linear(64, 64)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def step_fn(batch):
        with torch.no_grad():
            teacher.model.embed_tokens(batch.long().clamp(0, 63))  # seen, not trained
        loss = student(batch).sum()
        loss.backward()
        return loss

    with pytest.raises(PastTheCheck):
        graph_train_step(step_fn, torch.randn(2, 64), optimizer=opt)
    assert asked == []
