"""Property tests of the two pure policies in ``cudagraphs.compile_watch``, each
against a plain reference: which fix a recompile reason gets, and which compile
options may go inside our graphs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraphs.compile_watch import GRAPH_RECORDING_MODES, check_compile_options, recompile_fix
from cudagraphs.errors import CudaGraphsValueError

SHAPE_WORDS = ("size", "stride", "dim")
MODE_WORDS = ("grad_mode", "global_state", "autocast")
# Words of no kind: no fix word inside them, in any case.
NEUTRAL = st.sampled_from(["L['step']", "==", "3", "id(", "type", "lr", "0.1", "match", " "])


def reference_kind(reason: str) -> str:
    """The kind of fix, read word by word: shape words first, then mode words."""
    low = reason.lower()
    if any(w in low for w in SHAPE_WORDS):
        return "shape"
    if any(w in low for w in MODE_WORDS):
        return "mode"
    return "value"


def cased(word: str, flips: list[bool]) -> str:
    return "".join(c.upper() if f else c for c, f in zip(word, flips + [False] * len(word)))


@st.composite
def reasons(draw):
    parts = draw(st.lists(NEUTRAL, max_size=6))
    for word in draw(st.lists(st.sampled_from(SHAPE_WORDS + MODE_WORDS), max_size=3)):
        flips = draw(st.lists(st.booleans(), max_size=len(word)))
        parts.insert(draw(st.integers(0, len(parts))), cased(word, flips))
    return " ".join(parts)


FIXES = {
    "shape": recompile_fix("size"),
    "mode": recompile_fix("grad_mode"),
    "value": recompile_fix("L['x'] == 1"),
}


def test_the_three_fixes_differ():
    assert len(set(FIXES.values())) == 3


@given(reasons())
def test_each_reason_gets_the_fix_of_its_kind(reason):
    assert recompile_fix(reason) == FIXES[reference_kind(reason)]


OPTION_KEYS = st.sampled_from(["fullgraph", "dynamic", "backend", "disable"])
VALUES = st.one_of(st.booleans(), st.none(), st.sampled_from(["inductor", "eager", "x"]))
MODES = st.sampled_from([None, "default", "max-autotune-no-cudagraphs", *GRAPH_RECORDING_MODES])
INNER = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(["triton.cudagraphs", "max_autotune", "epilogue_fusion"]), st.booleans()
    ),
)


@given(st.dictionaries(OPTION_KEYS, VALUES), MODES, INNER)
def test_options_are_refused_exactly_when_inductor_would_record_graphs(extra, mode, inner):
    options = dict(extra)
    if mode is not None:
        options["mode"] = mode
    if inner is not None:
        options["options"] = inner
    records = mode in GRAPH_RECORDING_MODES or bool((inner or {}).get("triton.cudagraphs"))
    if records:
        with pytest.raises(CudaGraphsValueError, match="^here: compile_options with "):
            check_compile_options("here", options)
    else:
        out = check_compile_options("here", options)
        assert out == options and out is not options
