"""How the next token is chosen: greedy, or sampled through HF's own logits processors,
and when a sequence stops. Mirrors ``GenerationMixin.generate`` step for step, so that
greedy tokens equal HF's on the same logits:

* the logits of the last position are taken in float32;
* a repetition penalty (HF's processor, over the prompt and the tokens made so far)
  comes first, then the minimum lengths (end-of-sequence ids held back until
  ``min_length`` tokens in all, or ``min_new_tokens`` new ones: where that is set,
  0 included, it replaces ``min_length``, as in ``generate``), greedy decoding too;
* sampling applies temperature, then top-k, then top-p (HF's order), a softmax and
  ``torch.multinomial`` (here with the caller's ``torch.Generator``, when given);
* once a sequence has produced an end-of-sequence token, later tokens of it are the pad
  token, and the request ends when every sequence has ended or ``max_new_tokens``
  tokens were made.

Values HF treats as "off" are off here too (temperature 1.0, top_k 0 or None, top_p
1.0 or None, repetition_penalty 1.0, minimum lengths 0), and, as in HF, the warpers
(temperature, top-k, top-p) are ignored without ``do_sample``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...checks import check_bool, check_int, check_number
from ...errors import CudaGraphsTypeError, CudaGraphsValueError

__all__ = [
    "Sampling",
    "StopTokens",
    "check_sampling_generator",
    "penalty_skips_padding",
    "sampling_rule",
    "stop_tokens",
    "vocab_size_of",
]


@dataclass(frozen=True)
class Sampling:
    """The decoding rule of one request. Checked here.

    Raises:
        CudaGraphsTypeError: a value of the wrong type (naming it).
        CudaGraphsValueError: when sampling, temperature <= 0, top_k < 0 or top_p
            outside [0, 1] (0 keeps the likeliest token, as in HF); repetition_penalty
            <= 0, a minimum length below 0. Greedy decoding holds the warpers' values
            neutral (temperature 1, no top-k or top-p), as HF's generate ignores them.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    min_length: int = 0
    # None: not set. Set (0 included), it decides alone: generate then takes the
    # minimum length as prompt length + min_new_tokens, whatever min_length says
    # (GenerationMixin._prepare_generated_length).
    min_new_tokens: int | None = None

    def __post_init__(self) -> None:
        check_bool("do_sample", self.do_sample)
        check_number("temperature", self.temperature)
        # HF's warpers take Python floats only (an int 2 or a numpy float32 raises
        # there, mid-request): the numbers checked are held as floats.
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                check_number(name, value)
                object.__setattr__(self, name, float(value))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", check_int("top_k", self.top_k))
        if not self.do_sample:
            # Greedy decoding reads no warper, and HF's generate ignores their values
            # then (temperature=0 in a generation_config meaning "greedy", say): held
            # neutral, checked for their types only.
            object.__setattr__(self, "temperature", 1.0)
            object.__setattr__(self, "top_k", None)
            object.__setattr__(self, "top_p", None)
        if not 0 < self.temperature < math.inf:
            raise CudaGraphsValueError(
                f"temperature must be a finite number > 0, got {self.temperature}; for "
                "greedy decoding pass do_sample=False"
            )
        if self.top_k is not None and self.top_k < 0:
            raise CudaGraphsValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.top_p is not None:
            check_number("top_p", self.top_p)
            if not 0.0 <= self.top_p <= 1.0:
                raise CudaGraphsValueError(f"top_p must be in [0, 1], got {self.top_p}")
        check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < math.inf:
            raise CudaGraphsValueError(
                f"repetition_penalty must be a finite number > 0, got "
                f"{self.repetition_penalty}; 1.0 is off"
            )
        # Held as ints: HF's processors take Python ints only (a numpy int raises there,
        # mid-request, after the prefill).
        object.__setattr__(self, "min_length", check_int("min_length", self.min_length, minimum=0))
        if self.min_new_tokens is not None:
            at_least = check_int("min_new_tokens", self.min_new_tokens, minimum=0)
            object.__setattr__(self, "min_new_tokens", at_least)

    @property
    def reads_sequences(self) -> bool:
        """Whether the processors read the tokens so far (the repetition penalty and the
        minimum lengths do; the warpers read only the logits)."""
        if self.min_new_tokens is not None:
            holds_back = self.min_new_tokens > 0
        else:
            holds_back = self.min_length > 0
        return self.repetition_penalty != 1.0 or holds_back

    def processors(
        self,
        prompt_len: int = 0,
        eos: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> Any:
        """HF's ``LogitsProcessorList`` for this rule, in HF's order (empty for plain
        greedy decoding). The minimum lengths need the request's (padded) prompt length
        and its end-of-sequence ids (a device tensor); without ids, as in HF, they
        hold nothing back. ``padding`` (per row, the left-padding tokens of the prompt)
        is left out of the repetition penalty where the installed ``generate`` does
        so (:func:`penalty_skips_padding`)."""
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            MinLengthLogitsProcessor,
            MinNewTokensLengthLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            skip = padding if padding is not None and penalty_skips_padding() else None
            # Without padding to skip, the one-argument form: releases whose generate
            # penalizes every prompt id may not know prompt_ignore_length.
            out.append(
                RepetitionPenaltyLogitsProcessor(self.repetition_penalty, prompt_ignore_length=skip)
                if skip is not None
                else RepetitionPenaltyLogitsProcessor(penalty=self.repetition_penalty)
            )
        # The ids are given as a tensor, which HF's processors keep where it is (their
        # device argument only places ids given as ints): on the scores' device.
        if eos is not None and eos.numel() > 0:
            # As generate: a set min_new_tokens makes the minimum length the prompt
            # length plus it, and adds its own processor when above 0.
            min_length = (
                self.min_length if self.min_new_tokens is None else prompt_len + self.min_new_tokens
            )
            if min_length > 0:
                out.append(MinLengthLogitsProcessor(min_length, eos))
            if self.min_new_tokens:
                out.append(MinNewTokensLengthLogitsProcessor(prompt_len, self.min_new_tokens, eos))
        if not self.do_sample:
            return out
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p))
        return out


