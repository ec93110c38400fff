"""CPU tests of cudagraphs.hf_masks: transformers' mask choice under capture, the
stream capture faked by monkeypatching ``torch.cuda.is_current_stream_capturing``.

The first part drives the wrapper through a stand-in for ``transformers.masking_utils``
whose ``is_tracing`` answers as transformers 5.17's does (true under capture, with or
without a tensor), so the rule is tested whatever transformers is installed. The second
part runs tiny HF models on the CPU and records the SDPA arguments transformers passes:
inside the scope under capture they are eager's, wherever eager's choice reads no tensor.
"""

import sys
import types

import pytest
import torch

from cudagraphs.hf_masks import (
    MASKING_MODULE,
    MaskChoices,
    eager_mask_choice,
    unread_masks_warning,
)


@pytest.fixture
def capturing(monkeypatch):
    """Set ``state["on"]`` to make the current stream look captured."""
    state = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["on"])
    return state


@pytest.fixture
def masking(monkeypatch):
    """A stand-in ``transformers.masking_utils`` with transformers 5.17's rule."""
    module = types.ModuleType(MASKING_MODULE)

    def is_tracing(tensor=None):
        try:  # as transformers.utils.import_utils.is_cuda_stream_capturing
            return torch.cuda.is_current_stream_capturing()
        except Exception:
            return False

    module.is_tracing = is_tracing
    monkeypatch.setitem(sys.modules, MASKING_MODULE, module)
    return module


# Named as the masking_utils functions that ask, so that the record names them.
def _ignore_causal_mask_sdpa(module, padding_mask):
    return module.is_tracing(padding_mask)


def find_packed_sequence_indices(module, packed):
    return module.is_tracing(packed)


def test_outside_a_capture_every_answer_is_transformers_own(masking, capturing):
    original = masking.is_tracing
    with eager_mask_choice() as choices:
        assert masking.is_tracing is not original
        assert _ignore_causal_mask_sdpa(masking, None) is False
        assert _ignore_causal_mask_sdpa(masking, torch.ones(2, 3)) is False
    assert choices.unread == []
    assert masking.is_tracing is original


def test_under_capture_no_tensor_is_no_reason_to_decline(masking, capturing):
    capturing["on"] = True
    assert _ignore_causal_mask_sdpa(masking, None) is True  # transformers 5.17 alone
    with eager_mask_choice() as choices:
        assert _ignore_causal_mask_sdpa(masking, None) is False
    assert choices.unread == []
    assert _ignore_causal_mask_sdpa(masking, None) is True  # restored


def test_under_capture_a_tensor_still_declines_and_is_recorded_once(masking, capturing):
    capturing["on"] = True
    with eager_mask_choice() as choices:
        for _ in range(3):
            assert _ignore_causal_mask_sdpa(masking, torch.ones(2, 3)) is True
        assert find_packed_sequence_indices(masking, torch.zeros(2, 3)) is True
    assert choices.unread == [
        "_ignore_causal_mask_sdpa: the attention mask's values, for padding",
        "find_packed_sequence_indices: position_ids, for packed sequences",
    ]


def test_under_torch_compile_or_jit_tracing_the_answer_is_transformers_own(
    masking, capturing, monkeypatch
):
    capturing["on"] = True
    with eager_mask_choice() as choices:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert _ignore_causal_mask_sdpa(masking, None) is True
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)
        assert _ignore_causal_mask_sdpa(masking, None) is True
    assert choices.unread == []  # transformers' own answer is not ours to report


def test_a_scope_that_raises_puts_the_original_back(masking, capturing):
    original = masking.is_tracing
    with pytest.raises(RuntimeError, match="boom"), eager_mask_choice():
        raise RuntimeError("boom")
    assert masking.is_tracing is original


def test_nested_scopes_share_one_wrapper_and_each_records(masking, capturing):
    original = masking.is_tracing
    capturing["on"] = True
    with eager_mask_choice() as outer:
        wrapper = masking.is_tracing
        with eager_mask_choice() as inner:
            assert masking.is_tracing is wrapper
            find_packed_sequence_indices(masking, torch.zeros(1))
        assert masking.is_tracing is wrapper  # the outer scope is still open
        _ignore_causal_mask_sdpa(masking, torch.ones(1))
    assert masking.is_tracing is original
    assert [line.split(":")[0] for line in inner.unread] == ["find_packed_sequence_indices"]
    assert [line.split(":")[0] for line in outer.unread] == [
        "find_packed_sequence_indices",
        "_ignore_causal_mask_sdpa",
    ]


def test_an_is_tracing_replaced_inside_the_scope_is_kept(masking, capturing):
    def theirs(tensor=None):
        return False

    with eager_mask_choice():
        masking.is_tracing = theirs
    assert masking.is_tracing is theirs


