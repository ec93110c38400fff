"""CPU tests of ``benchmarks/probes/decode_gemms.py``'s pure parts: the projection shapes
it derives from a Llama config, and its summary of the measured GEMMs."""

import importlib.util

import pytest

from helpers.train_bench import BENCH


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location(
        "decode_gemms", BENCH / "probes" / "decode_gemms.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)


def test_shapes_follow_the_config(probe):
    got = probe.shapes(LLAMA)
    assert got["q"] == (2048, 2048)
    assert got["k_v"] == (512, 2048)  # four key-value heads of 128
    assert got["qkv_stacked"] == (3072, 2048)
    assert got["o"] == (2048, 2048)
    assert got["gate_up"] == (5632, 2048)
    assert got["gate_up_stacked"] == (11264, 2048)
    assert got["down"] == (2048, 5632)
    assert got["lm_head"] == (32000, 2048)


def test_shapes_take_an_explicit_head_dim(probe):
    got = probe.shapes(dict(LLAMA, head_dim=64))
    assert got["q"] == (16 * 64, 2048)
    assert got["k_v"] == (4 * 64, 2048)
    assert got["o"] == (2048, 16 * 64)


def test_summary_ratios(probe):
    records = {
        "cublas": {
            "q": {"1": {"us": 4.0, "gbps": 2000.0}, "2": {"us": 4.4, "gbps": 1900.0}},
            "k_v": {"1": {"us": 5.0, "gbps": 400.0}, "2": {"us": 2.0, "gbps": 1000.0}},
        },
        "cublaslt": {"q": {"1": {"us": 4.0, "gbps": 2000.0}}},
    }
    got = probe.summary(records)
    assert got["cublas"]["q"] == {"2": 1.1}
    assert got["cublas"]["k_v"] == {"2": 0.4}
    assert got["cublas"]["k_v_over_q_bandwidth_at_1_row"] == 0.2
    # No key-value record: no ratio, and no error.
    assert got["cublaslt"]["k_v_over_q_bandwidth_at_1_row"] is None
    assert got["cublaslt"]["q"] == {}
