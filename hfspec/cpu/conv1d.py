"""transformers' ``Conv1D`` layers (GPT-2, OpenAI GPT) on the CPU kernel: a row's bits whatever rows come with it.

``Conv1D`` is a linear layer whose weight is stored input-major, (in, out), and runs ``torch.addmm``, whose
blocking depends on the number of rows: a token's projections then come out in other bits in a decoding step
than in a verification or a prefill. :class:`FastConv1D` runs ``hfspec/cpu/csrc/linear_kn.cpp`` on that layout as
it is (nothing copied), where each output is one chain of multiply-adds in input order; other devices and dtypes,
and autograd, keep ``addmm``. :func:`use` switches a model's ``Conv1D`` layers, :func:`unuse` switches them back.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfspec.cpu import kernels

__all__ = ["FastConv1D", "unuse", "use"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ENTRY = None  # the kernel's entry, bound by use()
_ARGTYPES = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int,
]


class FastConv1D(Conv1D):
    """A ``Conv1D`` whose forward runs the kernel on CPU (same parameters, same state). Made only by :func:`use`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (
            _ENTRY is None
            or not (x.is_cpu and w.is_cpu)
            or x.dtype != w.dtype
            or w.dtype not in _DTYPES
            or w.stride(1) != 1
            or (b is not None and b.dtype != w.dtype)
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
        ):
            return super().forward(x)
        rows = x.reshape(-1, self.nx).float().contiguous()  # bf16 activations are summed in fp32
        bias = None if b is None else b.float().contiguous()
        out = torch.empty(rows.shape[0], self.nf, dtype=torch.float32)
        _ENTRY(
            _DTYPES[w.dtype],
            rows.data_ptr(),
            self.nx,
            w.data_ptr(),
            w.stride(0),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            self.nf,
            rows.shape[0],
            self.nf,
            self.nx,
            torch.get_num_threads(),
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], self.nf)


def use(model: nn.Module, library: kernels.KernelLibrary) -> list[str]:
    """Switch ``model``'s ``Conv1D`` layers with float32 or bfloat16 weights on CPU to :class:`FastConv1D`; their
    names."""
    global _ENTRY
    if _ENTRY is None:
        _ENTRY = library.function("hfspec_linear_kn", _ARGTYPES)
    names = []
    for name, module in model.named_modules():
        if type(module) in (Conv1D, FastConv1D) and module.weight.is_cpu and module.weight.dtype in _DTYPES:
            module.__class__ = FastConv1D
            names.append(name)
    return names


def unuse(model: nn.Module) -> int:
    """Switch ``model``'s :class:`FastConv1D` layers back to ``Conv1D``; how many were switched."""
    count = 0
    for module in model.modules():
        if type(module) is FastConv1D:
            module.__class__ = Conv1D
            count += 1
    return count
