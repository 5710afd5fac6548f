"""What a ``model.generate(...)`` call asks of hfspec: transformers' arguments mapped onto ``SpeculativeGenerator``'s,
and every one hfspec cannot honour refused by name, with what to do instead.

Both hooks read one ``GenerationConfig`` merged as transformers merges it (the call's keywords over
``generation_config=`` over the model's own over transformers' defaults): the ``custom_generate`` folder merges it
here with the model's own ``_prepare_generation_config``, the callable form receives it merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    MinPLogitsWarper,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hfspec.decoding import config as cfg
from hfspec.errors import HfspecError
from hfspec.models.sources import NGRAM
from hfspec.policy import GammaPolicy, HeuristicGamma

ELSEWHERE = "remove it, or drop custom_generate= to run it with transformers' own generate()"
NO_STEP_OUTPUTS = (
    "hfspec scores drafts and the target in blocks and keeps nothing per step; remove it "
    "(with return_dict_in_generate=True the output's .stats holds the call's statistics)"
)
OWN_GAMMA = "remove it: hfspec chooses how many tokens to draft itself (gamma='auto'), or takes gamma=N"
DRAFTS = (
    "remove it and pass a draft model as assistant_model=, or prompt_lookup_num_tokens=N for lookup "
    "(or drop custom_generate= to run it with transformers)"
)

WARPER = "a sampling warper hfspec does not run"
PROCESSOR = "a logits processor hfspec does not build"
STOPS = "hfspec stops rows only at EOS and max_new_tokens"
RETOKENIZES = (
    "it tunes transformers' re-encoding for drafts with another tokenizer; hfspec re-tokenizes a window of its own"
)

# Settings hfspec cannot honour: name -> (values that leave it off, what it is, what to do). transformers' own
# default for the name also leaves it off (``explicit``).
REFUSED: dict[str, tuple[tuple[Any, ...], str, str]] = {
    "num_beams": (
        (None, 1),
        "beam search keeps several hypotheses per prompt; hfspec decodes one, greedily or sampled",
        "set num_beams=1, or drop custom_generate= to run transformers' beam search",
    ),
    "num_beam_groups": ((None, 1), "group beam search", ELSEWHERE),
    "diversity_penalty": ((None, 0.0), "group beam search", ELSEWHERE),
    "constraints": ((None,), "constrained beam search", ELSEWHERE),
    "force_words_ids": ((None,), "constrained beam search", ELSEWHERE),
    "penalty_alpha": ((None, 0.0), "contrastive search", ELSEWHERE),
    "dola_layers": ((None,), "DoLa decoding", ELSEWHERE),
    "guidance_scale": ((None, 1.0), "classifier-free guidance", ELSEWHERE),
    "typical_p": ((None, 1.0), WARPER, ELSEWHERE),
    "epsilon_cutoff": ((None, 0.0), WARPER, ELSEWHERE),
    "eta_cutoff": ((None, 0.0), WARPER, ELSEWHERE),
    "top_h": ((None,), WARPER, ELSEWHERE),
    "sequence_bias": ((None,), PROCESSOR, ELSEWHERE),
    "forced_bos_token_id": ((None,), PROCESSOR, ELSEWHERE),
    "forced_eos_token_id": ((None,), PROCESSOR, ELSEWHERE),
    "begin_suppress_tokens": ((None,), PROCESSOR, ELSEWHERE),
    "exponential_decay_length_penalty": ((None,), PROCESSOR, ELSEWHERE),
    "remove_invalid_values": (
        (None, False),
        f"{PROCESSOR} (hfspec raises NumericalFault on NaN or infinite logits)",
        ELSEWHERE,
    ),
    "watermarking_config": ((None,), "a watermarking processor hfspec does not build", ELSEWHERE),
    "encoder_repetition_penalty": ((None, 1.0), "a setting of encoder-decoder models", ELSEWHERE),
    "encoder_no_repeat_ngram_size": ((None, 0), "a setting of encoder-decoder models", ELSEWHERE),
    "min_length": ((None, 0), STOPS, ELSEWHERE),
    "min_new_tokens": ((None, 0), STOPS, ELSEWHERE),
    "stop_strings": ((None,), STOPS, "remove it, or pass the stop strings' token ids as eos_token_id=[...]"),
    "max_time": ((None,), STOPS, ELSEWHERE),
    "token_healing": ((None, False), "token healing rewrites the prompt's last token", ELSEWHERE),
    "output_scores": ((None, False), "per-step scores", NO_STEP_OUTPUTS),
    "output_logits": ((None, False), "per-step logits", NO_STEP_OUTPUTS),
    "output_attentions": ((None, False), "per-step attentions", NO_STEP_OUTPUTS),
    "output_hidden_states": ((None, False), "per-step hidden states", NO_STEP_OUTPUTS),
    "use_mtp": ((None, False), "multi-token prediction is not a draft hfspec runs", DRAFTS),
    "assistant_early_exit": ((None,), "early-exit self-speculation is not a draft hfspec runs", DRAFTS),
    "speculation_type": ((None,), "this kind of speculation is not a draft hfspec runs", DRAFTS),
    "assistant_confidence_threshold": (
        (None,),
        (
            "it tunes transformers' own drafting; with gamma='auto' hfspec stops "
            "drafting early by its own calibrated rule"
        ),
        OWN_GAMMA,
    ),
    "max_matching_ngram_size": (
        (None,),
        ("it tunes transformers' prompt lookup; hfspec's lookup matches the longest suffix it finds"),
        "remove it",
    ),
    "assistant_lookbehind": ((None,), RETOKENIZES, "remove it"),
    "target_lookbehind": ((None,), RETOKENIZES, "remove it"),
}

# Model keyword arguments the callable form receives from transformers' own preparation; hfspec prefills from the
# prompt and keeps its own caches, positions and logits, so these are dropped once checked (``check_prepared``).
PREPARED = ("position_ids", "logits_to_keep", "use_cache", "cache", "past_key_values", "cache_position")

# transformers' schedules of num_assistant_tokens, as hfspec policies (``gamma_for``).
HEURISTIC = ("heuristic", "heuristic_transient")


@dataclass(frozen=True)
class Draft:
    """What drafts: ``draft`` as ``SpeculativeGenerator`` takes it (a model, ``"ngram"``, a Drafter, a path),
    with n-gram lookup added (``ngram``), and the tokenizers."""

    draft: Any
    ngram: bool
    tokenizer: PreTrainedTokenizerBase | None
    draft_tokenizer: PreTrainedTokenizerBase | None


def _defaults() -> dict[str, Any]:
    """transformers' value of every generation setting nobody set (5.x fills unset fields from these)."""
    filler = getattr(GenerationConfig, "_get_default_generation_params", None)
    return GenerationConfig().to_dict() | (filler() if filler is not None else {})