def test_without_transformers_masking_utils_nothing_is_touched(monkeypatch):
    monkeypatch.delitem(sys.modules, MASKING_MODULE, raising=False)
    with eager_mask_choice() as choices:
        assert MASKING_MODULE not in sys.modules  # not imported by us
    assert isinstance(choices, MaskChoices) and choices.unread == []


def test_a_cpu_only_torch_reads_as_not_capturing(masking, monkeypatch):
    def stub():
        raise RuntimeError("Tried to instantiate dummy base class _cuda_isCurrentStreamCapturing")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", stub)
    with eager_mask_choice() as choices:
        assert masking.is_tracing(None) is False
        assert masking.is_tracing(torch.ones(1)) is False
    assert choices.unread == []


def test_the_warning_names_what_was_unread_and_only_the_fixes_that_apply():
    assert unread_masks_warning("graph_train_step", []) is None
    padding = "_ignore_causal_mask_sdpa: the attention mask's values, for padding"
    packed = "find_packed_sequence_indices: position_ids, for packed sequences"
    said = unread_masks_warning("graph_train_step", [padding])
    assert said.startswith("graph_train_step: under capture transformers could not read")
    assert (
        "the attention mask's values, for padding (masking_utils._ignore_causal_mask_sdpa)" in said
    )
    assert "1. call the model without attention_mask" in said
    assert "2." not in said and "use_cache" not in said
    said = unread_masks_warning("graph_train_step", [packed])
    assert "1. leave the model's cache on" in said and "attention_mask when" not in said
    said = unread_masks_warning("graph_train_step", [padding, packed])
    assert "1. call the model without attention_mask" in said
    assert "2. leave the model's cache on" in said


def test_disabled_graph_train_step_reports_no_built_masks(monkeypatch):
    from cudagraphs.train import graph_train_step

    monkeypatch.setenv("CUDAGRAPHS_DISABLE", "1")
    model = torch.nn.Linear(3, 2)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        return loss

    opt = torch.optim.AdamW(model.parameters())
    graphed = graph_train_step(step, torch.ones(2, 3), optimizer=opt)
    assert graphed.stats.masks_built_in_capture == ()


# ---- real transformers models on the CPU -------------------------------------------
@pytest.fixture
def sdpa_calls(monkeypatch):
    """The (attn_mask is None, is_causal, enable_gqa, key heads) of each SDPA call."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        calls.append((attn_mask is None, bool(is_causal), bool(kw.get("enable_gqa")), k.shape[1]))
        return real(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            **kw,
        )

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _tiny(family):
    from helpers import hf_fp32 as _hf_fp32

    pytest.importorskip("transformers.masking_utils")
    return _hf_fp32.build(family, "cpu")


def _run(model, calls, **call):
    """The model's loss and the distinct SDPA calls of one forward."""
    calls.clear()
    ids = torch.arange(2 * 16).reshape(2, 16) % 100 + 2
    loss = model(input_ids=ids, labels=ids, **call).loss
    return loss, sorted(set(calls))


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "olmoe", "gpt2"])
def test_under_capture_in_the_scope_transformers_passes_eagers_sdpa_arguments(
    family, capturing, sdpa_calls
):
    model = _tiny(family)
    eager_loss, eager = _run(model, sdpa_calls)
    assert eager and all(no_mask and causal for no_mask, causal, _, _ in eager)
    capturing["on"] = True
    with eager_mask_choice() as choices:
        loss, captured = _run(model, sdpa_calls)
    assert captured == eager
    assert choices.unread == []
    assert torch.equal(loss, eager_loss)  # the same attention path, the same numbers


@pytest.mark.parametrize(
    "call, check",
    [
        ({"use_cache": False}, "find_packed_sequence_indices"),
        ({"attention_mask": torch.ones(2, 16, dtype=torch.long)}, "_ignore_causal_mask_sdpa"),
    ],
    ids=["use_cache_false", "ones_mask"],
)
def test_where_eager_reads_a_tensor_the_capture_builds_the_mask_and_says_so(
    call, check, capturing, sdpa_calls
):
    model = _tiny("qwen2")
    capturing["on"] = True
    with eager_mask_choice() as choices:
        _, captured = _run(model, sdpa_calls, **call)
    # The explicit mask, and the keys repeated to the query heads (no enable_gqa).
    assert captured == [(False, False, False, 4)]
    assert [line.split(":")[0] for line in choices.unread] == [check]


def test_outside_a_capture_the_scope_changes_no_eager_result(sdpa_calls):
    model = _tiny("llama")
    for call in ({}, {"use_cache": False}, {"attention_mask": torch.ones(2, 16, dtype=torch.long)}):
        loss, calls = _run(model, sdpa_calls, **call)
        with eager_mask_choice() as choices:
            inside, inside_calls = _run(model, sdpa_calls, **call)
        assert torch.equal(inside, loss) and inside_calls == calls
        assert choices.unread == []
