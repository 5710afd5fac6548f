"""RMSNorm on CPU in one kernel call per norm, every row on its own (``hfspec/cpu/csrc/norm_rope.cpp``).

A Llama-family norm is nine small torch ops (a cast, pow, mean, add, rsqrt, two products, a cast back) that cost more
than their arithmetic on a one-token forward; the kernel computes the same steps in one pass per row: the float32
sum of squares in one fixed order, one over the square root of its mean plus eps, each element times that rounded to
the input's dtype, times the weight. A row's bits depend on that row alone, so a token's norm is the same in a
decoding step, a verification or a prefill. The bits may differ from torch's in the last place (torch sums the squares
in another order), as the other kernels' do: an accelerated model is consistent with itself.

:func:`use` switches a model's norm modules whose forward is exactly transformers' ``LlamaRMSNorm`` one (Llama, Qwen2,
Mistral and the many models that copy it; :func:`computes_llama_rmsnorm` reads the forward's source) to
:class:`FusedRMSNorm`, :func:`unuse` switches them back. Other devices, dtypes and autograd run the module's own
forward.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
import textwrap

import torch
from torch import nn

from hfspec.cpu import kernels
from hfspec.cpu.swap import switch, switch_back

__all__ = ["FusedRMSNorm", "bind", "body_of", "computes_llama_rmsnorm", "rmsnorm", "unuse", "use"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ENTRY = None  # the kernel's entry, bound by use()
# The body of LlamaRMSNorm.forward: the computation the kernel reproduces.
_LLAMA_BODY = """
input_dtype = hidden_states.dtype
hidden_states = hidden_states.to(torch.float32)
variance = hidden_states.pow(2).mean(-1, keepdim=True)
hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
return self.weight * hidden_states.to(input_dtype)
"""
_LLAMA = "\n".join(ast.unparse(statement) for statement in ast.parse(_LLAMA_BODY).body)


def body_of(function: object) -> str | None:
    """The statements of ``function``'s source as ``ast.unparse`` writes them (layout, comments and docstring aside),
    or None where there is no source to read (built in, compiled)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    statements = node.body
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]  # the docstring
    return "\n".join(ast.unparse(statement) for statement in statements)


@functools.cache
def _llama_forward(kind: type) -> bool:
    return body_of(kind.forward) == _LLAMA


def computes_llama_rmsnorm(module: nn.Module) -> bool:
    """Whether ``module``'s forward is ``LlamaRMSNorm``'s (read from its source) with a 1-D weight and an epsilon."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(getattr(module, "variance_epsilon", None), float)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and _llama_forward(type(module))
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm`` of ``x`` (..., n; float32 or bfloat16, unit stride along n) with ``weight`` (n; float32 or
    bfloat16) on the kernel: contiguous, bfloat16 if both are, else float32. The caller checks the dtypes and device."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.bfloat16 if x.dtype is weight.dtype is torch.bfloat16 else torch.float32
    out = torch.empty(x.shape, dtype=out_dtype)
    _ENTRY(
        _DTYPES[x.dtype],
        _DTYPES[weight.dtype],
        rows.data_ptr(),
        rows.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        n,
        eps,
        torch.get_num_threads(),
    )
    return out


class FusedRMSNorm(nn.Module):
    """A ``LlamaRMSNorm``-like module switched to the kernel (its state kept). Made only by :func:`use`, which swaps
    the class of an existing module."""

    hfspec_original: type

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            _ENTRY is None
            or not (hidden_states.is_cpu and w.is_cpu)
            or hidden_states.dtype not in _DTYPES
            or w.dtype not in _DTYPES
            or not w.is_contiguous()
            or (torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad))
        ):
            return self.hfspec_original.forward(self, hidden_states)
        return rmsnorm(hidden_states, w, self.variance_epsilon)


def bind(library: kernels.KernelLibrary) -> None:
    """Bind the kernel entry of a loaded library (idempotent)."""
    global _ENTRY
    if _ENTRY is None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        _ENTRY = library.function(
            "hfspec_rmsnorm",
            [ctypes.c_int, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int],
        )


def use(model: nn.Module, library: kernels.KernelLibrary) -> int:
    """Switch ``model``'s ``LlamaRMSNorm``-like modules to the kernel; how many run it now."""
    bind(library)
    return switch(model, FusedRMSNorm, lambda module: {} if computes_llama_rmsnorm(module) else None)


def unuse(model: nn.Module) -> int:
    """Switch ``model``'s norms back to their own classes; how many were switched."""
    return switch_back(model, FusedRMSNorm)