DEFAULTS = _defaults()


def explicit(config: GenerationConfig, name: str) -> Any:
    """``config``'s ``name``, or None where it is transformers' default (nobody asked for it)."""
    value = getattr(config, name, None)
    return None if value is None or value == DEFAULTS.get(name) else value


def refuse_settings(config: GenerationConfig) -> None:
    """Raise ``HfspecError`` naming the first setting of the merged ``config`` that hfspec cannot honour."""
    for name, (off, what, fix) in REFUSED.items():
        value = getattr(config, name, None)
        if value not in off and explicit(config, name) is not None:
            raise HfspecError(f"{name}={value!r} cannot run under hfspec's speculative decoding ({what}); {fix}")


def refuse_call(
    *,
    stopping_criteria: Sequence[Any] | None,
    prefix_allowed_tokens_fn: Any,
    synced_gpus: bool | None,
    negative_prompt_ids: Any,
    negative_prompt_attention_mask: Any,
) -> None:
    """Raise ``HfspecError`` for the arguments of ``generate()`` itself that hfspec cannot honour."""
    if stopping_criteria:
        names = ", ".join(type(c).__name__ for c in stopping_criteria)
        raise HfspecError(
            f"stopping_criteria ({names}) cannot run under hfspec, which stops rows only at EOS and "
            f"max_new_tokens; {ELSEWHERE}"
        )
    if prefix_allowed_tokens_fn is not None:
        raise HfspecError(f"prefix_allowed_tokens_fn (constrained generation) cannot run under hfspec; {ELSEWHERE}")
    if synced_gpus:
        raise HfspecError(f"synced_gpus=True cannot run under hfspec, whose rows finish at their own pace; {ELSEWHERE}")
    if negative_prompt_ids is not None or negative_prompt_attention_mask is not None:
        raise HfspecError(f"negative_prompt_ids (classifier-free guidance) cannot run under hfspec; {ELSEWHERE}")


