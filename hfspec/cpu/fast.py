"""Opt-in fast CPU forwards: a model's ``nn.Linear`` layers and its attention run hfspec's kernels.

Verification feeds k + 1 tokens through the target in one forward; on CPU that should cost about one
decoding step, since both stream the same weights once, but torch's small-M GEMMs are far from that.
:func:`accelerate` turns every plain ``nn.Linear`` of a model the caller passes (attention, MLP, output
head) into a :class:`FastLinear`, which runs :mod:`hfspec.cpu.kernels` on CPU with fp32 or bf16 weights for
inputs of any number of rows (prompts included; ``max_rows`` hands longer inputs to torch), and torch's
``F.linear`` for anything else (other devices and dtypes, autograd). A model running transformers' ``sdpa`` or
``eager`` attention also switches to :mod:`hfspec.cpu.attention`'s kernel. Both give a row the same bits whatever
rows share the call, so an accelerated model scores a token alike in a decoding step, a verification, a tree, a
ragged batch or a prefill: greedy hfspec equals the accelerated model's own ``generate()`` in float32 and
bfloat16 (tests/test_row_invariance.py).
Weights keep their tensors and layout: nothing is copied, and a head tied to the embedding stays tied.
Layers that hold GGUF blocks (:mod:`hfspec.cpu.quant`, loaded by :mod:`hfspec.models.gguf_native`) run the quantized
kernel on their own; :func:`accelerate` times their block shapes and switches their model's attention and
activations too. :func:`restore` undoes it; ``HFSPEC_KERNELS=0`` turns it off.

:func:`accelerate_loaded` is the policy ``hfspec.drafters.loading.load_pair`` applies to the models it loads
itself (CPU, fp32 or bf16, a vectorised kernel); :func:`describe` says what a model runs, for reports;
:func:`suspended` runs a block with torch's own linears and attention (a benchmark's eager baseline).

The kernels sum in another order than torch, so logits differ from torch's in the last bits
(see ``scripts/kernel_speed.py``); an accelerated model is consistent with itself, e.g. its own
``generate()``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hfspec.cpu import activations as cpu_activations
from hfspec.cpu import attention as cpu_attention
from hfspec.cpu import conv1d as cpu_conv1d
from hfspec.cpu import kernels, mlp, norms, quant, rotary
from hfspec.cpu import layer as cpu_layer
from hfspec.cpu import plan as kernel_plan
from hfspec.cpu.c_linear import CLinear, Kind
from hfspec.errors import HfspecError

__all__ = [
    "ALL_ROWS",
    "AccelerationReport",
    "FastLinear",
    "accelerate",
    "accelerate_loaded",
    "accelerated",
    "describe",
    "is_accelerated",
    "replan",
    "restore",
    "suspended",
]

# Rows per call that run on the kernel by default: all of them. A row's bits then do not depend on how many rows
# share the call, prompts included (hfspec prefills all prompt tokens but the last, generate() all of them). The price
# is in long bf16 prompts, where torch's bf16 GEMM (oneDNN, AMX where the CPU has it) is much faster (README, Fast CPU
# forwards); ``accelerate(model, max_rows=n)`` gives inputs of more than n rows to torch, and with them the invariance.
ALL_ROWS = sys.maxsize
_DTYPES = (torch.float32, torch.bfloat16)
# What accelerate() switches beside the linears, each with use(model, library) and unuse(model): attention, activations,
# Conv1D layers, RMSNorms, the Llama/Qwen2 attention forward (rotary), gated MLPs (after the activations they fuse)
# and the decoder layers made of those parts (one kernel call each), all giving a row the same bits whatever rows come
# with it.
_COMPANIONS = (cpu_attention, cpu_activations, cpu_conv1d, norms, rotary, mlp, cpu_layer)
# The kernel :func:`accelerate` loaded, read on every forward (finding it again would hash the source);
# a FastLinear unpickled in a process that never called accelerate() runs torch's linear.
_KERNEL: kernels.KernelLibrary | None = None


class FastLinear(nn.Linear):
    """An ``nn.Linear`` whose forward uses hfspec's kernel for few rows on CPU (same parameters, same state).

    Made only by :func:`accelerate` (which swaps the class of an existing layer); ``max_rows`` is set there.
    """

    max_rows: int = ALL_ROWS
    plan: tuple[int, ...] | None = None  # the block shape per row count (kernel_plan); None: the default
    plan_threads: int | None = None  # the thread count the plan was timed for; None: not timed (the default plan)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w, b, k = self.weight, self.bias, self.in_features
        library = _KERNEL
        if (
            library is None
            or not (input.is_cpu and w.is_cpu)
            or input.dtype != w.dtype
            or w.dtype not in _DTYPES
            or input.shape[-1] != k
            or input.numel() > self.max_rows * k
            or not w.is_contiguous()
            or (torch.is_grad_enabled() and (w.requires_grad or input.requires_grad))
        ):
            return F.linear(input, w, b)
        if (
            input.dtype is torch.float32
            and input.is_contiguous()
            and (b is None or b.is_contiguous() and b.dtype is torch.float32)
        ):
            return kernels.linear_unchecked(library, input, w, b, self.plan)  # the decoding path: no copy, no reshape
        x = input.reshape(-1, k)
        if x.dtype != torch.float32 or x.stride(-1) != 1:  # bf16 activations are summed in fp32
            x = x.float().contiguous()
        bias = None if b is None else b.float().contiguous()
        out = kernels.linear_unchecked(library, x, w, bias, self.plan)
        return out.to(input.dtype).reshape(*input.shape[:-1], self.out_features)

    def c_linear(self) -> CLinear | None:
        """The kernel call :meth:`forward` makes for float32 CPU rows (no gradient), or None where it makes none."""
        w, b, library = self.weight, self.bias, _KERNEL
        if (
            library is None
            or not w.is_cpu
            or w.dtype is not torch.float32
            or not w.is_contiguous()
            or (b is not None and not (b.is_cpu and b.dtype is torch.float32 and b.is_contiguous()))
        ):
            return None
        plan = self.plan or kernels.default_plan(library)
        return CLinear(Kind.FLOAT32, 0, w, w.stride(0), b, self.out_features, self.in_features, plan, self.max_rows)


@dataclass(frozen=True)
class AccelerationReport:
    """What :func:`accelerate` did: converted layer names, skipped ones with the reason, memory added."""

    layers: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    bytes_added: int  # always 0: weights keep their tensors and layout
    isa: str | None  # the kernel's vector ISA, None when it is not in use
    library: Path | None
    build_seconds: float  # compile time paid by this call (0.0 from the cache)
    reason: str | None = None  # why nothing was converted, if so
    attention: bool = False  # whether the model's attention switched to hfspec.cpu.attention
    quantized: int = 0  # layers holding GGUF blocks on the quantized kernel (hfspec.cpu.quant)
    activations: int = 0  # activation modules switched to hfspec.cpu.activations
    norms: int = 0  # RMSNorm modules switched to hfspec.cpu.norms
    rotary: int = 0  # attention modules switched to hfspec.cpu.rotary's forward (rotary on the kernel)
    mlps: int = 0  # gated MLPs switched to hfspec.cpu.mlp (activation and product in one call)
    decoders: int = 0  # decoder layers switched to hfspec.cpu.layer (the whole layer in one kernel call)


def _skip_reason(module: nn.Linear) -> str | None:
    """Why a layer stays torch's, or None if it can take the kernel."""
    if module.weight.device.type != "cpu":
        return f"weight on {module.weight.device}"
    if module.weight.dtype not in _DTYPES:
        return f"weight dtype {module.weight.dtype}"
    if not module.weight.is_contiguous():
        return "weight not contiguous"
    return None


