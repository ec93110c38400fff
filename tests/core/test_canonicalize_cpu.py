"""Argument validation of make_graphed_callables, all before any GPU work (CPU only)."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from cudagraphs import (
    CudaGraphsTypeError,
    CudaGraphsValueError,
    NoCudaDeviceError,
    make_graphed_callables,
)
from cudagraphs.core.canonicalize import canonicalize, check_devices


def lin():
    return nn.Linear(4, 4)


def x(requires_grad=False):
    return torch.randn(2, 4, requires_grad=requires_grad)


def test_single_callable_plan():
    m = lin()
    plan = canonicalize(m, (x(),))
    assert plan.single and len(plan.entries) == 1
    assert plan.training is True and plan.module_training is True
    assert plan.callables[0].params == tuple(m.parameters())
    assert [(s.kind, s.entry) for s in plan.schedule] == [("fwd", 0), ("bwd", 0)]


def test_tuple_of_callables_and_functions():
    def f(a, b):
        return a * b

    plan = canonicalize((lin(), f), ((x(),), (x(True), x())))
    assert not plan.single and len(plan.entries) == 2
    assert plan.callables[1].module is None and plan.callables[1].params == ()
    assert (
        plan.callables[1].name == "callables[1] (test_tuple_of_callables_and_functions.<locals>.f)"
    )


def test_functions_only_train_when_an_input_requires_grad():
    def f(a):
        return a + 1

    assert canonicalize(f, (x(),)).training is False
    assert canonicalize(f, (x(True),)).training is True
    with torch.no_grad():
        assert canonicalize(f, (x(True),)).training is False


def test_eval_modules_and_no_grad_are_inference():
    m = lin().eval()
    plan = canonicalize(m, (x(),))
    assert plan.training is False and plan.module_training is False
    assert [s.kind for s in plan.schedule] == ["fwd"]
    with torch.no_grad():
        plan = canonicalize(lin(), (x(),))
    assert plan.training is False and plan.module_training is True


def test_mixed_training_and_eval_modules_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"mix training mode \(callables\[0\] \(Linear\)\) and eval mode \(callables\[1\] \(Linear\)\)",
    ):
        canonicalize((lin(), lin().eval()), ((x(),), (x(),)))


def test_tensor_kwargs_and_constants_are_flattened_with_paths():
    plan = canonicalize(
        lin(), (x(), 3), sample_kwargs={"mask": x(), "opts": {"scale": 2.0, "bias": [x()]}}
    )
    e = plan.entries[0]
    tensor_paths = [e.paths[i] for i in e.tensor_positions]
    assert tensor_paths == ["args[0]", "kwargs['mask']", "kwargs['opts']['bias'][0]"]
    assert "args[1]" in e.paths and "kwargs['opts']['scale']" in e.paths


@pytest.mark.parametrize(
    "callables, sample_args, exc, match",
    [
        ((), (), ValueError, "at least one callable"),
        ((lin(), 3), ((x(),), (x(),)), TypeError, r"callables\[1\] is a int"),
        (
            lin(),
            x(),
            TypeError,
            r"sample_args\[0\] \(for callables\[0\] \(Linear\)\) must be a tuple.*, got Tensor",
        ),
        (
            (lin(), lin()),
            ((x(),),),
            ValueError,
            "sample_args has 1 entries but there are 2 callables",
        ),
        ((lin(),), [x()], TypeError, r"sample_args\[0\] .* must be a tuple.*, got Tensor"),
        ((lin(),), 5, TypeError, "sample_args must be a tuple of tuples, got int"),
    ],
)
def test_bad_callables_and_sample_args(callables, sample_args, exc, match):
    with pytest.raises(exc, match=match):
        canonicalize(callables, sample_args)


def test_same_callable_twice_is_rejected():
    m = lin()
    with pytest.raises(ValueError, match=r"callables\[1\] is the same object as callables\[0\]"):
        canonicalize((m, m), ((x(),), (x(),)))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_module_compiled_with_module_compile_is_refused_with_the_fix():
    # Its compiled __call__ would trace the graphed forward installed on it.
    compiled = nn.Linear(4, 4)
    compiled.compile(backend="eager")
    x = torch.randn(2, 4)
    with pytest.raises(CudaGraphsValueError, match=r"callables\[1\].*module\.compile\(\)") as err:
        canonicalize((nn.Linear(4, 4), compiled), ((x,), (x,)))
    assert "holds torch.compile(module)" in str(err.value)

    # The fix: a module holding torch.compile(module) plans like any module.
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(nn.Linear(4, 4), backend="eager")

        def forward(self, t):
            return self.inner(t)

    plan = canonicalize((Holder(),), ((x,),))
    assert len(plan.callables[0].params) == 2


def test_sample_kwargs_errors():
    with pytest.raises(ValueError, match=r"one dict per sample_args entry \(2\), got 1"):
        canonicalize((lin(), lin()), ((x(),), (x(),)), sample_kwargs=[{}])
    # one callable: sample_kwargs is that call's kwargs, so this list is the bad dict
    with pytest.raises(TypeError, match=r"sample_kwargs\[0\] must be a dict, got list"):
        canonicalize(lin(), (x(),), sample_kwargs=[1])
    with pytest.raises(TypeError, match=r"sample_kwargs\[1\] must be a dict, got int"):
        canonicalize((lin(), lin()), ((x(),), (x(),)), sample_kwargs=[None, 1])
    # one dict for several callables: the message names the type, not a length
    with pytest.raises(ValueError, match=r"one dict per sample_args entry \(2\), got dict"):
        canonicalize((lin(), lin()), ((x(),), (x(),)), sample_kwargs={"mask": x()})


def test_sparse_input_is_rejected_with_its_path():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match=r"tensor at \[0\]\[1\] has layout torch.sparse_coo"):
        canonicalize(lin(), (x(), sparse))


def test_num_warmup_iters_must_be_non_negative():
    with pytest.raises(CudaGraphsValueError, match="num_warmup_iters must be an int >= 0, got -1"):
        canonicalize(lin(), (x(),), num_warmup_iters=-1)


@pytest.mark.parametrize("n", [1.5, "3", True, None])
def test_num_warmup_iters_must_be_an_int_not_a_bool(n):
    # True is an int to Python, but not a count anyone means.
    with pytest.raises(CudaGraphsTypeError, match="num_warmup_iters must be an int, got"):
        canonicalize(lin(), (x(),), num_warmup_iters=n)


@pytest.mark.parametrize(
    "hook_attr, listed",
    [
        ("forward_pre", "0.forward_pre_hooks"),
        ("forward", "0.forward_hooks"),
        ("backward_pre", "0.backward_pre_hooks"),
        ("full_backward", "0.backward_hooks"),
    ],
)
def test_modules_with_registered_hooks_are_rejected(hook_attr, listed):
    m = nn.Sequential(lin(), nn.ReLU())
    target = m[0]
    register = {
        "forward_pre": lambda: target.register_forward_pre_hook(lambda mod, a: None),
        "forward": lambda: target.register_forward_hook(lambda mod, a, o: None),
        "backward_pre": lambda: target.register_full_backward_pre_hook(lambda mod, g: None),
        "full_backward": lambda: target.register_full_backward_hook(lambda mod, gi, go: None),
    }[hook_attr]
    handle = register()
    with pytest.raises(
        ValueError, match=r"callables\[0\] \(Sequential\) has registered module hooks \(0\."
    ) as info:
        canonicalize(m, (x(),))
    assert f"hooks ({listed});" in str(info.value)
    handle.remove()
    canonicalize(m, (x(),))  # fine once removed


def test_autocast_with_weight_cache_is_rejected():
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(ValueError, match="cache_enabled=False"),
    ):
        canonicalize(lin(), (x(),))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        canonicalize(lin(), (x(),))


def test_reuse_buffers_needs_order_and_training():
    with pytest.raises(ValueError, match="needs _order and training"):
        canonicalize(lin(), (x(),), reuse_buffers=True)
    m1, m2 = lin().eval(), lin().eval()
    with pytest.raises(ValueError, match="needs _order and training"):
        canonicalize((m1, m2), ((x(),), (x(),)), order=[1, 2, -2, -1], reuse_buffers=True)


def test_reuse_buffers_plan_assigns_slots():
    mods = tuple(lin() for _ in range(2))
    order = [1, 2, -2, -1, 1, 2, -2, -1]
    sample = tuple((x(True),) for _ in range(4))
    plan = canonicalize(mods, sample, order=order, reuse_buffers=True)
    # chunk 0: entries 0 (mb0), 1 (mb1); mb1 starts after mb0's backward -> same slot
    assert plan.buffer_slots[0] == plan.buffer_slots[1]
    assert plan.buffer_slots[2] == plan.buffer_slots[3]
    assert plan.buffer_slots[0] != plan.buffer_slots[2]


def test_ordered_plan_layout_errors_surface():
    with pytest.raises(ValueError, match="needs 4"):
        canonicalize((lin(), lin()), ((x(),), (x(),)), order=[1, 2, -2, -1, 1, 2, -2, -1])


def test_check_devices_requires_cuda_tensors():
    plan = canonicalize(lin(), (x(),), sample_kwargs={"mask": x()})
    with pytest.raises(
        ValueError, match=r"sample_args\[0\] args\[0\] is on cpu; graph inputs must be CUDA"
    ):
        check_devices(plan)


def test_make_graphed_callables_rejects_cpu_inputs_before_gpu_work():
    calls = []
    hooks = [{"forward_pre_hooks": {"h": lambda m: calls.append(m)}}]
    if torch.cuda.is_available():
        error, message = CudaGraphsValueError, "graph inputs must be CUDA tensors"
    else:  # the package's own no-device error comes first, never torch's AssertionError
        error, message = NoCudaDeviceError, "make_graphed_callables needs a CUDA device"
    with pytest.raises(error, match=message):
        make_graphed_callables(lin(), (x(),), capture_time_hooks=hooks)
    assert calls == []  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_a_function_without_tensor_inputs_says_no_cuda_device():
    # No tensor tells the device, so torch.cuda.current_device() would be asked:
    # on a CPU build that is an AssertionError. Ours comes first.
    with pytest.raises(NoCudaDeviceError, match="torch finds none usable here"):
        make_graphed_callables(lambda: torch.ones(2), ())


def test_a_buffer_that_requires_grad_is_refused_by_name():
    # Its gradient would be silently dropped: the backward graph computes gradients for
    # parameters and inputs only.
    m = lin()
    m.register_buffer("scale", torch.ones(4, requires_grad=True))
    with pytest.raises(
        CudaGraphsValueError, match=r"callables\[0\] \(Linear\) has buffer\(s\) \['scale'\]"
    ):
        canonicalize(m, (x(),))
    outer = nn.Sequential(lin(), m)
    with pytest.raises(CudaGraphsValueError, match=r"\['1.scale'\] with requires_grad=True"):
        canonicalize(outer, (x(),))
    m.scale.requires_grad_(False)
    canonicalize(m, (x(),))  # the fix works


def test_make_graphed_callables_validates_hooks_first():
    with pytest.raises(ValueError, match="has 2 entries but there are 1 callables"):
        make_graphed_callables(lin(), (x(),), capture_time_hooks=[None, None])


def test_callable_specs_keep_index_fn_and_trainable_parameter_names():
    def f(a):
        return a

    m = lin()
    m.bias.requires_grad_(False)  # frozen: not a graph input
    plan = canonicalize((m, f), ((x(),), (x(),)))
    assert [c.index for c in plan.callables] == [0, 1]
    assert plan.callables[0].fn is m and plan.callables[1].fn is f
    assert plan.callables[0].params == (m.weight,)
    assert plan.callables[0].param_names == ("weight",)
    assert plan.callables[1].param_names == ()
    nested = nn.Sequential(lin(), nn.ReLU(), lin())
    assert canonicalize(nested, (x(),)).callables[0].param_names == (
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    )


def test_entry_spec_keeps_args_and_sorted_kwargs():
    a, mask = x(), x()
    e = canonicalize(lin(), [a, 3], sample_kwargs={"z": 1, "mask": mask}).entries[0]
    assert e.args == (a, 3)
    assert list(e.kwargs) == ["mask", "z"] and e.kwargs["mask"] is mask
    assert canonicalize(lin(), (a,)).entries[0].kwargs == {}


def test_callables_without_qualname_are_named_by_their_type():
    # functools.partial objects and other callable instances have no __qualname__.
    scale = functools.partial(torch.mul, other=2.0)
    plan = canonicalize(scale, (x(),))
    assert plan.callables[0].name == "callables[0] (partial)"
    with pytest.raises(TypeError, match=r"sample_args\[0\] \(for callables\[0\] \(partial\)\)"):
        canonicalize(scale, x())


def test_modules_are_named_by_their_class_even_with_a_qualname_attribute():
    # functools.update_wrapper and similar leave a __qualname__ on the instance; the
    # class name is what the user recognizes (and what torch prints for the module).
    m = lin()
    m.__qualname__ = "wrapped_forward"
    assert canonicalize(m, (x(),)).callables[0].name == "callables[0] (Linear)"


def test_functions_have_no_module_training_flag():
    def f(a):
        return a

    plan = canonicalize(f, (x(True),))
    assert plan.module_training is None


def test_hooks_on_the_root_module_are_listed_as_root():
    m = lin()
    m.register_forward_hook(lambda mod, a, o: None)
    with pytest.raises(ValueError, match=r"has registered module hooks \(<root>\.forward_hooks\);"):
        canonicalize(m, (x(),))


def test_autocast_check_falls_back_for_torch_without_device_type(monkeypatch):
    # Older torch: is_autocast_enabled() takes no device type and answers for CUDA.
    def is_autocast_enabled(*device_type):
        if device_type:
            raise TypeError("is_autocast_enabled() takes 0 positional arguments")
        return True

    monkeypatch.setattr(torch, "is_autocast_enabled", is_autocast_enabled)
    monkeypatch.setattr(torch, "is_autocast_cache_enabled", lambda: True)
    with pytest.raises(ValueError, match=r"autocast \(cuda\) is enabled with its weight cache"):
        canonicalize(lin(), (x(),))


def test_num_layers_per_chunk_reaches_the_layout():
    mods = tuple(lin() for _ in range(3))
    sample = tuple((x(True),) for _ in range(3))
    plan = canonicalize(mods, sample, order=[1, 2, -2, -1], num_layers_per_chunk=[1, 2])
    assert plan.layout.layers_per_chunk == (1, 2)


def test_plan_carries_hooks_and_no_slots_without_reuse():
    def h(m):
        return None

    plan = canonicalize(
        (lin(), lin()), ((x(),), (x(),)), capture_time_hooks=[None, {"forward_hooks": {"h": h}}]
    )
    assert plan.buffer_slots is None
    assert [hk.callable_index for hk in plan.hooks] == [0, 1]
    assert plan.hooks[1].forward_hooks == (("h", h),)


# check_devices only reads devices, so fake tensors (metadata only, no storage) can
# claim CUDA devices on a machine without one.
def fake_cuda(device="cuda:0"):
    with FakeTensorMode():
        return torch.empty(2, 4, device=device)


def test_check_devices_returns_the_one_cuda_device():
    plan = canonicalize(
        (lin(), lin()),
        ((fake_cuda(),), (fake_cuda(),)),
        sample_kwargs=[{"mask": fake_cuda()}, None],
    )
    assert check_devices(plan) == torch.device("cuda", 0)


def test_check_devices_rejects_several_devices_naming_where_each_first_appears():
    plan = canonicalize(
        (lin(), lin()), ((fake_cuda("cuda:0"), fake_cuda("cuda:0")), (fake_cuda("cuda:1"),))
    )
    with pytest.raises(ValueError, match="spread over several devices") as info:
        check_devices(plan)
    message = str(info.value)
    assert "index=0): 'sample_args[0] args[0]'" in message
    assert "index=1): 'sample_args[1] args[0]'" in message


def test_check_devices_rejects_a_cpu_tensor_beside_cuda_ones():
    plan = canonicalize(lin(), (fake_cuda(), x()))
    with pytest.raises(ValueError, match=r"sample_args\[0\] args\[1\] is on cpu"):
        check_devices(plan)


def test_check_devices_without_tensor_inputs_uses_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    plan = canonicalize(lambda: None, ())
    assert check_devices(plan) == torch.device("cuda", 3)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16]),
            st.sampled_from([(2, 4), (3, 4)]),
            st.booleans(),
        ),
        min_size=2,
        max_size=2,
    )
)
def test_reused_buffers_are_shared_only_by_entries_whose_inputs_fit_exactly(kinds):
    # Two microbatches of one chunk, never live together: they share a slot exactly
    # when their inputs agree in shape, dtype and requires_grad.
    (d0, s0, g0), (d1, s1, g1) = kinds
    samples = (
        (torch.zeros(s0, dtype=d0, requires_grad=g0),),
        (torch.zeros(s1, dtype=d1, requires_grad=g1),),
    )
    plan = canonicalize((nn.Identity(),), samples, order=[1, -1, 1, -1], reuse_buffers=True)
    same = plan.buffer_slots[0] == plan.buffer_slots[1]
    assert same == ((d0, s0, g0) == (d1, s1, g1))


def test_an_entrys_graphs_hold_the_calls_constants_but_none_of_its_sample_tensors():
    # A sample held by a graph for good would pin its caching-allocator segment (for
    # partial graphs, the eager activations' segment around a recorded hidden state).
    import gc
    import weakref

    from cudagraphs.core.capture_phase import eager_entry_graphs

    sample = torch.randn(2, 3)
    gone = weakref.ref(sample)
    plan = canonicalize(lambda t, scale: t * scale, (sample, 2.5))
    graphs = eager_entry_graphs(plan, 0)
    del sample, plan
    gc.collect()
    assert gone() is None, "the entry keeps a sample tensor alive"
    assert graphs.leaves == [None, 2.5]
    assert graphs.user_tensors((torch.ones(2, 3), 2.5), {})[0].tolist() == [[1.0] * 3] * 2


def test_a_module_graphed_already_in_its_mode_is_refused_with_the_reset_fix():
    from types import SimpleNamespace

    from cudagraphs.core.graphed import GraphedCallable

    layer = nn.Linear(4, 4)
    graphs = SimpleNamespace(released=False, replay_keywords=None)
    layer.cuda_graph = GraphedCallable(graphs, layer.forward, layer, True)
    with pytest.raises(CudaGraphsValueError, match=r"module.cuda_graph.reset\(\) first"):
        canonicalize((layer,), ((torch.randn(2, 4),),))
    layer.eval()  # the other mode: the installed forward runs it eagerly, so it chains
    canonicalize((layer,), ((torch.randn(2, 4),),))
    layer.train()
    graphs.released = True  # after reset(): graph it again
    canonicalize((layer,), ((torch.randn(2, 4),),))