@functools.cache  # a fact of the installed release; reading generate's source takes ~5 ms
def penalty_skips_padding() -> bool:
    """Whether the installed transformers' ``generate`` leaves a prompt's left padding
    out of the repetition penalty. Newer releases pass each row's padding length as
    the processor's ``prompt_ignore_length`` (so a pad id is not penalized or, below
    1.0, favoured, just for padding the batch); older ones penalize every prompt id.
    Read from ``generate``'s own processor setup, so the tokens follow the release
    installed."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    try:
        setup = inspect.getsource(GenerationMixin._get_logits_processor)
    except (AttributeError, OSError, TypeError):
        return False
    return "prompt_ignore_length" in setup


def check_sampling_generator(generator: Any, device: torch.device) -> None:
    """Raises:
    CudaGraphsTypeError: ``generator`` neither ``None`` nor a ``torch.Generator``.
    CudaGraphsValueError: a ``torch.Generator`` of another device type than ``device``
        (sampling would fail after the prefill has run).
    """
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise CudaGraphsTypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__} "
            f"{generator!r}: pass torch.Generator(device=...).manual_seed(seed) for "
            "seeded sampling"
        )
    if generator.device.type != device.type:
        raise CudaGraphsValueError(
            f"generator is on {generator.device}, the model on {device}: pass "
            f"torch.Generator(device={str(device)!r}).manual_seed(seed)"
        )


def sampling_rule(
    defaults: Any,
    do_sample: bool | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float | None = None,
    min_length: int | None = None,
    min_new_tokens: int | None = None,
) -> Sampling:
    """The request's :class:`Sampling`: each argument, or where it is ``None`` the value
    of ``defaults`` (the model's ``generation_config``), as ``generate`` merges them;
    without a config, HF's own defaults (greedy; temperature 1.0, top-k 50, top-p 1.0,
    no repetition penalty, no minimum length)."""

    def pick(value: Any, name: str, fallback: Any) -> Any:
        if value is not None:
            return value
        stated = getattr(defaults, name, None)
        return fallback if stated is None else stated

    return Sampling(
        do_sample=pick(do_sample, "do_sample", False),
        temperature=pick(temperature, "temperature", 1.0),
        top_k=pick(top_k, "top_k", 50),
        top_p=pick(top_p, "top_p", 1.0),
        repetition_penalty=pick(repetition_penalty, "repetition_penalty", 1.0),
        min_length=pick(min_length, "min_length", 0),
        min_new_tokens=pick(min_new_tokens, "min_new_tokens", None),
    )


@dataclass(frozen=True)
class StopTokens:
    """End-of-sequence ids (a device tensor, possibly empty) and the pad id written after
    a sequence ends (``None`` when there is no end-of-sequence id)."""

    eos: torch.Tensor
    pad: int | None

    @property
    def active(self) -> bool:
        return self.eos.numel() > 0


def stop_tokens(
    eos_token_id: Any,
    pad_token_id: Any,
    defaults: Any,
    device: torch.device,
    model: Any = None,
) -> StopTokens:
    """The request's stop tokens: the arguments, else the model's ``generation_config``
    (``defaults``), as HF does; the pad id falls back to the first end-of-sequence id.

    Raises:
        CudaGraphsTypeError: ids that are not ints (or a sequence of ints for EOS).
        CudaGraphsValueError: an id outside the vocabulary of ``model`` (checked
            when it is given and says its size): the model could never make it, and a
            pad id written into the sequence would fail in the embedding steps later.
    """
    vocab_size = vocab_size_of(model) if model is not None else None
    if eos_token_id is None:
        eos_token_id = getattr(defaults, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(defaults, "pad_token_id", None)
    eos = _id_list("eos_token_id", eos_token_id)
    if pad_token_id is not None:
        pad_token_id = check_int("pad_token_id", pad_token_id)
    if vocab_size is not None:
        named = [(f"eos_token_id {e}", e) for e in eos]
        named += [] if pad_token_id is None else [(f"pad_token_id {pad_token_id}", pad_token_id)]
        bad = [what for what, i in named if not 0 <= i < vocab_size]
        if bad:
            raise CudaGraphsValueError(
                f"{', '.join(bad)} outside the model's vocabulary [0, {vocab_size}): pass "
                "ids of the model's tokenizer (tokenizer.eos_token_id, "
                "tokenizer.pad_token_id), or eos_token_id=[] to stop only at "
                "max_new_tokens"
            )
    if eos and pad_token_id is None:
        pad_token_id = eos[0]
    return StopTokens(torch.tensor(eos, dtype=torch.long, device=device), pad_token_id)


def _id_list(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [check_int(f"{name}[{i}]", v) for i, v in enumerate(value)]
    raise CudaGraphsTypeError(
        f"{name} must be an int or a list of ints, got {type(value).__name__} {value!r}"
    )


def vocab_size_of(model: Any, embedding: str = "output") -> int | None:
    """The rows of the model's ``"output"`` embedding (the ids it can make) or its
    ``"input"`` one (the ids a prompt may hold), else its config's ``vocab_size``;
    ``None`` when it says neither."""
    getter = "get_output_embeddings" if embedding == "output" else "get_input_embeddings"
    head = getattr(model, getter, lambda: None)()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None