def accelerate(model: nn.Module, *, max_rows: int | None = None, plan: bool = True) -> AccelerationReport:
    """Make ``model``'s plain ``nn.Linear`` layers run hfspec's kernel for inputs of at most ``max_rows`` rows
    (by default all of them), and its ``sdpa`` or ``eager`` attention run :mod:`hfspec.cpu.attention`'s.

    Builds the kernel on first use (seconds, cached afterwards), and times its block shapes on the model's
    layers the first time this machine sees their shapes (seconds, cached: :mod:`hfspec.cpu.plan`). The
    model is changed in place; nothing else is touched, and :func:`restore` undoes it. Where the kernel
    cannot be built or ``HFSPEC_KERNELS=0`` is set, the model is left as it is and the report says why.
    ``plan=False`` keeps the default block shapes (for linears about to be replaced, as a draft's are when it is
    put in integer arithmetic).
    """
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise HfspecError(f"max_rows must be a positive int (rows per call to run on the kernel), got {max_rows!r}")
    if os.environ.get("HFSPEC_KERNELS", "1") == "0":
        return AccelerationReport((), (), 0, None, None, 0.0, reason="HFSPEC_KERNELS=0")
    global _KERNEL
    library = kernels.load()
    if library is None:
        return AccelerationReport((), (), 0, None, None, 0.0, reason=kernels.build_failure())
    _KERNEL = library
    layers, converted, skipped = [], [], []
    for name, module in model.named_modules():
        if type(module) not in (nn.Linear, FastLinear):  # subclasses (quantised, LoRA...) have their own forward
            continue
        why = _skip_reason(module)
        if why is not None:
            skipped.append((name, why))
            continue
        module.__class__ = FastLinear
        module.max_rows = max_rows or ALL_ROWS
        layers.append(name)
        converted.append(module)
    shapes = kernel_plan.plan_for(library, converted) if plan else kernels.default_plan(library)
    for module in converted:
        module.plan, module.plan_threads = shapes, torch.get_num_threads() if plan else None
    quantized = quant.plan_layers(model) if plan else len(quant.quantized_layers(model))
    layers += cpu_conv1d.use(model, library) if converted else []
    attention = bool(converted or quantized) and cpu_attention.use(model, library)
    acts = cpu_activations.use(model, library) if converted or quantized else 0
    fused_norms = norms.use(model, library) if converted or quantized else 0
    lean = rotary.use(model, library) if converted or quantized else 0
    gated = mlp.use(model, library) if converted or quantized else 0
    decoders = cpu_layer.use(model, library) if converted or quantized else 0
    return AccelerationReport(
        tuple(layers),
        tuple(skipped),
        0,
        library.isa,
        library.path,
        library.build_seconds,
        attention=attention,
        quantized=quantized,
        activations=acts,
        norms=fused_norms,
        rotary=lean,
        mlps=gated,
        decoders=decoders,
    )


