"""Property tests of the two pure policies in ``cudagraphs.compile_watch``, each
against a plain reference: which fix a recompile reason gets, and which compile
options may go inside our graphs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.compile_watch import GRAPH_RECORDING_MODES, check_compile_options, recompile_fix
from cudagraphs.errors import CudaGraphsValueError

SHAPE_WORDS = ("size mismatch", "stride mismatch", "rank mismatch", ".size()", ".stride()")
MODE_WORDS = ("grad_mode", "global_state", "autocast")
TRAINING = ".training =="
# Words of no kind: no fix word inside them, in any case; some look like one.
NEUTRAL = st.sampled_from(
    ["L['step']", "==", "3", "id(", "type", "lr", "0.1", "match", " ", "window_size", "dim=-1"]
)


def reference_kind(reason: str) -> str:
    """The kind of fix, read from the guards alone (each line up to its ``#``): shape
    words first, then mode words, then a module's training flag."""
    guards = " ".join(line.split("#")[0] for line in reason.lower().splitlines())
    if any(w in guards for w in SHAPE_WORDS):
        return "shape"
    if any(w in guards for w in MODE_WORDS):
        return "mode"
    if TRAINING in guards:
        return "training"
    return "value"


def cased(word: str, flips: list[bool]) -> str:
    return "".join(c.upper() if f else c for c, f in zip(word, flips + [False] * len(word)))


@st.composite
def reasons(draw):
    """Guards and source comments (``# ...``) over one or more lines, with fix words
    in either."""
    parts = draw(st.lists(NEUTRAL, max_size=6))
    for word in draw(st.lists(st.sampled_from((*SHAPE_WORDS, *MODE_WORDS, TRAINING)), max_size=3)):
        flips = draw(st.lists(st.booleans(), max_size=len(word)))
        parts.insert(draw(st.integers(0, len(parts))), cased(word, flips))
    for _ in range(draw(st.integers(0, 2))):
        parts.insert(draw(st.integers(0, len(parts))), draw(st.sampled_from(["#", "\n"])))
    return " ".join(parts)


FIXES = {
    "shape": recompile_fix("size mismatch"),
    "mode": recompile_fix("grad_mode"),
    "training": recompile_fix("L['m'].training == True"),
    "value": recompile_fix("L['x'] == 1"),
}


def test_the_four_fixes_differ():
    assert len(set(FIXES.values())) == 4


@given(reasons())
def test_each_reason_gets_the_fix_of_its_kind(reason):
    assert recompile_fix(reason) == FIXES[reference_kind(reason)]


OPTION_KEYS = st.sampled_from(["fullgraph", "dynamic", "backend", "disable", "fullgrpah"])
VALUES = st.one_of(
    st.booleans(), st.none(), st.sampled_from(["inductor", "eager", "x", "cudagraphs"])
)
MODES = st.sampled_from(
    [None, "default", "max-autotune-no-cudagraphs", "reduce_overhead", *GRAPH_RECORDING_MODES]
)
INNER = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(["triton.cudagraphs", "max_autotune", "epilogue_fusion"]), st.booleans()
    ),
)
#: torch.compile's keywords and modes, as this test knows them.
KEYWORDS = {"fullgraph", "dynamic", "backend", "mode", "options", "disable"}
KNOWN_MODES = {"default", "lite", "max-autotune-no-cudagraphs", *GRAPH_RECORDING_MODES}


def torch_compile_refuses(options):
    """Whether torch.compile itself refuses ``options`` (before any compile)."""
    try:
        torch.compile(lambda x: x, **options)
    except Exception:
        return True
    return False


@settings(deadline=None)  # the first mode checked imports inductor
@given(st.dictionaries(OPTION_KEYS, VALUES), MODES, INNER)
def test_options_are_refused_exactly_when_inductor_would_record_graphs(extra, mode, inner):
    # Or when torch.compile would refuse them itself, at the first compile.
    options = dict(extra)
    if mode is not None:
        options["mode"] = mode
    if inner is not None:
        options["options"] = inner
    records = mode in GRAPH_RECORDING_MODES or bool((inner or {}).get("triton.cudagraphs"))
    records = records or options.get("backend") == "cudagraphs"
    # torch.compile itself is the reference: a keyword or mode it does not know, a mode
    # beside options, a backend it does not know, a value of the wrong kind.
    wrong = torch_compile_refuses(options)
    assert wrong or set(options) <= KEYWORDS and (mode is None or mode in KNOWN_MODES)
    if records or wrong:
        with pytest.raises(CudaGraphsValueError, match="^here: compile_options (with|has) "):
            check_compile_options("here", options)
    else:
        out = check_compile_options("here", options)
        assert out == options and out is not options
