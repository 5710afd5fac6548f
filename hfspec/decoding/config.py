"""Generation settings: merged like ``transformers.generate`` and validated at the boundary.

Precedence, lowest first: the target's own ``generation_config``, the caller's
``generation_config=``, then explicit keyword arguments that are not ``None``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from transformers import GenerationConfig

from hfspec.errors import HfspecError, HfspecTypeError

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


def resolve(base: GenerationConfig | None, override: GenerationConfig | None, **kwargs: Any) -> GenerationConfig:
    """Merge the generation settings and validate them; returns a new config."""
    config = merge(merge(base, override), settings(**kwargs))
    if config.max_new_tokens is None and override is not None and override.max_length is not None:
        raise HfspecError("set max_new_tokens (hfspec counts new tokens only, not max_length)")
    if (
        config.temperature is not None
        and not isinstance(config.temperature, bool)
        and isinstance(config.temperature, (int, float))
        and config.temperature == 0
    ):
        # Temperature 0 means greedy decoding: the exact argmax path, not a tiny temperature.
        config.do_sample = False
    config.do_sample = bool(config.do_sample)
    validate(config)
    return config


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise HfspecTypeError(f"{name} must be {kind}, got {value!r}")
    if not integer and math.isnan(value):
        raise HfspecError(f"{name} is NaN; pass a real number")


def validate(config: GenerationConfig) -> None:
    """Raise ``ValueError``/``TypeError`` naming the bad setting and the fix."""
    if config.max_new_tokens is None:
        raise HfspecError("max_new_tokens is required: pass max_new_tokens=N (N >= 0)")
    _check_number("max_new_tokens", config.max_new_tokens, integer=True)
    if config.max_new_tokens < 0:
        raise HfspecError(f"max_new_tokens must be >= 0, got {config.max_new_tokens}")
    if config.temperature is not None:
        _check_number("temperature", config.temperature)
        if config.temperature < 0 or math.isinf(config.temperature):
            raise HfspecError(f"temperature must be a finite number >= 0 (0 means greedy), got {config.temperature}")
    if config.top_k is not None:
        _check_number("top_k", config.top_k, integer=True)
        if config.top_k < 0:
            raise HfspecError(f"top_k must be >= 0 (0 disables it), got {config.top_k}")
    if config.top_p is not None:
        _check_number("top_p", config.top_p)
        if not 0 < config.top_p <= 1:
            raise HfspecError(f"top_p must be in (0, 1], got {config.top_p}")
    if config.min_p is not None:
        _check_number("min_p", config.min_p)
        if not 0 <= config.min_p <= 1:
            raise HfspecError(f"min_p must be in [0, 1], got {config.min_p}")
    if config.repetition_penalty is not None:
        _check_number("repetition_penalty", config.repetition_penalty)
        if config.repetition_penalty <= 0:
            raise HfspecError(f"repetition_penalty must be > 0 (1.0 disables it), got {config.repetition_penalty}")
    if config.no_repeat_ngram_size is not None:
        _check_number("no_repeat_ngram_size", config.no_repeat_ngram_size, integer=True)
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise HfspecError(
                f"{name}={value!r} is not supported by speculative decoding in hfspec; "
                f"remove it (or use target.generate for it)"
            )


def eos_ids(config: GenerationConfig) -> list[int]:
    """The end-of-sequence ids as a list (transformers allows an int or a list)."""
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
