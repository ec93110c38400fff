"""Megatron-Core 0.19.2's TE graph helper under the stand-in, on the CPU (skipped
where megatron-core is not importable): the keyword arguments it passes to
``make_graphed_callables`` for the Transformer Engine version the stand-in declares,
that cudagraphs accepts every one of them (up to the device check, the last before
GPU work), that it refuses Megatron's FP8 arguments, the keywords Megatron's replay
passes beyond the captured ones, and that the stand-in and Megatron's graph module
are restored afterwards. The GPU file (``test_cuda_megatron.py``) captures and trains.
"""

import contextlib
import importlib
import importlib.util
import sys

import pytest
import torch

from cudagraphs import CudaGraphsValueError, NoCudaDeviceError, QuantizationNotSupportedError
from cudagraphs import make_graphed_callables as ours
from helpers.megatron_case import (
    GRAPH_HELPER_MODULE,
    CaseShape,
    batches,
    gpt_model,
    helper_kwargs_on_cpu,
    megatron_skip_reason,
    megatron_te_graphs,
    one_rank,
    transformer_config,
)

_REASON = megatron_skip_reason(need_gpu=False)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

SHAPE = CaseShape()

# What Megatron-Core 0.19.2 passes under TE 2.20 for one rank (no pipeline: _order is
# one forward and one backward of the single chunk), cuda_graph_warmup_steps=0, no
# FP8, no activation offloading (TECudaGraphHelper._get_cuda_graph_input_data).
EXPECTED_KWARGS = {
    "allow_unused_input": True,
    "_order": [1, -1],
    "retain_graph_in_backward": False,
    "num_warmup_iters": 10,  # max(1, ceil((10 - warmup_steps * microbatches) / microbatches))
    "_num_layers_per_chunk": [SHAPE.num_layers],  # TE >= 2.6
    "_reuse_graph_input_output_buffers": True,  # TE >= 2.7
    "fp8_enabled": False,
}
SAMPLE_KWARGS = {"attention_mask", "rotary_pos_emb"}  # TE >= 1.10: keyword samples


def _helper_call(tmp_path, version="2.20.0"):
    return helper_kwargs_on_cpu(SHAPE, str(tmp_path / "pg"), version)


def _past_the_argument_checks(call):
    # On the CPU the sample tensors are CPU tensors: the device checks are the first
    # to object, and they come after every argument check.
    if torch.cuda.is_available():
        error, message = CudaGraphsValueError, "graph inputs must be CUDA tensors"
    else:
        error, message = NoCudaDeviceError, "needs a CUDA device"
    with pytest.raises(error, match=message):
        call()


def test_the_kwargs_megatron_passes_for_te_2_20(tmp_path):
    call = _helper_call(tmp_path)
    kwargs = dict(call["kwargs"])
    sample_kwargs = kwargs.pop("sample_kwargs")
    assert kwargs == EXPECTED_KWARGS
    assert len(call["callables"]) == SHAPE.num_layers
    assert len(call["sample_args"]) == len(sample_kwargs) == SHAPE.num_layers
    for args, kw in zip(call["sample_args"], sample_kwargs):
        (hidden,) = args
        s, b, h = SHAPE.seq_length, SHAPE.micro_batch_size, SHAPE.hidden_size
        assert hidden.shape == (s, b, h) and hidden.dtype == torch.bfloat16
        assert hidden.requires_grad
        assert set(kw) == SAMPLE_KWARGS
        assert kw["attention_mask"].dtype == torch.bool
        assert kw["attention_mask"].shape == (b, 1, s, s)


def test_older_te_versions_get_fewer_kwargs(tmp_path):
    kwargs = _helper_call(tmp_path, version="2.5.0")["kwargs"]
    assert "_num_layers_per_chunk" not in kwargs
    assert "_reuse_graph_input_output_buffers" not in kwargs
    assert "sample_kwargs" in kwargs


def test_cudagraphs_accepts_every_kwarg_megatron_passes(tmp_path):
    call = _helper_call(tmp_path)
    _past_the_argument_checks(
        lambda: ours(call["callables"], call["sample_args"], **call["kwargs"])
    )


def test_megatron_fp8_kwargs_are_refused_by_name(tmp_path):
    # With config.fp8 (or fp4) set, Megatron adds these (TE >= 2.8: one flag per layer).
    call = _helper_call(tmp_path)
    kwargs = dict(call["kwargs"])
    kwargs.update(
        fp8_enabled=(True,) * SHAPE.num_layers,
        fp8_recipe=object(),
        fp8_weight_caching=True,
        fp8_group=None,
    )
    with pytest.raises(QuantizationNotSupportedError, match=r"fp8_enabled=\(True, True\)"):
        ours(call["callables"], call["sample_args"], **kwargs)


@contextlib.contextmanager
def _cpu_forward():
    # Megatron's forward on the CPU: the rotary embedding and the sample mask ask for
    # torch.cuda.current_device(), and the RNG tracker forks CUDA generators.
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    current_device, fork = torch.cuda.current_device, tracker.fork
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device, tracker.fork = current_device, fork


def test_megatron_replay_passes_keywords_beyond_the_captured_ones(tmp_path):
    # Megatron replays a layer by calling layer.cuda_graphs[i](hidden_states, **kwargs)
    # with every keyword TransformerBlock passes its layers, and is_first_microbatch
    # (Transformer Engine reads only the captured keywords and ignores the rest).
    seen = []
    with one_rank(str(tmp_path / "pg"), "gloo", SHAPE), megatron_te_graphs(), _cpu_forward():
        config = transformer_config(SHAPE, graphs=True, cpu=True)
        model = gpt_model(config, SHAPE)
        for layer in model.decoder.layers:

            def replay(*args, _layer=layer, **kwargs):
                seen.append((len(args), {k: type(v).__name__ for k, v in kwargs.items()}))
                captured = {k: kwargs[k] for k in SAMPLE_KWARGS}
                return _layer._te_cuda_graph_capture(*args, **captured)

            layer.cuda_graphs = [replay]
        batch = batches(SHAPE, 1, "cpu")[0]
        model(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    assert len(seen) == SHAPE.num_layers
    for num_args, kwargs in seen:
        assert num_args == 1  # hidden_states
        extra = {k: t for k, t in kwargs.items() if k not in SAMPLE_KWARGS}
        assert extra.pop("is_first_microbatch") == "bool"
        assert set(extra) == {
            "context",
            "context_mask",
            "rotary_pos_cos",
            "rotary_pos_sin",
            "rotary_pos_cos_sin",
            "attention_bias",
            "inference_context",
            "packed_seq_params",
            "sequence_len_offset",
            "padding_mask",
        }
        assert set(extra.values()) == {"NoneType"}


def test_megatron_graph_module_and_stand_in_are_restored():
    cg = importlib.import_module(GRAPH_HELPER_MODULE)
    utils = importlib.import_module("megatron.core.utils")
    namespace, version = dict(cg.__dict__), utils._te_version
    with megatron_te_graphs() as (inside, standin):
        assert inside is cg and cg.HAVE_TE_GRAPHS
        assert cg.make_graphed_callables is standin.make_graphed_callables is ours
        assert cg.is_te_min_version("2.10.0") and not cg.is_te_min_version("2.21.0")
    assert cg.__dict__ == namespace and utils._te_version is version
    assert not cg.HAVE_TE_GRAPHS and "make_graphed_callables" not in cg.__dict__
    assert "transformer_engine" not in sys.modules
    assert importlib.util.find_spec("transformer_engine") is None