def restore(model: nn.Module) -> int:
    """Turn ``model``'s :class:`FastLinear` layers back into ``nn.Linear``, and its attention, activations and norms
    back to their own; the number of layers restored."""
    for part in _COMPANIONS:
        part.unuse(model)
    count = 0
    for module in model.modules():
        if type(module) is FastLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("max_rows", None)
            module.__dict__.pop("plan", None)
            module.__dict__.pop("plan_threads", None)
            count += 1
    return count


def replan(model: nn.Module | None) -> int:
    """Time ``model``'s block shapes again where they were timed for another thread count than torch's current one
    (:mod:`hfspec.cpu.plan`: cached per count, so only a count not seen before takes seconds); the number of layers
    planned anew. Every plan gives the same bits at every count: one timed for another count only runs slower."""
    if model is None:
        return 0
    threads, count = torch.get_num_threads(), 0
    timed = [m for m in model.modules() if type(m) is FastLinear and m.plan_threads is not None]
    if _KERNEL is not None and any(m.plan_threads != threads for m in timed):
        shapes = kernel_plan.plan_for(_KERNEL, timed)
        for module in timed:
            module.plan, module.plan_threads = shapes, threads
        count += len(timed)
    if any(m.plan_threads not in (None, threads) for m in quant.quantized_layers(model)):
        count += quant.plan_layers(model)
    return count


def is_accelerated(model: nn.Module) -> bool:
    """Whether any layer of ``model`` runs the kernel."""
    return any(type(m) is FastLinear for m in model.modules())


@contextlib.contextmanager
def accelerated(model: nn.Module, *, max_rows: int | None = None) -> Iterator[AccelerationReport]:
    """``with accelerated(model) as report:`` runs the kernel inside the block and restores the model after."""
    was_accelerated = is_accelerated(model)
    report = accelerate(model, max_rows=max_rows)
    try:
        yield report
    finally:
        if not was_accelerated:
            restore(model)


NOT_CPU = "off: not a CPU model"


