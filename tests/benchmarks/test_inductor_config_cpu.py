"""CPU tests of the compiled benchmarks' ``--inductor-config``: pairs parsed to Python
values (against a plain reference over random pairs), bad pairs refused by the
argument parser with the pair named, and the settings patched into inductor's config
for the run and restored after it, an unknown key refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import script


@pytest.fixture(scope="module")
def compiled():
    return script("_compiled")


def reference_value(raw: str):
    # Python's and JSON's spellings of a bool only: "TRUE" stays a string.
    if raw in ("True", "true", "False", "false"):
        return raw[0] in "Tt"
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return raw


def test_known_pairs(compiled):
    got = compiled.parse_inductor_config(
        [
            "triton.enable_pdl=True",
            "combo_kernels=false",
            "max_autotune_gemm_search_space=EXHAUSTIVE",
            "x=3",
            "y=0.5",
            " z = 7 ",
        ]
    )
    assert got == {
        "triton.enable_pdl": True,
        "combo_kernels": False,
        "max_autotune_gemm_search_space": "EXHAUSTIVE",
        "x": 3,
        "y": 0.5,
        "z": 7,
    }
    assert isinstance(got["x"], int) and not isinstance(got["x"], bool)


keys = st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8})?", fullmatch=True)
raws = st.one_of(
    st.sampled_from(["True", "False", "true", "false", "TRUE", "1", "0", "-2", "1e3", "0.25"]),
    st.integers(-1000, 1000).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.from_regex(r"[A-Za-z_]{1,10}", fullmatch=True),
)


@given(st.lists(st.tuples(keys, raws), max_size=5))
def test_parsing_matches_the_reference(compiled, pairs):
    got = compiled.parse_inductor_config([f"{k}={v}" for k, v in pairs])
    want = {k: reference_value(v) for k, v in pairs}
    assert got == want
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}


@pytest.mark.parametrize("bad", ["combo_kernels", "=True", " =1"])
def test_a_pair_without_key_or_value_sign_is_refused_by_name(compiled, bad):
    with pytest.raises(ValueError, match="KEY=VALUE") as info:
        compiled.parse_inductor_config(["x=1", bad])
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bench", ["train_step", "train_step_hf", "serving_hf"])
def test_the_benchmarks_take_the_option_and_refuse_a_bad_pair(bench, capsys):
    mod = script(bench)
    args = mod.parse_args(["--inductor-config", "combo_kernels=True", "triton.enable_pdl=1"])
    assert args.inductor == {"combo_kernels": True, "triton.enable_pdl": 1}
    assert mod.parse_args([]).inductor == {}
    with pytest.raises(SystemExit):
        mod.parse_args(["--inductor-config", "combo_kernels"])
    assert "'combo_kernels'" in capsys.readouterr().err


def test_settings_hold_for_the_run_and_are_restored(compiled):
    import torch._inductor.config as config

    before = (config.combo_kernels, config.triton.enable_pdl)
    with compiled.inductor_config({"combo_kernels": not before[0], "triton.enable_pdl": True}):
        assert config.combo_kernels is (not before[0])
        assert config.triton.enable_pdl is True
    assert (config.combo_kernels, config.triton.enable_pdl) == before
    with compiled.inductor_config({}):
        assert (config.combo_kernels, config.triton.enable_pdl) == before


def test_an_unknown_key_is_refused_before_the_run(compiled):
    ran = []
    with (
        pytest.raises(AttributeError, match="no_such_setting_anywhere"),
        compiled.inductor_config({"no_such_setting_anywhere": 1}),
    ):
        ran.append(1)
    assert ran == []


# ---- fastest: which of ours' compiled variants the targets take -------------------------
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]),
        st.one_of(st.none(), st.floats(0.01, 100.0)),
    ),
    st.lists(st.sampled_from(["a", "b", "c"]), unique=True),
)
def test_fastest_is_the_first_lowest_time_among_the_names_that_ran(compiled, ms, names):
    ran = [n for n in names if ms.get(n) is not None]
    want = None
    for n in ran:  # the reference: a plain scan, first on a tie
        if want is None or ms[n] < ms[want]:
            want = n
    assert compiled.fastest(ms, names) == want
