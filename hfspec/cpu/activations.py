"""Activations on CPU that give an element the same bits wherever it falls in the tensor.

torch's SiLU and GELU kernels compute most elements in a vector body (Sleef) and the remainder of each thread's
chunk in a scalar loop (libm); the two differ in the last bit for a few percent of inputs, and which elements take
the remainder depends on the tensor's size, so on how many rows share the forward. A token's MLP then comes out in
other bits in a decoding step than in a verification or a prefill. ``hfspec/cpu/csrc/activation.cpp`` computes
every element with the same vector code; :func:`use` switches a model's activation modules (transformers'
``ACT2FN`` classes and torch's ``nn.SiLU``/``nn.GELU``) to it, :func:`unuse` switches them back.

Activations built only from operations that are the same bits on both paths (``gelu_new``, ``gelu_fast``: tanh,
powers, products; ReLU) are invariant as they are and left alone; others (and activations a model calls as
functions inside its forward rather than as modules) keep torch's kernels.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn
from transformers import activations as hf

from hfspec.cpu import kernels

__all__ = ["InvariantActivation", "kind_of", "unuse", "use"]

SILU, QUICK_GELU, GELU_TANH, GELU_ERF = range(4)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ENTRY = None  # the kernel's entry, bound by use()


def kind_of(module: nn.Module) -> int | None:
    """Which of the kernel's activations ``module`` computes, or None (left as it is)."""
    kind = type(module)
    if kind in (nn.SiLU, hf.SiLUActivation):
        return SILU
    if kind is hf.QuickGELUActivation:
        return QUICK_GELU
    if kind is hf.GELUTanh:
        return GELU_TANH
    if kind is hf.GELUActivation:
        return GELU_ERF
    if kind is nn.GELU:
        return GELU_TANH if module.approximate == "tanh" else GELU_ERF
    return None


class InvariantActivation(nn.Module):
    """An activation module switched to the kernel (its state kept); other devices, dtypes and autograd run the
    module's own forward. Made only by :func:`use`, which swaps the class of an existing module."""

    hfspec_kind: int
    hfspec_original: type

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (
            _ENTRY is None
            or not input.is_cpu
            or input.dtype not in _DTYPES
            or (torch.is_grad_enabled() and input.requires_grad)
        ):
            return self.hfspec_original.forward(self, input)
        x = input.contiguous()
        out = torch.empty_like(x)
        _ENTRY(self.hfspec_kind, _DTYPES[x.dtype], x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads())
        return out


def _bind(library: kernels.KernelLibrary) -> None:
    global _ENTRY
    if _ENTRY is None:
        _ENTRY = library.function(
            "hfspec_activation",
            [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
        )


def use(model: nn.Module, library: kernels.KernelLibrary) -> int:
    """Switch ``model``'s activation modules that the kernel computes to it; how many run it now."""
    _bind(library)
    count = 0
    for module in model.modules():
        kind = kind_of(module)
        if kind is None:
            count += type(module) is InvariantActivation  # switched before
            continue
        module.__dict__.update(hfspec_kind=kind, hfspec_original=type(module))
        module.__class__ = InvariantActivation
        count += 1
    return count


def unuse(model: nn.Module) -> int:
    """Switch ``model``'s activations back to their own classes; how many were switched."""
    count = 0
    for module in model.modules():
        if type(module) is InvariantActivation:
            module.__class__ = module.__dict__.pop("hfspec_original")
            module.__dict__.pop("hfspec_kind", None)
            count += 1
    return count
