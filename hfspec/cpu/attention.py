"""Attention for verification forwards on CPU: grouped-query attention without copying the cache.

Verifying k drafts feeds k + 1 queries against the whole cache, with a 4-D mask (a chain's causal mask or a
tree's). With a mask, transformers' ``sdpa`` attention expands the keys and values of every grouped-query
layer to one head per query head (``repeat_kv``): a copy of the cache, in every layer, on every
verification (measured on SmolLM2-135M, 9 query heads on 3 key/value heads, 250 cached tokens: 3 ms of a
38 ms forward over 4 tokens, growing with the cache). torch's CPU attention reads grouped heads directly
(``enable_gqa``) with a mask too, so :func:`gqa_sdpa` passes them as they are; every other case (one
query, no mask, other devices, dropout, soft-capping, position biases) goes to transformers' own
``sdpa_attention_forward`` unchanged. The result is the same to the bit (tests).

It is registered with transformers as ``IMPLEMENTATION``, with sdpa's mask function;
:func:`use` switches a model that runs ``sdpa`` to it and :func:`unuse` switches it back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["IMPLEMENTATION", "gqa_sdpa", "unuse", "use"]

IMPLEMENTATION = "hfspec_sdpa"


def gqa_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, with grouped key/value heads read in place for masked queries on CPU."""
    if (getattr(module, "num_key_value_groups", 1) == 1 or query.shape[2] == 1 or attention_mask is None
            or not query.is_cpu or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, gqa_sdpa)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def use(model: nn.Module) -> bool:
    """Switch ``model`` from ``sdpa`` to :func:`gqa_sdpa`; whether it was switched (other implementations,
    and models without transformers' attention interface, are left as they are)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    try:
        model.set_attn_implementation(IMPLEMENTATION)
    except (ValueError, ImportError, NotImplementedError):
        return False
    return getattr(config, "_attn_implementation", None) == IMPLEMENTATION


def unuse(model: nn.Module) -> bool:
    """Switch ``model`` back to ``sdpa`` if :func:`use` switched it; whether it did."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
        return False
    model.set_attn_implementation("sdpa")
    return True