def refuse_model_kwargs(model_kwargs: dict[str, Any], ignore: Sequence[str] = ()) -> None:
    """Raise ``HfspecError`` for keyword arguments that would have gone to the model's forward: hfspec drives the
    forwards itself (``ignore``: ones transformers prepared itself, checked elsewhere)."""
    for name, value in model_kwargs.items():
        if value is None or name in ignore:
            continue
        if name == "inputs_embeds":
            raise HfspecError(
                "inputs_embeds cannot run under hfspec, which drafts and verifies token ids; pass input_ids"
            )
        if name in ("past_key_values", "cache"):
            raise HfspecError(
                f"{name} cannot run under hfspec, which prefills its own caches from the prompt; "
                "remove it and pass the whole prompt as input_ids"
            )
        raise HfspecError(
            f"{name}= is neither a generation setting nor an argument hfspec takes; it would go to the "
            f"model's forward, which hfspec drives itself: {ELSEWHERE}"
        )


def check_prepared(model_kwargs: dict[str, Any]) -> None:
    """The callable form: what transformers prepared must be what hfspec rebuilds (an empty cache), and nothing
    else may be meant for the model's forward."""
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise HfspecError(
                f"{name} holds {cache.get_seq_length()} cached tokens; hfspec prefills its own caches "
                "from the prompt: remove it and pass the whole prompt as input_ids"
            )
    refuse_model_kwargs(model_kwargs, ignore=PREPARED + ("attention_mask",))


def prompts(input_ids: Any, attention_mask: Any, config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, T) prompt ids as given (the returned sequences start with them) and their mask, inferred from the
    padding where none is given, as transformers infers it; no prompt starts from the BOS token."""
    if input_ids is None:
        if config.bos_token_id is None:
            raise ValueError("no input_ids and no bos_token_id to start from: pass input_ids")
        input_ids = torch.tensor([[int(config.bos_token_id)]])
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise TypeError(
            "input_ids must be a (batch, length) tensor of token ids, as tokenizer(..., return_tensors='pt') returns it"
        )
    if attention_mask is None:
        attention_mask = inferred_mask(input_ids, config)
    return input_ids, attention_mask


def inferred_mask(input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """transformers' rule: the padding is masked where the pad token occurs and is not an EOS token."""
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return torch.ones_like(input_ids)
    return (input_ids != pad).long()


def new_tokens(config: GenerationConfig, width: int, default_length: bool, model: PreTrainedModel) -> int:
    """max_new_tokens as transformers counts it: max_new_tokens, else max_length less the (padded) prompt width,
    else transformers' default of max_length new tokens, cut at the model's position embeddings."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    if default_length:
        limit = getattr(model.config, "max_position_embeddings", None)
        total = config.max_length + width
        return (min(total, limit) if limit is not None else total) - width
    if config.max_length <= width:
        raise ValueError(
            f"max_length={config.max_length} leaves no room after the prompt ({width} columns); "
            "pass max_new_tokens=N instead"
        )
    return config.max_length - width


def draft_for(
    assistant_model: Any,
    config: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    assistant_tokenizer: PreTrainedTokenizerBase | None,
) -> Draft:
    """``assistant_model`` drafts (with lookup added under ``prompt_lookup_num_tokens``); without one, n-gram
    lookup in the prompt and earlier outputs does, the one draft the target alone allows; with
    ``gamma="auto"`` it decodes plainly wherever lookup does not pay, so it never costs much more than plain
    decoding and is exact either way. ``assistant_tokenizer`` means a draft with another tokenizer."""
    if assistant_tokenizer is not None:
        if assistant_model is None:
            raise HfspecError(
                "assistant_tokenizer is the tokenizer of assistant_model: pass the draft model as "
                "assistant_model=, or drop assistant_tokenizer"
            )
        if tokenizer is None:
            raise HfspecError(
                "a draft with another tokenizer needs both: pass the target's tokenizer as tokenizer= "
                "beside assistant_tokenizer="
            )
    lookup = lookup_tokens(config)
    if assistant_model is None:
        return Draft(NGRAM, False, tokenizer, None)
    return Draft(assistant_model, lookup is not None, tokenizer, assistant_tokenizer)


def lookup_tokens(config: GenerationConfig) -> int | None:
    """``prompt_lookup_num_tokens``, checked: the most lookup drafts per step, or None."""
    value = config.prompt_lookup_num_tokens
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"prompt_lookup_num_tokens must be a positive integer, got {value!r}")
    return value


def gamma_for(gamma: int | str | GammaPolicy | None, config: GenerationConfig) -> int | str | GammaPolicy:
    """γ: hfspec's ``gamma=`` if given; else transformers' count of drafts per step, fixed as transformers keeps it
    (``prompt_lookup_num_tokens``, ``num_assistant_tokens``) or moved by its heuristic schedule; else ``"auto"``."""
    if gamma is not None:
        return gamma
    lookup = lookup_tokens(config)
    if lookup is not None:
        return lookup
    count = explicit(config, "num_assistant_tokens")
    schedule = explicit(config, "num_assistant_tokens_schedule")
    if schedule is not None and schedule not in HEURISTIC:
        raise HfspecError(
            f"num_assistant_tokens_schedule={schedule!r} is not one hfspec knows; use 'constant' "
            f"or 'heuristic', or remove it ({OWN_GAMMA})"
        )
    if schedule is not None:
        start = count if count is not None else DEFAULTS.get("num_assistant_tokens") or 5
        return HeuristicGamma(value=min(start, HeuristicGamma.maximum))
    return count if count is not None else "auto"


def custom_processors(prepared: Sequence[LogitsProcessor], config: GenerationConfig) -> list[LogitsProcessor]:
    """The callable form: transformers' prepared processors are the ones hfspec builds from ``config`` with the
    caller's own ``logits_processor`` between the penalties and the warpers, as both place them; returns the
    caller's, or raises naming what hfspec would not run the same way."""
    prepared = [p for p in prepared if type(p).__name__ != "LogitNormalization"]  # log-softmax: same tokens
    head, tail = _head(config), _warpers(config)
    ends_match = (
        len(prepared) >= len(head) + len(tail)
        and all(map(_same, prepared[: len(head)], head))
        and all(map(_same, prepared[len(prepared) - len(tail) :], tail))
    )
    if not ends_match:
        names = ", ".join(type(p).__name__ for p in prepared)
        raise HfspecError(
            f"the logits processors transformers prepared ({names}) are not the ones hfspec builds "
            "from the generation config, with yours between the penalties and the warpers (a custom "
            "processor replacing one of them, or a processor hfspec does not build); use "
            "custom_generate=hfspec.CUSTOM_GENERATE, which takes logits_processor= as it is"
        )
    return prepared[len(head) : len(prepared) - len(tail)]


