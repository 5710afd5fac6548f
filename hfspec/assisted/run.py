"""hfspec behind transformers' ``model.generate``: the ``custom_generate`` folder's function and the callable form.

``model.generate(**inputs, assistant_model=draft, custom_generate=hfspec.CUSTOM_GENERATE, trust_remote_code=True)``
makes transformers load ``custom_generate/generate.py`` from the folder ``CUSTOM_GENERATE`` names (this package's
folder) and hand it every argument of the call; that file runs ``generate`` below. The callable form,
``custom_generate=hfspec.custom_generate(draft)``, is called by transformers after its own preparation, with the
arguments of its decoding loops (``GenerationMixin._sample``); transformers keeps ``assistant_model`` and
``streamer`` from it, so the draft is given to ``custom_generate`` and streaming needs the folder.
Both return what transformers returns: the sequences (B, prompt columns + new tokens), finished rows padded with
pad_token_id, or with ``return_dict_in_generate=True`` an output with ``.sequences`` and hfspec's ``.stats``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hfspec.assisted import arguments, reuse
from hfspec.assisted.arguments import Draft
from hfspec.decoding import config as cfg
from hfspec.decoding.stats import Stats
from hfspec.policy import GammaPolicy

# The folder transformers reads ``custom_generate/generate.py`` from: pass it as custom_generate=.
CUSTOM_GENERATE = str(Path(__file__).resolve().parent)

# hfspec's own keywords, taken from the call beside transformers' (gamma: γ, "auto" or a policy; tree: a node
# budget, None or "auto"; seed or generator: the randomness of sampling).
OWN = ("gamma", "tree", "seed", "generator")


@dataclass
class SpeculativeOutput(GenerateDecoderOnlyOutput):
    """transformers' output of a decoder-only ``generate`` call, with hfspec's statistics of the call
    (acceptance, γ per step, each row's stop reason; ``hfspec.Stats``)."""

    stats: Stats | None = None


def generate(
    model: PreTrainedModel,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: list[LogitsProcessor] | None = None,
    stopping_criteria: list | None = None,
    prefix_allowed_tokens_fn: Any = None,
    synced_gpus: bool | None = None,
    assistant_model: Any = None,
    streamer: Any = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | SpeculativeOutput:
    """What ``custom_generate/generate.py`` runs: every argument of ``model.generate``, mapped onto
    ``SpeculativeGenerator.generate`` (``hfspec.assisted.arguments``); what hfspec cannot honour is refused."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}"
        )
    given = kwargs.pop("input_ids", None)
    if inputs is not None and given is not None:
        raise ValueError("pass the prompt once: as the first argument or as input_ids=, not both")
    ids = inputs if inputs is not None else given
    mask = kwargs.pop("attention_mask", None)
    tokenizer, assistant_tokenizer = kwargs.pop("tokenizer", None), kwargs.pop("assistant_tokenizer", None)
    own = {name: kwargs.pop(name, None) for name in OWN}
    arguments.refuse_call(
        stopping_criteria=stopping_criteria,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        synced_gpus=synced_gpus,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
    )
    default_length = (
        kwargs.get("max_length") is None
        and model.generation_config.max_length is None
        and (generation_config is None or generation_config.max_length is None)
    )
    # transformers' own merge, so that every setting means what it means in transformers' generate()
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    arguments.refuse_settings(config)
    arguments.refuse_model_kwargs(model_kwargs)
    ids, mask = arguments.prompts(ids, mask, config)
    repeats = config.num_return_sequences or 1  # as transformers does: each prompt's rows side by side
    ids, mask = ids.repeat_interleave(repeats, dim=0), mask.repeat_interleave(repeats, dim=0)
    draft = arguments.draft_for(assistant_model, config, tokenizer, assistant_tokenizer)
    custom = arguments.check_custom_processors(logits_processor, config)
    return _run(
        model,
        draft,
        ids,
        mask,
        config,
        arguments.new_tokens(config, ids.shape[1], default_length, model),
        custom,
        streamer,
        own,
    )


class SpeculativeDecoding:
    """The callable form of ``custom_generate``: ``model.generate(**inputs, custom_generate=hfspec.custom_generate(
    draft), ...)``. transformers calls it in place of its decoding loop, with the prompts, its merged generation
    config and the logits processors and stopping criteria it built from them; hfspec checks that it rebuilds the
    same ones and decodes. ``draft`` is what ``SpeculativeGenerator`` takes (None: n-gram lookup), ``draft_tokenizer``
    its tokenizer where it has another (with ``tokenizer=`` in the call or here)."""

    def __init__(
        self,
        draft: Any = None,
        *,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        gamma: int | str | GammaPolicy | None = None,
        tree: int | str | None = None,
    ):
        self.draft, self.draft_tokenizer, self.tokenizer = draft, draft_tokenizer, tokenizer
        self.gamma, self.tree = gamma, tree

    # transformers hands this the keywords of ``_sample`` and, from the call's own, those this signature adds.
    def __call__(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        logits_processor: list[LogitsProcessor],
        stopping_criteria: list,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        streamer: Any = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        gamma: int | str | GammaPolicy | None = None,
        tree: int | str | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor | SpeculativeOutput:
        arguments.refuse_call(
            stopping_criteria=None,
            prefix_allowed_tokens_fn=None,
            synced_gpus=synced_gpus,
            negative_prompt_ids=None,
            negative_prompt_attention_mask=None,
        )
        config = copy.copy(generation_config)
        config.num_return_sequences = 1  # transformers has repeated the prompts already
        arguments.refuse_settings(config)
        arguments.check_stopping(stopping_criteria)
        arguments.check_prepared(model_kwargs)
        custom = arguments.custom_processors(logits_processor, config)
        mask = model_kwargs.get("attention_mask")  # None: transformers saw no padding
        mask = torch.ones_like(input_ids) if mask is None else mask
        draft = arguments.draft_for(self.draft, config, tokenizer or self.tokenizer, self.draft_tokenizer)
        own = {
            "gamma": gamma if gamma is not None else self.gamma,
            "tree": tree if tree is not None else self.tree,
            "seed": seed,
            "generator": generator,
        }
        return _run(
            model, draft, input_ids, mask, config, config.max_length - input_ids.shape[1], custom, streamer, own
        )


def custom_generate(
    draft: Any = None,
    *,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    gamma: int | str | GammaPolicy | None = None,
    tree: int | str | None = None,
) -> SpeculativeDecoding:
    """The callable to pass as ``model.generate(..., custom_generate=...)``; see ``SpeculativeDecoding``."""
    return SpeculativeDecoding(draft, draft_tokenizer=draft_tokenizer, tokenizer=tokenizer, gamma=gamma, tree=tree)


def _run(
    model: PreTrainedModel,
    draft: Draft,
    ids: torch.Tensor,
    mask: torch.Tensor,
    config: GenerationConfig,
    max_new_tokens: int,
    custom: list[LogitsProcessor],
    streamer: Any,
    own: dict[str, Any],
) -> torch.Tensor | SpeculativeOutput:
    """Decode with the target's generator for this draft; the new tokens follow the prompt columns as given."""
    gen = reuse.generator_for(model, draft.draft, draft.tokenizer, draft.draft_tokenizer, draft.ngram)
    out = gen.generate(
        ids,
        mask,
        sampling_params=cfg.params(config, custom, max_new_tokens),  # the merged config: transformers' own merge
        gamma=arguments.gamma_for(own["gamma"], config),
        tree=own["tree"] if own["tree"] is not None else "auto",
        streamer=streamer,
        seed=own["seed"],
        generator=own["generator"],
    )
    sequences = torch.cat([ids, out.sequences[:, out.prompt_length :].to(ids.device, ids.dtype)], dim=1)
    return SpeculativeOutput(sequences=sequences, stats=out.stats) if config.return_dict_in_generate else sequences
