"""Attention on CPU that gives a query row the same bits however many rows share the forward.

Greedy speculative decoding equals the target's own ``generate()`` only if the target scores a token the same
whether it runs alone (a decoding step), among the γ + 1 of a verification, the N + 1 of a tree, the T of a
prefill, or beside padding in a ragged batch. transformers' ``sdpa`` attention reaches torch's CPU kernels by
three paths (a prefill with ``is_causal`` and no mask, a decoding step without a mask, a verification with a 4-D
mask and the keys copied per query head by ``repeat_kv``), and torch picks its blocks, its GEMMs and where its
vector tails fall from the shapes: the same row comes out in other bits, which in bfloat16 flips near-ties.

:func:`attention` is one kernel for all of them (``hfspec/cpu/csrc/attention.cpp``): per query row, the keys it
sees are reduced in one fixed order that depends on those keys alone (masked keys are skipped, not weighted by
zero, and so is a key whose weight is exactly 0, such as one an additive mask hides with -1e9), grouped key/value heads are read in place (no ``repeat_kv`` copy), float32 or bfloat16 in, float32
arithmetic. It takes boolean or additive masks (causal, trees, padding, sliding windows: they come in the mask),
``is_causal`` without a mask, soft-capping (Gemma-2) and position biases (folded into the mask, as transformers
does). A row that sees no key gets zeros.

It is registered with transformers as ``IMPLEMENTATION`` (with sdpa's boolean masks) for models that ran
``sdpa``, and as ``EAGER`` (with eager's additive masks) for models that ran ``eager``; :func:`use` switches a
model to it once the kernel library is loaded (:func:`hfspec.cpu.fast.accelerate` does) and :func:`unuse` switches
it back. What the kernel does not serve keeps the model's own attention, and then carries no promise of
invariance: tensors off the CPU or in other dtypes, dropout (training), ``output_attentions``, attention sinks
(``s_aux``), gradients.
"""

from __future__ import annotations

import array
import ctypes
import sys

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import create_position_bias_mask, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from hfspec.cpu import kernels

__all__ = [
    "EAGER",
    "IMPLEMENTATION",
    "attention",
    "bind",
    "eager_attention",
    "sdpa_attention",
    "serves",
    "unuse",
    "use",
]

IMPLEMENTATION = "hfspec_sdpa"
EAGER = "hfspec_eager"
_ORIGINAL = {IMPLEMENTATION: "sdpa", EAGER: "eager"}

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MASKS = {torch.bool: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
_ARGTYPES = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_float,
    ctypes.c_float,
    ctypes.c_int,
    ctypes.c_int,
]
# The kernel's entry, bound by bind() (use() binds it): looked up once, not on every layer of every forward.
_ENTRY = None


def bind(library: kernels.KernelLibrary) -> None:
    """Bind the attention entry of a loaded kernel library (idempotent)."""
    global _ENTRY
    if _ENTRY is None:
        _ENTRY = library.function("hfspec_attention", _ARGTYPES)


def serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel computes this attention (else the model's own function does)."""
    dtype = query.dtype
    return (
        _ENTRY is not None
        and dtype in _DTYPES
        and key.dtype == dtype
        and value.dtype == dtype
        and query.is_cpu
        and key.is_cpu
        and value.is_cpu
        and query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and query.shape[0] == key.shape[0] == value.shape[0]
        and key.shape[1:3] == value.shape[1:3]
        and query.shape[1] % key.shape[1] == 0
        and query.shape[-1] == key.shape[-1]
        and (mask is None or (mask.is_cpu and mask.dtype in _MASKS and mask.dim() <= 4))
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
    )


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Attention of query (B, H, Q, D) over key (B, Hkv, L, D) and value (B, Hkv, L, Dv) on the kernel: (B, Q, H, Dv),
    contiguous, in the query's dtype. ``mask`` is boolean (True: seen) or additive, broadcastable to (B, H, Q, L);
    ``is_causal``: query i sees keys 0..i (torch's upper-left alignment). The caller checks :func:`serves`."""
    batch, heads, rows, dim = query.shape
    kv_heads, length, dv = key.shape[1], key.shape[2], value.shape[-1]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty((batch, rows, heads, dv), dtype=query.dtype)
    mask, mask_strides = broadcast_mask(mask, batch, heads, rows, length)
    sizes = array.array(
        "q",
        (
            *query.stride()[:3],
            *key.stride()[:3],
            *value.stride()[:3],
            rows * heads * dv,
            dv,
            heads * dv,
            *mask_strides,
            batch,
            heads,
            kv_heads,
            rows,
            length,
            dim,
            dv,
        ),
    )
    _ENTRY(
        _DTYPES[query.dtype],
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        out.data_ptr(),
        None if mask is None else mask.data_ptr(),
        0 if mask is None else _MASKS[mask.dtype],
        sizes.buffer_info()[0],
        dim**-0.5 if scale is None else scale,
        softcap or 0.0,
        int(is_causal),
        torch.get_num_threads(),
    )
    return out


def broadcast_mask(
    mask: torch.Tensor | None, batch: int, heads: int, rows: int, length: int
) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """``mask`` cut to ``length`` keys and broadcast to (batch, heads, rows, length), with its element strides as the
    kernel takes them (zeros for no mask); ``expand``'s RuntimeError where it does not broadcast."""
    if mask is None:
        return None, (0, 0, 0, 0)
    if mask.shape[-1] > length:
        mask = mask[..., :length]
    mask = mask.expand(batch, heads, rows, length)
    return mask, mask.stride()


def causal(rows: int, mask: torch.Tensor | None, module_causal: bool) -> bool:
    """transformers' sdpa ``is_causal`` rule: several query rows, no mask, and a causal module."""
    return bool(rows > 1 and mask is None and module_causal)


def mask_kind(mask: torch.Tensor) -> int | None:
    """The kernel's code for ``mask``'s dtype (boolean or additive), or None where it reads no such mask."""
    return _MASKS.get(mask.dtype)


def _served(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict,
) -> bool:
    return (
        not dropout
        and not kwargs.get("output_attentions")
        and kwargs.get("s_aux") is None
        and serves(query, key, value, attention_mask)
    )


def sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (its ``is_causal`` rule and position biases) computed by :func:`attention`."""
    if not _served(module, query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = causal(query.shape[2], attention_mask, is_causal)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        if is_causal:
            key, value, position_bias = (
                key[:, :, : query.shape[2]],
                value[:, :, : query.shape[2]],
                position_bias[..., : query.shape[2]],
            )
        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    return attention(
        query, key, value, attention_mask, scale=scaling, softcap=kwargs.get("softcap"), is_causal=is_causal
    ), None


def _eager_of(module: nn.Module):
    """The eager attention function of ``module``'s own modeling file (the fallback of :func:`eager_attention`)."""
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:
        raise NotImplementedError(
            f"{type(module).__name__} has no eager_attention_forward to fall back to; "
            "run it with hfspec.fast.restore(model)"
        )
    return found


def eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A model's eager attention (additive mask, soft-capping) computed by :func:`attention`."""
    if not _served(module, query, key, value, attention_mask, dropout, kwargs):
        return _eager_of(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs
        )
    scale = scaling if scaling is not None else getattr(module, "head_dim", query.shape[-1]) ** -0.5
    return attention(query, key, value, attention_mask, scale=scale, softcap=softcap), None


AttentionInterface.register(IMPLEMENTATION, sdpa_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
AttentionInterface.register(EAGER, eager_attention)
AttentionMaskInterface.register(EAGER, eager_mask)


def use(model: nn.Module, library: kernels.KernelLibrary) -> bool:
    """Switch ``model`` from ``sdpa`` or ``eager`` to the kernel's attention; whether it was switched (other
    implementations, and models without transformers' attention interface, are left as they are)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    target = {original: ours for ours, original in _ORIGINAL.items()}.get(current)
    if target is None or not hasattr(model, "set_attn_implementation"):
        return current in _ORIGINAL
    bind(library)
    try:
        model.set_attn_implementation(target)
    except (ValueError, ImportError, NotImplementedError):
        return False
    return getattr(config, "_attn_implementation", None) == target


def unuse(model: nn.Module) -> bool:
    """Switch ``model`` back to ``sdpa`` or ``eager`` if :func:`use` switched it; whether it did."""
    config = getattr(model, "config", None)
    original = _ORIGINAL.get(getattr(config, "_attn_implementation", None))
    if original is None:
        return False
    model.set_attn_implementation(original)
    return True
