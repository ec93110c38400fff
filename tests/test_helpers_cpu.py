"""Small shared helpers on the CPU: the argument checks' messages, the lossless-dtype
rule computed afresh (not from its cache), WarnOnce's answer, the TE-order check of a
pool passed where ``sample_kwargs`` belongs, and graph_stack's messages and hand-off."""

import logging

import pytest
import torch
from torch import nn

from cudagraphs import checks
from cudagraphs.core import stack as stack_module
from cudagraphs.core.te_compat import check_fifth_argument
from cudagraphs.diagnostics import WarnOnce
from cudagraphs.dtypes import converts_losslessly, holds_plain_values
from cudagraphs.errors import CudaGraphsTypeError, NoCudaDeviceError


# ---- checks --------------------------------------------------------------------------
def test_check_device_names_the_type_it_got():
    with pytest.raises(
        CudaGraphsTypeError, match=r"device must be a torch.device .*got float 1\.5"
    ):
        checks.check_device("device", 1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("cuda, build", [(None, "a CPU-only build"), ("12.8", "a CUDA 12.8 build")])
def test_require_cuda_says_which_build_of_torch_it_found(monkeypatch, cuda, build):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    with pytest.raises(NoCudaDeviceError, match=r"^graphing needs a CUDA device") as info:
        checks.require_cuda("graphing")
    assert f"(torch {torch.__version__}, {build})." in str(info.value)


# ---- dtypes: the rule itself, not a cached answer --------------------------------------
@pytest.mark.parametrize(
    "src, dst, ok",
    [
        (torch.int16, torch.float32, True),  # 2**15 <= 2**24
        (torch.int16, torch.float16, False),  # 2**15 > 2**11
        (torch.int8, torch.float16, True),  # 2**7 <= 2**11
        (torch.int8, torch.bfloat16, True),  # 2**7 <= 2**8
        (torch.int16, torch.bfloat16, False),
        (torch.int32, torch.float64, True),  # 2**31 <= 2**53
        (torch.int64, torch.float64, False),
        (torch.uint8, torch.bfloat16, True),  # 255 <= 2**8
        (torch.float8_e5m2, torch.float32, False),
        (torch.float32, torch.float8_e4m3fn, False),
        (torch.qint8, torch.int8, False),
        (torch.int8, torch.quint8, False),
    ],
)
def test_lossless_rule_computed_afresh(src, dst, ok):
    converts_losslessly.cache_clear()
    assert converts_losslessly(src, dst) is ok


def test_plain_values_computed_afresh():
    holds_plain_values.cache_clear()
    assert holds_plain_values(torch.int16) and not holds_plain_values(torch.qint8)


# ---- WarnOnce ----------------------------------------------------------------------
def test_warn_once_answers_whether_it_logged(caplog):
    warn = WarnOnce(logging.getLogger("cudagraphs.test_helpers"))
    with caplog.at_level(logging.WARNING, logger="cudagraphs.test_helpers"):
        assert warn("a", "first %s", 1) is True
        assert warn("a", "again %s", 2) is False
        assert warn("b", "other") is True
    assert [r.getMessage() for r in caplog.records] == ["first 1", "other"]
    assert warn.said("a") and not warn.said("c")


# ---- a pool where sample_kwargs belongs ---------------------------------------------
def _named(name):
    return type(name, (), {"__repr__": lambda self: f"<{name}>"})()


@pytest.mark.parametrize("name", ["MemPool", "GraphMemoryPool", "CudaGraphPool"])
def test_pool_objects_by_their_class_name_are_refused_fifth(name):
    with pytest.raises(CudaGraphsTypeError, match=rf"pool handle was passed there \(<{name}>\)"):
        check_fifth_argument(_named(name))


@pytest.mark.parametrize(
    "value", [None, {"a": 1}, "ab", b"\x01\x02", (True, 1), (1, 2, 3), _named("Pool")]
)
def test_what_is_not_a_pool_passes_fifth(value):
    check_fifth_argument(value)  # bytes iterate as ints, yet are not a handle


def test_a_pair_of_ints_is_a_pool_handle():
    with pytest.raises(CudaGraphsTypeError, match="pool=pool"):
        check_fifth_argument([3, 4])


# ---- graph_stack ----------------------------------------------------------------------
def test_graph_stack_messages_name_the_types():
    with pytest.raises(CudaGraphsTypeError, match=r"got int$"):
        stack_module.graph_stack(3, (torch.ones(1),))
    with pytest.raises(CudaGraphsTypeError, match=r"layers\[1\] \(builtin_function_or_method\)"):
        stack_module.graph_stack([nn.Linear(2, 2), torch.tanh], (torch.ones(2),))
    with pytest.raises(CudaGraphsTypeError, match=r"arguments, got list$"):
        stack_module.graph_stack([nn.Linear(2, 2)], [torch.ones(2)])


def test_graph_stack_hands_its_arguments_and_options_to_make_graphed_callables(monkeypatch):
    from cudagraphs.core import api

    seen = {}

    def fake(callables, sample_args, **options):
        seen.update(callables=callables, sample_args=sample_args, options=options)
        return callables

    monkeypatch.setattr(api, "make_graphed_callables", fake)
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    sample = (torch.ones(1, 2),)
    out = stack_module.graph_stack(
        layers, sample, accumulate_grads_in_graph=True, num_warmup_iters=1
    )
    assert out is seen["callables"] and seen["sample_args"] is sample
    assert seen["options"] == {"accumulate_grads_in_graph": True, "num_warmup_iters": 1}
    assert list(out.layers) == list(layers)
