"""Activations on CPU that give an element the same bits wherever it falls in the tensor.

torch's SiLU and GELU kernels compute most elements in a vector body (Sleef) and the remainder of each thread's
chunk in a scalar loop (libm); the two differ in the last bit for a few percent of inputs, and which elements take
the remainder depends on the tensor's size, so on how many rows share the forward. A token's MLP then comes out in
other bits in a decoding step than in a verification or a prefill. ``hfspec/cpu/csrc/activation.cpp`` computes
every element with the same vector code; :func:`use` switches a model's activation modules (transformers'
``ACT2FN`` classes and torch's ``nn.SiLU``/``nn.GELU``) to it, :func:`unuse` switches them back.

A model may also call an activation as a function inside its forward: a gate ``attn_output * torch.sigmoid(gate)``
(Qwen3-Next, gpt-oss), ``F.silu``, ``F.gelu``. Where a model's own code does (its modeling source says so),
:func:`use` runs its forwards (the model's, and those of its modules from that code, so that a recurrent mixer
re-run alone computes as inside the model) under :class:`FunctionalActivations`, a torch function mode that sends
``torch.sigmoid``/``Tensor.sigmoid``, ``F.silu`` and ``F.gelu`` to the kernel, and :func:`unuse` takes it off again;
models that call none pay nothing for it.

Activations built only from operations that are the same bits on both paths (``gelu_new``, ``gelu_fast``: tanh,
powers, products; ReLU) are invariant as they are and left alone; others (softplus, softmax and whatever else a
forward computes with torch's element-wise kernels) keep torch's.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import re
import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import activations as hf

from hfspec.cpu import kernels
from hfspec.cpu.swap import switch, switch_back

__all__ = ["FunctionalActivations", "InvariantActivation", "calls_functional_activations", "kind_of", "unuse", "use"]

SILU, QUICK_GELU, GELU_TANH, GELU_ERF, SIGMOID = range(5)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ENTRY = None  # the kernel's entry, bound by use()
# The functions FunctionalActivations computes; F.gelu's kind follows its ``approximate`` argument.
_FUNCTIONS = {torch.sigmoid: SIGMOID, torch.Tensor.sigmoid: SIGMOID, torch.special.expit: SIGMOID, F.silu: SILU}
# A call of one of them in a model's source: torch.sigmoid(, F.silu(, nn.functional.gelu(, x.sigmoid().
_CALLS = re.compile(r"\b(?:torch|F|functional)\.(?:sigmoid|silu|gelu)\(|\.sigmoid\(\)|\bexpit\(")


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
        return _apply(self.hfspec_kind, input)


def _apply(kind: int, input: torch.Tensor) -> torch.Tensor:
    x = input.contiguous()
    out = torch.empty_like(x)
    _ENTRY(kind, _DTYPES[x.dtype], x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads())
    return out


class FunctionalActivations(TorchFunctionMode):
    """While active: ``torch.sigmoid``, ``Tensor.sigmoid``, ``F.silu`` and ``F.gelu`` on CPU float32 or bfloat16
    tensors without gradients run the kernel (in-place forms and anything else run torch's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        x = args[0] if args else None
        if (
            kind is not None
            and _ENTRY is not None
            and type(x) is torch.Tensor
            and x.is_cpu
            and x.dtype in _DTYPES
            and not (torch.is_grad_enabled() and x.requires_grad)
        ):
            return _apply(kind, x)
        return func(*args, **kwargs)


def _kind(func, args: tuple, kwargs: dict) -> int | None:
    """The kernel's activation that computes this call, or None (torch's: another function, out=, inplace=True)."""
    if func is F.gelu:
        approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
        plain = len(args) <= 2 and set(kwargs) <= {"approximate"}
        return {"none": GELU_ERF, "tanh": GELU_TANH}.get(approximate) if plain else None
    plain = len(args) == 1 and all(key == "inplace" and value is False for key, value in kwargs.items())
    return _FUNCTIONS.get(func) if plain else None


@functools.cache
def _source_calls(module_name: str) -> bool:
    try:
        return bool(_CALLS.search(inspect.getsource(sys.modules[module_name])))
    except (KeyError, OSError, TypeError):  # no module or no source (built in, compiled): nothing to read
        return False


def _calls_functional(module: nn.Module) -> bool:
    """Whether the modeling code of ``module``'s class calls sigmoid, SiLU or GELU as a function (torch's and
    transformers' own activation modules aside: :func:`use` switches those)."""
    name = type(module).__module__
    excluded = name.startswith(("torch.", "hfspec.")) or name == "transformers.activations"
    return not excluded and _source_calls(name)


def calls_functional_activations(model: nn.Module) -> bool:
    """Whether the modeling code of any of ``model``'s modules calls an activation as a function."""
    return any(_calls_functional(m) for m in model.modules())


# Per thread: how many hooked forwards are running, and the mode the outermost one entered.
_ACTIVE = threading.local()


def _enter(module: nn.Module, args) -> None:
    depth = getattr(_ACTIVE, "depth", 0)
    if depth == 0:
        _ACTIVE.mode = FunctionalActivations()
        _ACTIVE.mode.__enter__()
    _ACTIVE.depth = depth + 1


def _leave(module: nn.Module, args, output) -> None:
    _ACTIVE.depth -= 1
    if _ACTIVE.depth == 0:
        _ACTIVE.mode.__exit__(None, None, None)


def _bind(library: kernels.KernelLibrary) -> None:
    global _ENTRY
    if _ENTRY is None:
        _ENTRY = library.function(
            "hfspec_activation",
            [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
        )


def use(model: nn.Module, library: kernels.KernelLibrary) -> int:
    """Switch ``model``'s activation modules that the kernel computes to it, and run its forwards under
    :class:`FunctionalActivations` where its code calls activations as functions; how many modules run it now."""
    _bind(library)
    hooked = [m for m in model.modules() if _calls_functional(m)] if "hfspec_functional" not in model.__dict__ else []
    if hooked:
        # The model and every module of such code: a recurrent mixer re-run on its own (hfspec's rollback) computes
        # as it did inside the model's forward.
        modules = [model, *(m for m in hooked if m is not model)]
        model.__dict__["hfspec_functional"] = tuple(
            handle
            for m in modules
            for handle in (m.register_forward_pre_hook(_enter), m.register_forward_hook(_leave, always_call=True))
        )

    def state(module: nn.Module) -> dict | None:
        kind = kind_of(module)
        return None if kind is None else {"hfspec_kind": kind}

    return switch(model, InvariantActivation, state)


def unuse(model: nn.Module) -> int:
    """Switch ``model``'s activations back to their own classes (and its functional ones to torch's); how many
    modules were switched."""
    for handle in model.__dict__.pop("hfspec_functional", ()):
        handle.remove()
    return switch_back(model, InvariantActivation)
