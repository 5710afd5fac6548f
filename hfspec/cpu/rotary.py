"""A lean attention forward for the Llama and Qwen2 families on CPU, its rotary embedding in one kernel call.

transformers rotates q and k with ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``, where
``rotate_half`` slices, negates and concatenates, a dozen small torch ops per layer for q and k together. The kernel
(``hfspec/cpu/csrc/norm_rope.cpp``) computes the same products and sums, each rounded on its own as torch's ops do
(float32, or bfloat16 after each step), so q and k come out in the bits transformers computes, element for element,
whatever rows share the call.

:class:`LeanAttention` is the attention forward of transformers' ``LlamaAttention`` and ``Qwen2Attention``, step for
step (projections, rotary, the cache's public ``update``, the attention function the model is set to, ``o_proj``),
with the rotary on the kernel. :func:`use` switches a model's attention modules whose forward is exactly one of
those two (read from the source, with the modeling file's ``apply_rotary_pos_emb`` and ``rotate_half``) and
:func:`unuse` switches them back; a forward that differs in any statement keeps its own. Inputs the kernel does not
serve (other devices or dtypes, gradients) are rotated by the modeling file's own ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import sys

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hfspec.cpu import kernels
from hfspec.cpu.norms import body_of
from hfspec.cpu.swap import switch, switch_back

__all__ = ["LeanAttention", "bind", "rotary", "serves", "unuse", "use"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ENTRY = None  # the kernel's entry, bound by use()


def _unparsed(source: str) -> str:
    return "\n".join(ast.unparse(statement) for statement in ast.parse(source).body)


# The forwards LeanAttention reproduces (transformers' LlamaAttention and Qwen2Attention), and the rotary they call.
_LLAMA = _unparsed(
    """
input_shape = hidden_states.shape[:-1]
hidden_shape = (*input_shape, -1, self.head_dim)
query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
cos, sin = position_embeddings
query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
if cache is not None:
    key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
    self.config._attn_implementation, eager_attention_forward
)
attn_output, attn_weights = attention_interface(
    self,
    query_states,
    key_states,
    value_states,
    attention_mask,
    dropout=0.0 if not self.training else self.attention_dropout,
    scaling=self.scaling,
    **kwargs,
)
attn_output = attn_output.reshape(*input_shape, -1).contiguous()
attn_output = self.o_proj(attn_output)
return attn_output, attn_weights
"""
)
_QWEN2 = _LLAMA.replace(
    "scaling=self.scaling, **kwargs", "scaling=self.scaling, sliding_window=self.sliding_window, **kwargs"
)
_APPLY_ROTARY = _unparsed(
    """
cos = cos.unsqueeze(unsqueeze_dim)
sin = sin.unsqueeze(unsqueeze_dim)
q_embed = (q * cos) + (rotate_half(q) * sin)
k_embed = (k * cos) + (rotate_half(k) * sin)
return q_embed, k_embed
"""
)
_ROTATE_HALF = _unparsed(
    """
x1 = x[..., : x.shape[-1] // 2]
x2 = x[..., x.shape[-1] // 2 :]
return torch.cat((-x2, x1), dim=-1)
"""
)


@functools.cache
def _variant(kind: type) -> bool | None:
    """Whether ``kind``'s forward is Qwen2's (True) or Llama's (False) with the standard rotary; None if neither."""
    modeling = sys.modules.get(kind.__module__)
    rotary_fn = getattr(modeling, "apply_rotary_pos_emb", None)
    half = getattr(modeling, "rotate_half", None)
    if rotary_fn is None or half is None or not hasattr(modeling, "eager_attention_forward"):
        return None
    if body_of(rotary_fn) != _APPLY_ROTARY or body_of(half) != _ROTATE_HALF:
        return None
    return {_LLAMA: False, _QWEN2: True}.get(body_of(kind.forward))


def serves(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`rotary` computes this (else the modeling file's ``apply_rotary_pos_emb`` does)."""
    dtype = q.dtype
    return (
        _ENTRY is not None
        and dtype in _DTYPES
        and k.dtype == cos.dtype == sin.dtype == dtype
        and q.is_cpu
        and k.is_cpu
        and cos.is_cpu
        and sin.is_cpu
        and q.dim() == k.dim() == cos.dim() == 3
        and head_dim % 2 == 0
        and q.shape[:2] == k.shape[:2]
        and q.shape[-1] % head_dim == 0
        and k.shape[-1] % head_dim == 0
        and q.is_contiguous()
        and k.is_contiguous()
        and cos.shape[0] in (1, q.shape[0])
        and cos.shape[1:] == (q.shape[1], head_dim)
        and cos.stride(-1) == 1
        and sin.shape == cos.shape
        and sin.stride() == cos.stride()
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
    )


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` of the projections q (B, T, Hq * D) and k (B, T, Hk * D) with cos and sin
    (B or 1, T, D) on the kernel: q and k (B, H, T, D), views of new contiguous (B, T, H, D) tensors, as transformers
    lays them out. The caller checks :func:`serves`."""
    batch, tokens = q.shape[:2]
    q_out = torch.empty((batch, tokens, q.shape[-1] // head_dim, head_dim), dtype=q.dtype)
    k_out = torch.empty((batch, tokens, k.shape[-1] // head_dim, head_dim), dtype=k.dtype)
    _ENTRY(
        _DTYPES[q.dtype],
        q.data_ptr(),
        q.stride(1),
        k.data_ptr(),
        k.stride(1),
        q_out.data_ptr(),
        k_out.data_ptr(),
        batch,
        tokens,
        q_out.shape[2],
        k_out.shape[2],
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1),
    )
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


class LeanAttention(nn.Module):
    """``LlamaAttention``'s or ``Qwen2Attention``'s forward with the rotary on the kernel (its state kept). Made only
    by :func:`use`, which swaps the class of an existing module."""

    hfspec_original: type
    hfspec_sliding: bool  # Qwen2's forward: the attention function gets the layer's sliding window

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: object | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # the name transformers gives it for now, beside ``cache``
        modeling = sys.modules[self.hfspec_original.__module__]  # its own: apply_rotary_pos_emb, eager attention
        input_shape = hidden_states.shape[:-1]
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        if serves(query_states, key_states, cos, sin, self.head_dim):
            query_states, key_states = rotary(query_states, key_states, cos, sin, self.head_dim)
        else:
            query_states = query_states.view(*input_shape, -1, self.head_dim).transpose(1, 2)
            key_states = key_states.view(*input_shape, -1, self.head_dim).transpose(1, 2)
            query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling.eager_attention_forward
        )
        if self.hfspec_sliding:
            kwargs["sliding_window"] = self.sliding_window
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


def bind(library: kernels.KernelLibrary) -> None:
    """Bind the kernel entry of a loaded library (idempotent)."""
    global _ENTRY
    if _ENTRY is None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        _ENTRY = library.function(
            "hfspec_rope", [ctypes.c_int, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64]
        )


def use(model: nn.Module, library: kernels.KernelLibrary) -> int:
    """Switch ``model``'s Llama- and Qwen2-attention modules to :class:`LeanAttention`; how many run it now."""
    bind(library)

    def state(module: nn.Module) -> dict | None:
        sliding = _variant(type(module))
        if sliding is None:
            return None
        return {"hfspec_sliding": sliding}

    return switch(model, LeanAttention, state)


def unuse(model: nn.Module) -> int:
    """Switch ``model``'s attention modules back to their own classes; how many were switched."""
    return switch_back(model, LeanAttention)
