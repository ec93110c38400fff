"""Settings of a model's ``generation_config`` that the graphed generator does not apply.

``model.generate`` builds its logits processors and stopping criteria from the model's
``generation_config``; the generator applies temperature, top-k, top-p, the repetition
penalty, the minimum lengths and the stop and pad ids only. A config that sets anything
else (banned words, n-gram blocking, beams, stop strings) would make its tokens differ from
``generate``'s without a word, so each request reads the config and the generator says
once which settings it leaves out, with their values.

A setting counts as set when it is neither ``None`` nor its neutral value (the value
with which HF adds no processor: a size of 0, a count of 1, an empty list).
Warpers that HF applies only when sampling are checked only for sampled requests.
"""

from __future__ import annotations

from typing import Any

from ...diagnostics import WarnOnce

__all__ = ["SAMPLING_ONLY", "UNAPPLIED", "unapplied_settings", "warn_unapplied"]

#: Setting -> its neutral values, for settings HF applies to every request.
UNAPPLIED: dict[str, tuple[Any, ...]] = {
    "no_repeat_ngram_size": (0,),
    "bad_words_ids": ((), []),
    "suppress_tokens": ((), []),
    "begin_suppress_tokens": ((), []),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "sequence_bias": ({},),
    "exponential_decay_length_penalty": (),
    "stop_strings": ((), [], ""),
    "max_time": (),
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "diversity_penalty": (0.0,),
    "penalty_alpha": (),
    "guidance_scale": (1.0,),
    "num_return_sequences": (1,),
    "constraints": ((), []),
    "force_words_ids": ((), []),
    "dola_layers": (),
    "watermarking_config": (),
}

#: Setting -> its neutral values, for warpers HF applies only when sampling.
SAMPLING_ONLY: dict[str, tuple[Any, ...]] = {
    "min_p": (0.0,),
    "top_h": (),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
}


def unapplied_settings(config: Any, do_sample: bool) -> dict[str, Any]:
    """The settings of ``config`` (a ``GenerationConfig``, or ``None``) that
    ``model.generate`` would apply to a request and the generator does not, with their
    values, in a fixed order."""
    if config is None:
        return {}
    checked = {**UNAPPLIED, **SAMPLING_ONLY} if do_sample else UNAPPLIED
    out = {}
    for name, neutral in checked.items():
        value = getattr(config, name, None)
        if value is not None and not any(_same(value, n) for n in neutral):
            out[name] = value
    return out


def _same(value: Any, neutral: Any) -> bool:
    # Lists, dicts and numbers compare by value; anything else that refuses (a tensor,
    # an object without ==) counts as set.
    try:
        return bool(value == neutral)
    except Exception:
        return False


def warn_unapplied(warn: WarnOnce, config: Any, do_sample: bool) -> None:
    """Say through ``warn`` (once per distinct set) which settings of ``config`` a
    request leaves out, with their values and the fix; nothing when none."""
    unapplied = unapplied_settings(config, do_sample)
    if not unapplied:
        return
    said = ", ".join(f"{name}={value!r}" for name, value in unapplied.items())
    warn(
        f"unapplied {said}",
        "GraphedGenerator: the model's generation_config sets %s, which this generator "
        "does not apply (it applies temperature, top_k, top_p, repetition_penalty, "
        "min_length, min_new_tokens and the stop and pad ids): its tokens can differ from "
        "model.generate()'s. Fix: unset "
        "them in model.generation_config (None), or generate with model.generate.",
        said,
    )
