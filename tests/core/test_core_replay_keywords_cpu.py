"""Keywords a replay call may add to the captured ones (Transformer Engine's replay
reads the captured keys only; Megatron-Core calls graphed layers with every keyword of
``TransformerLayer.forward``): only those that leave the call what it was at capture.
Checked against a reference that binds the call both ways."""

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from cudagraphs import CudaGraphInputError
from cudagraphs.core.runtime import EntryGraphs
from cudagraphs.core.te_compat import FIRST_MICROBATCH, ReplayKeywords

NAMES = ["a", "b", "c", "mask", FIRST_MICROBATCH]
DEFAULTS = st.sampled_from([None, 0, "x", inspect.Parameter.empty])
VALUES = st.sampled_from([None, True, 0, 1.5, "x"])


def _function(defaults: dict):
    params = [inspect.Parameter("hidden", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in defaults.items()
    ]

    def fn(hidden, **kwargs):
        return kwargs

    fn.__signature__ = inspect.Signature(params)
    return fn


def _bound(fn, kwargs):
    """What the callable receives for ``fn(0, **kwargs)`` (required keywords the
    capture would have passed left unbound), or None when it refuses."""
    try:
        bound = inspect.signature(fn).bind_partial(0, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


@settings(max_examples=300, deadline=None)
@given(
    defaults=st.dictionaries(st.sampled_from(NAMES), DEFAULTS, max_size=5),
    captured=st.sets(st.sampled_from(NAMES), max_size=3),
    call=st.dictionaries(st.sampled_from(NAMES), VALUES, max_size=5),
)
def test_added_keywords_are_dropped_only_where_the_call_stays_the_captured_one(
    defaults, captured, call
):
    captured &= set(defaults)  # a capture passed only keywords the callable takes
    fn = _function(defaults)
    rule = ReplayKeywords.of(fn, sorted(captured))
    kept, problems = rule.split(call)
    assert {k: v for k, v in call.items() if k in captured} == kept
    dropped = {
        k: v
        for k, v in call.items()
        if k not in captured and k not in {p.path[8:-2] for p in problems}
    }
    refused = {p.path[8:-2] for p in problems}
    assert set(kept) | set(dropped) | refused == set(call) and not refused & set(dropped)
    for name, value in dropped.items():
        if name == FIRST_MICROBATCH and name not in defaults:
            # TE's flag, which the callable does not take: only a bool is dropped.
            assert isinstance(value, bool)
        else:
            # Dropping it binds the callable's arguments exactly as passing it does.
            with_it = _bound(fn, {**kept, name: value})
            assert with_it is not None and with_it == _bound(fn, kept), name
    for name in refused:
        # Refused: neither TE's flag (a bool, not taken by the callable) nor None for a
        # keyword declared with default None; so dropping it might change the call.
        value = call[name]
        te_flag = name == FIRST_MICROBATCH and name not in defaults and isinstance(value, bool)
        declared_none = name in defaults and defaults[name] is None
        assert not te_flag and not (value is None and declared_none), name


def test_megatrons_replay_call_is_accepted_and_its_flag_left_out_of_eager_calls():
    def forward(
        hidden_states,
        attention_mask=None,
        context=None,
        rotary_pos_emb=None,
        packed_seq_params=None,
        sequence_len_offset=None,
    ):
        return hidden_states

    rule = ReplayKeywords.of(forward, ["attention_mask", "rotary_pos_emb"])
    call = dict(
        attention_mask=1,
        rotary_pos_emb=2,
        context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        is_first_microbatch=True,
    )
    assert rule.split(call) == ({"attention_mask": 1, "rotary_pos_emb": 2}, [])
    assert FIRST_MICROBATCH not in rule.eager(call) and len(rule.eager(call)) == 5
    kept, problems = rule.split({**call, "context": torch.ones(1), "stream": object()})
    assert [(p.path, p.field, p.received) for p in problems] == [
        ("kwargs['context']", "keyword", "Tensor"),
        ("kwargs['stream']", "keyword", "object"),
    ]


def test_a_callable_without_a_signature_may_add_nothing():
    rule = ReplayKeywords.of(torch.add, ["alpha"])
    assert rule.split({"alpha": 1, "out": None})[1][0].path == "kwargs['out']"


def _entry(rule):
    x = torch.zeros(2)
    leaves, spec = pytree.tree_flatten(((x,), {"mask": x}))
    return EntryGraphs(
        name="callables[0] (layer)",
        in_spec=spec,
        leaves=leaves,
        tensor_positions=(0, 1),
        paths=("args[0]", "kwargs['mask']"),
        input_meta=((x.shape, x.dtype, False),) * 2,
        static_inputs=[x, x.clone()],
        params=(),
        replay_keywords=rule,
    )


def test_a_replay_call_checks_its_captured_keywords_and_names_every_other():
    def layer(x, mask=None, context=None, offset=0):
        return x

    entry = _entry(ReplayKeywords.of(layer, ["mask"]))
    y, m = torch.ones(2), torch.ones(2)
    assert entry.user_tensors((y,), {"mask": m, "context": None})[1] is m
    with pytest.raises(CudaGraphInputError, match="keywords the capture did not have") as err:
        entry.user_tensors((y,), {"mask": m, "context": m, "offset": None})
    assert [p.path for p in err.value.mismatches] == ["kwargs['context']", "kwargs['offset']"]
    assert "sample_kwargs" in str(err.value)
