"""The gated MLP of the Llama family on CPU with its activation and product in one kernel call.

``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` runs the activation (:mod:`hfspec.cpu.activations`' kernel) and then
torch's product; ``hfspec_activation_mul`` (``hfspec/cpu/csrc/activation.cpp``) computes both in one pass, the
activation rounded to the dtype before the product as torch's two ops do, so the bits are those of the two calls.
:func:`use` switches a model's MLP modules whose forward is exactly that one (Llama, Qwen2, Mistral and the models that
copy it; read from the source) and whose activation runs the kernel, :func:`unuse` switches them back.
"""

from __future__ import annotations

import ast
import ctypes
import functools

import torch
from torch import nn

from hfspec.cpu import kernels
from hfspec.cpu.activations import InvariantActivation
from hfspec.cpu.norms import body_of
from hfspec.cpu.swap import switch, switch_back

__all__ = ["GatedMLP", "activation_mul", "bind", "unuse", "use"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ENTRY = None  # the kernel's entry, bound by use()
# LlamaMLP.forward: the computation GatedMLP reproduces.
_LLAMA = "\n".join(
    ast.unparse(statement)
    for statement in ast.parse(
        "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\nreturn down_proj"
    ).body
)


@functools.cache
def _llama_forward(kind: type) -> bool:
    return body_of(kind.forward) == _LLAMA


def activation_mul(kind: int, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``activation(x) * u`` (same shape, float32 or bfloat16 alike, on CPU) on the kernel: a new contiguous tensor."""
    x, u = x.contiguous(), u.contiguous()
    out = torch.empty_like(x)
    _ENTRY(kind, _DTYPES[x.dtype], x.data_ptr(), u.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads())
    return out


class GatedMLP(nn.Module):
    """A Llama-like MLP switched to the fused activation and product (its state kept). Made only by :func:`use`."""

    hfspec_original: type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, act = self.gate_proj(x), self.up_proj(x), self.act_fn
        if (
            _ENTRY is None
            or type(act) is not InvariantActivation
            or gate.dtype not in _DTYPES
            or up.dtype != gate.dtype
            or gate.shape != up.shape
            or not (gate.is_cpu and up.is_cpu)
            or (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
        ):
            return self.down_proj(act(gate) * up)
        return self.down_proj(activation_mul(act.hfspec_kind, gate, up))


def bind(library: kernels.KernelLibrary) -> None:
    """Bind the kernel entry of a loaded library (idempotent)."""
    global _ENTRY
    if _ENTRY is None:
        ptr = ctypes.c_void_p
        _ENTRY = library.function(
            "hfspec_activation_mul", [ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int64, ctypes.c_int]
        )


def use(model: nn.Module, library: kernels.KernelLibrary) -> int:
    """Switch ``model``'s Llama-like MLPs whose activation runs the kernel to :class:`GatedMLP`; how many run it now."""
    bind(library)

    def state(module: nn.Module) -> dict | None:
        fused = type(getattr(module, "act_fn", None)) is InvariantActivation and _llama_forward(type(module))
        return {} if fused else None

    return switch(model, GatedMLP, state)


def unuse(model: nn.Module) -> int:
    """Switch ``model``'s MLPs back to their own classes; how many were switched."""
    return switch_back(model, GatedMLP)
