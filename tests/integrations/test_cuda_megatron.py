"""Megatron-Core 0.19.2's own ``TECudaGraphHelper`` over a ``GPTModel`` (local layer
spec, bf16, one rank, Megatron's DDP) capturing with cudagraphs' helper behind the
Transformer Engine names it imports (the test-only stand-in, FP8 off): Megatron's
kwargs are accepted, every step replays every layer's forward and backward graph,
and training equals the eager model bit for bit (losses, parameters, ``main_grad``).

Skipped unless megatron-core imports, Python >= 3.12 (megatron-core 0.19's floor) and
a CUDA device is present. The case itself is ``helpers.megatron_case.run_case``."""

import importlib
import importlib.util
import sys

import pytest

from helpers.megatron_case import GRAPH_HELPER_MODULE, CaseShape, megatron_skip_reason, run_case

pytestmark = pytest.mark.cuda

STEPS = 4
SHAPE = CaseShape()

# Megatron-Core 0.19.2 under TE 2.20, one rank, cuda_graph_warmup_steps=0, no FP8
# (test_megatron_kwargs_cpu.py checks their values on the CPU).
KWARGS = [
    "_num_layers_per_chunk",
    "_order",
    "_reuse_graph_input_output_buffers",
    "allow_unused_input",
    "fp8_enabled",
    "num_warmup_iters",
    "retain_graph_in_backward",
    "sample_kwargs",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    reason = megatron_skip_reason(need_gpu=True)
    if reason is not None:
        pytest.skip(reason)
    cg = importlib.import_module(GRAPH_HELPER_MODULE)
    before = {
        "namespace": dict(cg.__dict__),
        "spec": importlib.util.find_spec("transformer_engine"),
    }
    out = {}
    try:
        run_case(STEPS, str(tmp_path_factory.mktemp("megatron") / "pg"), SHAPE, report=out)
    except Exception as exc:
        # What the case got as far as (kwargs, refusals, types) says where it broke.
        raise AssertionError(f"the Megatron case failed: {exc!r}\nso far: {out}") from exc
    out["before"] = before
    return out


def test_megatron_passes_its_te_kwargs_and_none_is_refused(report):
    assert report["refused"] == []
    assert report["kwargs_passed"] == KWARGS, report["kwargs"]
    assert report["make_graphed_callables_calls"] == 1
    # Our capture scope drove the (stand-in) Transformer Engine capture flag once.
    assert report["te_capture_starts"] == 1


def test_every_step_replays_every_layer(report):
    assert report["graphed_types"] == ["GraphedCallable"]
    # One forward and one backward graph per layer per step, and nothing else: an
    # eager fallback or an extra replay would change the count.
    assert report["replays"] == report["expected_replays"] == 2 * SHAPE.num_layers * STEPS
    assert "is_first_microbatch" in report["replay_kwargs"]


def test_training_equals_eager_bitwise(report):
    assert report["equal_to_eager"], (
        f"{report['num_differing']} tensors differ (max abs {report['max_abs_diff']:.3e}), "
        f"first: {report['differing']}; losses {report['losses']} vs eager "
        f"{report['eager_losses']}"
    )
    assert report["losses"] == report["eager_losses"]
    assert len(set(report["losses"])) == STEPS, "the model did not train"


def test_nothing_is_left_behind(report):
    cg = importlib.import_module(GRAPH_HELPER_MODULE)
    assert cg.__dict__ == report["before"]["namespace"]
    assert not cg.HAVE_TE_GRAPHS and "make_graphed_callables" not in cg.__dict__
    assert "transformer_engine" not in sys.modules
    assert importlib.util.find_spec("transformer_engine") == report["before"]["spec"] is None