def _off_reason(model: nn.Module) -> str | None:
    """Why the kernel cannot serve ``model`` at all (device, dtype), or None if it can."""
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)  # not GGUF blocks (uint8)
    if weight is None:
        return "off: no weights"
    if weight.device.type != "cpu":
        return NOT_CPU
    if weight.dtype not in _DTYPES:
        return f"off: {str(weight.dtype).replace('torch.', '')} weights (the kernel reads float32 and bfloat16)"
    return None


def accelerate_loaded(model: nn.Module, *, plan: bool = True) -> AccelerationReport:
    """:func:`accelerate` a model hfspec loaded itself, where the kernel pays: on CPU, fp32 or bf16 weights,
    and a vectorised build (AVX2 or AVX-512; the scalar fallback would lose to torch's own GEMMs)."""
    why = _off_reason(model)
    if why is not None:
        return AccelerationReport((), (), 0, None, None, 0.0, reason=why)
    report = accelerate(model, plan=plan)
    if report.isa == "scalar":
        restore(model)
        return AccelerationReport(
            (),
            (),
            0,
            report.isa,
            report.library,
            report.build_seconds,
            reason="off: the kernel has no vector instructions on this CPU",
        )
    return report


def describe(model: nn.Module | None) -> dict[str, object]:
    """Whether ``model`` runs the kernel: ``on``, ``isa``, ``layers`` on it, ``bytes_added`` (0) and,
    when off, the ``reason`` (e.g. ``"off: not a CPU model"``); for a model holding GGUF blocks also
    ``quantized``: its quantized ``layers``, ``formats`` (layers per format) and ``bytes`` held
    (:func:`hfspec.cpu.quant.describe`); and ``fused``, where any run: how many RMSNorms (``norms``), attention
    forwards (``rotary``), gated MLPs (``mlp``) and decoder layers (``layers``, one kernel call each) run hfspec's
    fused kernels."""
    if model is None:
        return {"on": False, "isa": None, "layers": 0, "bytes_added": 0, "reason": "off: no draft model"}
    layers = sum(type(m) in (FastLinear, cpu_conv1d.FastConv1D) for m in model.modules())
    held = quant.describe(model)
    extra = {"quantized": held} if held["formats"] else {}
    fused = {
        "norms": sum(type(m) is norms.FusedRMSNorm for m in model.modules()),
        "rotary": sum(type(m) is rotary.LeanAttention for m in model.modules()),
        "mlp": sum(type(m) is mlp.GatedMLP for m in model.modules()),
        "layers": sum(isinstance(m, cpu_layer.LeanLayer) for m in model.modules()),
    }
    extra |= {"fused": fused} if any(fused.values()) else {}
    qk = quant.kernel() if held["layers"] else None
    if (layers and _KERNEL is not None) or qk is not None:
        isa = _KERNEL.isa if layers and _KERNEL is not None else qk.library.isa
        return {"on": True, "isa": isa, "layers": layers + held["layers"], "bytes_added": 0, "reason": None, **extra}
    why = _off_reason(model)
    if why is None and os.environ.get("HFSPEC_KERNELS", "1") == "0":
        why = "off: HFSPEC_KERNELS=0"
    if why is None and kernels.build_failure() is not None:
        why = f"off: {kernels.build_failure()}"
    return {
        "on": False,
        "isa": None,
        "layers": 0,
        "bytes_added": 0,
        "reason": why or "off: not accelerated (hfspec.fast.accelerate(model) turns it on)",
        **extra,
    }


@contextlib.contextmanager
def suspended(*models: nn.Module | None) -> Iterator[None]:
    """``with suspended(target, draft):`` runs torch's own linears, attention and activations inside the block; the
    same layers run the kernels again afterwards (a benchmark's eager baseline on an accelerated model)."""
    layers = [m for model in models if model is not None for m in model.modules() if type(m) is FastLinear]
    switched = [(part, model) for part in _COMPANIONS for model in models if model is not None and part.unuse(model)]
    for linear in layers:
        linear.__class__ = nn.Linear
    try:
        yield
    finally:
        for linear in layers:
            linear.__class__ = FastLinear
        for part, model in switched:
            part.use(model, _KERNEL)