def _head(config: GenerationConfig) -> list[LogitsProcessor]:
    """The processors hfspec runs from ``config`` before the warpers (``SamplingParams.processors``)."""
    return list(cfg.params(config, max_new_tokens=0).processors())


def _warpers(config: GenerationConfig) -> list[LogitsProcessor]:
    """The warpers transformers prepares from ``config`` when it samples, which hfspec runs as
    ``SamplingParams.warpers()``: transformers' objects, to compare with the ones it prepared."""
    params = cfg.params(config, max_new_tokens=0)
    if params.greedy:
        return []
    warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
    return warpers + ([MinPLogitsWarper(params.min_p)] if config.min_p is not None else [])


def _same(a: LogitsProcessor, b: LogitsProcessor) -> bool:
    """The same processor with the same settings. transformers' repetition penalty skips each row's left padding
    (``prompt_ignore_length``); hfspec's rows hold no padding, so that setting is left out."""
    if type(a) is not type(b):
        return False
    left, right = vars(a), vars(b)
    names = (left.keys() | right.keys()) - {"prompt_ignore_length"}
    return all(_equal(left.get(n), right.get(n)) for n in names)


def _equal(x: Any, y: Any) -> bool:
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape and torch.equal(x.cpu(), y.cpu())
    try:
        return bool(x == y)
    except (RuntimeError, TypeError, ValueError):
        return False


def check_stopping(criteria: Sequence[Any]) -> None:
    """The callable form: transformers' prepared stopping criteria must be the ones hfspec applies itself
    (max_new_tokens, EOS)."""
    other = [type(c).__name__ for c in criteria if type(c).__name__ not in ("MaxLengthCriteria", "EosTokenCriteria")]
    if other:
        raise HfspecError(
            f"stopping criteria {', '.join(other)} cannot run under hfspec, which stops rows only at "
            f"EOS and max_new_tokens; {ELSEWHERE}"
        )


def check_custom_processors(custom: Sequence[LogitsProcessor] | None, config: GenerationConfig) -> list:
    """The folder form: a custom processor of a kind the settings build before the warpers replaces that one in
    transformers, while hfspec would run both; refused. (A custom warper runs before the settings' own in both.)"""
    custom = list(custom or [])
    built = {type(p) for p in _head(config)}
    clash = [type(p).__name__ for p in custom if type(p) in built]
    if clash:
        raise HfspecError(
            f"logits_processor holds {', '.join(clash)}, which the generation settings build too "
            "(transformers would use yours instead, hfspec would apply both); remove the setting or "
            "the processor"
        )
    return custom
