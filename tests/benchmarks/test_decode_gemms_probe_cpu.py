"""CPU tests of ``benchmarks/probes/decode_gemms.py``'s pure parts: the projection shapes
it derives from a Llama config, and its summary of the measured GEMMs."""

import pytest

from helpers.train_bench import load_probe


@pytest.fixture(scope="module")
def probe():
    module = load_probe("decode_gemms")
    return module


# Widths that differ from each other, so that an out/in swap or a head count taken for
# another shows: query width 128 (4 heads of 32) against hidden 96.
LLAMA = dict(
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1000,
)


def test_shapes_follow_the_config(probe):
    got = probe.shapes(LLAMA)
    assert got["q"] == (128, 96)
    assert got["k_v"] == (64, 96)  # two key-value heads of 32
    assert got["qkv_stacked"] == (256, 96)
    assert got["o"] == (96, 128)
    assert got["gate_up"] == (160, 96)
    assert got["gate_up_stacked"] == (320, 96)
    assert got["down"] == (96, 160)
    assert got["lm_head"] == (1000, 96)


def test_shapes_without_head_dim_split_the_hidden_size(probe):
    config = {k: v for k, v in LLAMA.items() if k != "head_dim"}
    got = probe.shapes(config)
    assert got["q"] == (96, 96)  # 4 heads of 96 / 4
    assert got["k_v"] == (48, 96)
    assert got["o"] == (96, 96)


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
