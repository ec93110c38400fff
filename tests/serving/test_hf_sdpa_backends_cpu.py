"""GraphedGenerator(sdpa_backends=...) on the CPU: which attention backends the decode
steps run under (torch's backend flags, read inside each step), the default for a
compiled capture (every backend but cuDNN's) and for the model's own kernels (torch's
choice), the prefill left alone, the flags restored afterwards, and typed errors for
what is no set of backends."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend

from helpers.hf_models import tiny

transformers = pytest.importorskip("transformers")

from cudagraphs.errors import CudaGraphsTypeError, CudaGraphsValueError  # noqa: E402
from cudagraphs.serving.hf import GraphedGenerator  # noqa: E402
from cudagraphs.serving.hf.attention import (  # noqa: E402
    COMPILED_SDPA_BACKENDS,
    check_sdpa_backends,
)
from helpers.hf_generate import EOS, PAD, captured, hf_generate, prompts  # noqa: E402

NEW = 4


def _flags() -> frozenset[str]:
    b = torch.backends.cuda
    on = {
        "CUDNN_ATTENTION": b.cudnn_sdp_enabled(),
        "FLASH_ATTENTION": b.flash_sdp_enabled(),
        "EFFICIENT_ATTENTION": b.mem_efficient_sdp_enabled(),
        "MATH": b.math_sdp_enabled(),
    }
    return frozenset(k for k, v in on.items() if v)


EVERY = frozenset({"CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"})


@pytest.fixture(scope="module")
def model():
    return tiny("llama").eval()


@pytest.fixture
def seen(monkeypatch):
    """The backend flags of every decode step (the runner's forward) and of every
    prefill (the model called with more than one position), in order."""
    record = {"decode": [], "prefill": []}
    decode_on = GraphedGenerator._decode_on

    def spy(self, model, kv, input_ids, position_ids, attention_mask):
        record["decode"].append(_flags())
        return decode_on(self, model, kv, input_ids, position_ids, attention_mask)

    monkeypatch.setattr(GraphedGenerator, "_decode_on", spy)
    return record


def _eager_compile(gm, example_inputs):
    return gm.forward


def test_a_compiled_capture_decodes_without_cudnn_attention_by_default(model, fresh_dynamo, seen):
    gen = captured(model, (1, 2), compile_options={"backend": _eager_compile})
    assert seen["decode"], "the capture's warmups ran decode steps"
    assert set(seen["decode"]) == {EVERY - {"CUDNN_ATTENTION"}}
    assert _flags() == EVERY, "the flags are restored after the capture"
    assert gen.stats()["sdpa_backends"] == [b.name for b in COMPILED_SDPA_BACKENDS]
    ids, mask = prompts(2, seed=2)
    ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))


def test_the_models_own_kernels_keep_torchs_choice_by_default(model, seen):
    gen = captured(model, (1, 2))
    assert set(seen["decode"]) == {EVERY}
    assert gen.stats()["sdpa_backends"] is None


def test_given_backends_hold_for_every_decode_step_and_never_for_the_prefill(model):
    calls = []

    def hook(module, args, kwargs):
        calls.append((kwargs["input_ids"].shape[1], _flags()))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        gen = captured(model, (1, 2), sdpa_backends=[SDPBackend.MATH])
        assert gen.stats()["sdpa_backends"] == ["MATH"]
        calls.clear()
        ids, mask = prompts(2, prompt_len=5, seed=5)
        ours = gen.generate(ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    finally:
        handle.remove()
    prefill = [f for n, f in calls if n > 1]
    decode = [f for n, f in calls if n == 1]
    assert prefill == [EVERY]
    # The stand-in capture runs each decode step eagerly: every one went through.
    assert decode and set(decode) == {frozenset({"MATH"})}
    assert torch.equal(ours, hf_generate(model, ids, mask, NEW, eos_token_id=EOS, pad_token_id=PAD))
    assert _flags() == EVERY


def test_every_backend_given_is_torchs_choice_in_a_compiled_capture(model, fresh_dynamo, seen):
    every = (*COMPILED_SDPA_BACKENDS, SDPBackend.CUDNN_ATTENTION)
    gen = captured(model, (1,), compile_options={"backend": _eager_compile}, sdpa_backends=every)
    assert set(seen["decode"]) == {EVERY}
    assert set(gen.stats()["sdpa_backends"]) == {b.name for b in every}


def test_the_default_set_is_exported_beside_the_generator():
    import cudagraphs.serving.hf as hf

    assert hf.COMPILED_SDPA_BACKENDS is COMPILED_SDPA_BACKENDS
    assert SDPBackend.CUDNN_ATTENTION not in COMPILED_SDPA_BACKENDS


def test_the_default_follows_the_compile_and_an_explicit_set_is_kept_in_order():
    assert check_sdpa_backends(None, compiled=True) == COMPILED_SDPA_BACKENDS
    assert check_sdpa_backends(None, compiled=False) is None
    given = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    for compiled in (True, False):
        assert check_sdpa_backends(given, compiled) == (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION)
        assert check_sdpa_backends(SDPBackend.MATH, compiled) == (SDPBackend.MATH,)


@pytest.mark.parametrize(
    "value, error, said",
    [
        ("MATH", CudaGraphsTypeError, "got str"),
        (3, CudaGraphsTypeError, "got int"),
        ([SDPBackend.MATH, "flash"], CudaGraphsTypeError, "[1] str"),
        (["flash", SDPBackend.MATH, 2], CudaGraphsTypeError, "not: [0] str, [2] int:"),
        ((), CudaGraphsValueError, "is empty"),
        ([SDPBackend.ERROR], CudaGraphsValueError, "SDPBackend.ERROR"),
    ],
)
def test_what_is_no_set_of_backends_is_refused_by_name_with_the_fix(model, value, error, said):
    with pytest.raises(error) as info:
        GraphedGenerator(model, (1,), max_cache_len=16, sdpa_backends=value)
    message = str(info.value)
    assert "sdpa_backends" in message and said in message
    # The fix names what to pass.
    assert "pass a sequence of torch.nn.attention.SDPBackend members, e.g. " in message
    assert "(SDPBackend.FLASH_ATTENTION, SDPBackend.MATH), or None for the default" in message
    # The next good construction works.
    gen = GraphedGenerator(model, (1,), max_cache_len=16, sdpa_backends=[SDPBackend.MATH])
    assert gen.sdpa_backends == (SDPBackend.MATH,)


_MEMBERS = [
    SDPBackend.ERROR,
    SDPBackend.MATH,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
]


def _reference(value, compiled):
    """What the check must answer, written plainly: the default, a typed refusal, or
    the members in first-seen order."""
    if value is None:
        return COMPILED_SDPA_BACKENDS if compiled else None
    items = [value] if isinstance(value, SDPBackend) else list(value)
    if any(not isinstance(b, SDPBackend) for b in items):
        return CudaGraphsTypeError
    if not items or SDPBackend.ERROR in items:
        return CudaGraphsValueError
    out = []
    for b in items:
        if b not in out:
            out.append(b)
    return tuple(out)


@given(
    value=st.none()
    | st.sampled_from(_MEMBERS)
    | st.lists(st.sampled_from(_MEMBERS) | st.sampled_from(["MATH", 1, None]), max_size=6)
    | st.lists(st.sampled_from(_MEMBERS), max_size=6).map(tuple),
    compiled=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_the_check_answers_as_the_plain_reference(value, compiled):
    want = _reference(value, compiled)
    if isinstance(want, type) and issubclass(want, Exception):
        with pytest.raises(want):
            check_sdpa_backends(value, compiled)
    else:
        assert check_sdpa_backends(value, compiled) == want
