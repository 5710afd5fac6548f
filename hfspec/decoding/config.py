"""Generation settings from ``transformers.GenerationConfig``: merged like ``transformers.generate``, then turned
into the one ``hfspec.settings.SamplingParams`` a call runs with (validated there, once).

Precedence, lowest first: the target's own ``generation_config``, the caller's
``generation_config=``, then explicit keyword arguments that are not ``None``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from transformers import GenerationConfig, LogitsProcessor

from hfspec.errors import HfspecError, HfspecTypeError
from hfspec.settings import SamplingParams

# Keyword arguments of SpeculativeGenerator.generate that map onto GenerationConfig fields.
SAMPLING_FIELDS = (
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "suppress_tokens",
    "eos_token_id",
    "pad_token_id",
)
# The GenerationConfig fields that are SamplingParams fields of the same name and meaning (the budget, greedy or not
# and the end-of-sequence and padding ids are resolved on their own).
_PARAMS = tuple(f for f in SAMPLING_FIELDS if f not in ("max_new_tokens", "do_sample", "eos_token_id", "pad_token_id"))

# GenerationConfig features that change the decoding algorithm itself; hfspec refuses them.
_UNSUPPORTED = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "guidance_scale": 1.0,
    "penalty_alpha": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "min_new_tokens": None,
    "min_length": None,
    "begin_suppress_tokens": None,
}


def settings(**kwargs: Any) -> GenerationConfig:
    """A config that sets only the ``kwargs`` that are not None (``SAMPLING_FIELDS``), as keyword arguments
    do: how the layers above hand their options down in one value. Validated where it is resolved."""
    config = GenerationConfig()
    for key, value in kwargs.items():
        if value is not None:
            setattr(config, key, value)
    return config


def merge(base: GenerationConfig | None, override: GenerationConfig | None) -> GenerationConfig:
    """A new config: ``base`` with every setting ``override`` sets (``to_diff_dict``) on top."""
    if override is not None and not isinstance(override, GenerationConfig):
        raise HfspecTypeError(
            f"generation_config must be a transformers.GenerationConfig, got {type(override).__name__}"
        )
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    if override is not None:
        for key, value in override.to_diff_dict().items():
            setattr(config, key, value)
    return config


def resolve(
    base: GenerationConfig | None,
    override: GenerationConfig | None,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    **kwargs: Any,
) -> tuple[GenerationConfig, SamplingParams]:
    """Merge the generation settings (``kwargs``: ``SAMPLING_FIELDS``), refuse those that change the decoding
    algorithm itself, and build the one ``SamplingParams`` the call runs with; returns the merged config too (for
    its special token ids)."""
    config = merge(merge(base, override), settings(**kwargs))
    if config.max_new_tokens is None and override is not None and override.max_length is not None:
        raise HfspecError("set max_new_tokens (hfspec counts new tokens only, not max_length)")
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise HfspecError(
                f"{name}={value!r} is not supported by speculative decoding in hfspec; "
                f"remove it (or use target.generate for it)"
            )
    return config, params(config, logits_processor)


def params(
    config: GenerationConfig,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    max_new_tokens: int | None = None,
) -> SamplingParams:
    """The ``SamplingParams`` of a merged ``config``, with the caller's own processors; a setting None leaves off.
    Greedy (``temperature=0``) unless ``do_sample`` and a temperature other than 0; the sampling settings are
    validated either way. ``max_new_tokens``, if
    given, is the count the caller derived (transformers' ``max_length`` less the prompt)."""
    if max_new_tokens is None:
        max_new_tokens = config.max_new_tokens
    if max_new_tokens is None:
        raise HfspecError("max_new_tokens is required: pass max_new_tokens=N (N >= 0)")
    given = {name: getattr(config, name) for name in _PARAMS if getattr(config, name, None) is not None}
    built = SamplingParams(
        **given,
        logits_processor=tuple(logits_processor or ()),
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(eos_ids(config)),
        pad_token_id=config.pad_token_id,
    )
    return built if config.do_sample and not built.greedy else dataclasses.replace(built, temperature=0)


def eos_ids(config: GenerationConfig) -> list[int]:
    """The end-of-sequence ids as a list (transformers allows an int or a list)."""
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
