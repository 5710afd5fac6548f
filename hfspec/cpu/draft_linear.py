"""A draft model's linears in integer arithmetic: 4-bit weights, int8 activations, VNNI dot products.

Speculative sampling is lossless whatever the draft computes, provided q, the draft's distribution, is the one its
tokens were drawn from (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv 2302.01318): a draft that computes
approximately only lowers acceptance, never exactness. On CPU a drafting step is bound by reading the weights, and
hfspec's exact kernels (:mod:`hfspec.cpu.kernels`, :mod:`hfspec.cpu.quant`) spend their time on fp32 FMAs, 16
multiply-adds per instruction. :class:`DraftLinear` holds a layer's weight as 4-bit (or 8-bit) codes with an fp16
scale and offset per block of 32 (``w = d * code + m``), packed once at load, and runs ``csrc/draft.cpp``: each
input row is quantized per block of 32 to int8 on every call, and one VNNI instruction does 64 multiply-adds, so a
step streams about 5 bits per weight at memory speed.

:func:`quantize_for_drafting` converts, in place, every linear of a draft model (``nn.Linear``,
:class:`~hfspec.cpu.fast.FastLinear`, :class:`~hfspec.cpu.quant.QuantLinear`, and the ``kept`` rows of a
:class:`~hfspec.models.head_cut.FrequentHead`); call it after :func:`hfspec.cpu.fast.accelerate`, which switches the
model's attention and activations only while it finds linears of its own. Never give it the target: the target's
logits must stay exact. Where the kernel is off (``HFSPEC_KERNELS=0``, no compiler, a CPU without AVX-512 VNNI or
AVX2 with FMA and F16C) it converts nothing; a :class:`DraftLinear` that meets the kernel off later, another device
or autograd computes ``F.linear`` on its dequantized weight in the input's precision: another approximation,
equally lossless.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hfspec.cpu import kernels, quant
from hfspec.cpu.c_linear import CLinear, Kind
from hfspec.cpu.fast import FastLinear
from hfspec.errors import HfspecError, HfspecTypeError

__all__ = [
    "BITS",
    "LANES",
    "QK",
    "DraftKernel",
    "DraftLinear",
    "DraftingReport",
    "dequantize",
    "describe",
    "kernel",
    "pack",
    "quantize_for_drafting",
    "unavailable",
    "unpack",
    "weights",
]

QK = 32  # weights per block along in_features, each with its own scale and offset
LANES = 16  # weight rows packed side by side: one 16-lane vector of sums
BITS = (4, 8)
# Rows quantized at a time while packing: bounds the fp32 copies of a large head.
_CHUNK_ROWS = 4096
_INPUTS = (torch.float32, torch.bfloat16)  # input dtypes the kernel takes (bf16 widened to fp32 first)


def _block_bytes(bits: int) -> int:
    return LANES * QK * bits // 8 + 4 * LANES  # codes, then 16 fp16 scales and 16 fp16 offsets


@dataclass(frozen=True)
class DraftKernel:
    """The draft kernel in the loaded library: its vector ISA and C entries."""

    library: kernels.KernelLibrary
    isa: str  # "avx512vnni", "avxvnni", "avx2" or "scalar"
    linear: ctypes._CFuncPtr = field(repr=False, compare=False)
    pack: ctypes._CFuncPtr = field(repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> DraftKernel:
        return self  # process state, as the library


_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_KERNEL: DraftKernel | None = None  # what kernel() bound, read on every forward


@functools.cache
def _bind(library: kernels.KernelLibrary) -> DraftKernel:
    isa = library.function("hfspec_draft_isa", [], ctypes.c_char_p)().decode()
    linear_fn = library.function(
        "hfspec_draft_linear", [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT], _INT
    )
    pack_fn = library.function("hfspec_draft_pack", [_INT, _PTR, _I64, _I64, _I64, _PTR, _INT], _INT)
    return DraftKernel(library, isa, linear_fn, pack_fn)


def unavailable() -> str | None:
    """Why draft layers cannot run the kernel here, or None if they can."""
    if os.environ.get("HFSPEC_KERNELS", "1") == "0":
        return "HFSPEC_KERNELS=0"
    library = kernels.load()
    if library is None:
        return kernels.build_failure() or "the CPU kernel could not be built"
    if _bind(library).isa == "scalar":  # as for hfspec's other kernels, scalar code is not used
        return "the draft kernel has no vector path on this CPU (it needs AVX-512 VNNI, or AVX2 with FMA and F16C)"
    return None


def kernel() -> DraftKernel | None:
    """The draft kernel (built with the others on first use), or None where it is off (:func:`unavailable` says
    why); every :class:`DraftLinear` runs what this last returned."""
    global _KERNEL
    _KERNEL = None if unavailable() is not None else _bind(kernels.load())
    return _KERNEL


# -- packing ------------------------------------------------------------------------------------------------------


def pack(weight: torch.Tensor, bits: int = 4, dk: DraftKernel | None = None) -> torch.Tensor:
    """``weight`` (N, K), any float dtype, in the kernel's layout (``csrc/draft.cpp``): uint8 (ceil(N / 16), K / 32,
    bytes per block), each block of 32 weights of a row as codes in 0..2^bits - 1 with the fp16 scale ``d`` and
    offset ``m`` of least squared error, ``w ~= d * code + m``. Runs the library's packer (``dk``, by default the bound
    kernel's); raises ``HfspecError`` where there is none."""
    dk = dk or _KERNEL or kernel()
    if dk is None:
        raise HfspecError(f"packing draft weights needs hfspec's CPU kernel, which is off here: {unavailable()}")
    n, k = weight.shape
    if k % QK or bits not in BITS:
        raise HfspecError(
            f"the draft kernel packs {BITS} bits for in_features a multiple of {QK}; got {bits} bits and {k}"
        )
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    if w.stride(-1) != 1 or (n > 1 and w.stride(0) < k):
        w = w.contiguous()
    out = torch.empty((-(-n // LANES), k // QK, _block_bytes(bits)), dtype=torch.uint8)
    dk.pack(bits, w.data_ptr(), w.stride(0), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def unpack(packed: torch.Tensor, bits: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes (out_features, K) uint8 and fp16 ``d``, ``m`` (out_features, K / 32) that ``packed`` holds."""
    groups, kb, _ = packed.shape
    size = LANES * QK * bits // 8
    chunks = packed[..., :size]
    if bits == 4:  # (G, kb, chunk, lane, nibble, byte) -> (G, lane, kb, chunk, nibble, byte)
        c = chunks.reshape(groups, kb, 4, LANES, 1, 4)
        q = torch.cat([c & 0x0F, c >> 4], dim=4).permute(0, 3, 1, 2, 4, 5)
    else:  # (G, kb, chunk, lane, byte) -> (G, lane, kb, chunk, byte)
        q = chunks.reshape(groups, kb, 8, LANES, 4).permute(0, 3, 1, 2, 4)
    codes = q.reshape(groups * LANES, kb * QK)[:out_features]
    d, m = (
        packed[..., size + i * 2 * LANES : size + (i + 1) * 2 * LANES]
        .contiguous()
        .view(torch.float16)
        .transpose(1, 2)
        .reshape(groups * LANES, kb)[:out_features]
        for i in (0, 1)
    )
    return codes, d, m


def dequantize(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """The fp32 weight (out_features, K) that ``packed`` holds: ``d * code + m`` per block."""
    codes, d, m = unpack(packed, bits, out_features)
    blocks = codes.reshape(out_features, -1, QK).float()
    return (blocks * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).reshape(out_features, -1)


def _rows(module: quant.QuantLinear, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop of a quantized layer's weight, dequantized exactly."""
    return quant.dequantize(module.weight, module.fmt, module.in_features, torch.arange(start, stop))


# -- the layer ----------------------------------------------------------------------------------------------------


class DraftLinear(nn.Module):
    """A linear whose weight is packed in blocks of 4-bit (or 8-bit) codes (``packed``: uint8 (groups, blocks,
    bytes)), run by the draft kernel on CPU for fp32 or bf16 inputs of any leading shape; the output has the
    input's dtype. Elsewhere (kernel off, another device, autograd) ``F.linear`` on the dequantized weight."""

    def __init__(
        self, packed: torch.Tensor, bits: int, in_features: int, out_features: int, bias: torch.Tensor | None = None
    ):
        super().__init__()
        if (
            bits not in BITS
            or packed.dtype != torch.uint8
            or packed.shape != (-(-out_features // LANES), in_features // QK, _block_bytes(bits))
        ):
            raise HfspecError(
                f"packed weights for {out_features} x {in_features} at {bits} bits are uint8 "
                f"({-(-out_features // LANES)}, {in_features // QK}, {_block_bytes(bits)}) (pack() makes "
                f"them); got {packed.dtype} {tuple(packed.shape)}"
            )
        self.bits, self.in_features, self.out_features = bits, in_features, out_features
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_module(cls, module: nn.Module, bits: int = 4) -> DraftLinear:
        """A :class:`DraftLinear` for an ``nn.Linear`` (fp32, bf16, a :class:`~hfspec.cpu.fast.FastLinear`) or a
        :class:`~hfspec.cpu.quant.QuantLinear` (its weight dequantized exactly, then packed), with its bias."""
        if not isinstance(module, (nn.Linear, quant.QuantLinear)):
            raise HfspecTypeError(
                f"DraftLinear.from_module takes an nn.Linear or a QuantLinear, got {type(module).__name__}"
            )
        n, k = module.out_features, module.in_features
        if isinstance(module, quant.QuantLinear):  # dequantized a slice of rows at a time
            packed = torch.cat(
                [pack(_rows(module, start, min(n, start + _CHUNK_ROWS)), bits) for start in range(0, n, _CHUNK_ROWS)]
            )  # whole groups: _CHUNK_ROWS % LANES == 0
        else:
            packed = pack(module.weight, bits)
        return cls(packed, bits, k, n, module.bias)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight (out_features, in_features) this layer computes with."""
        return dequantize(self.packed, self.bits, self.out_features)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dk, k, n = _KERNEL, self.in_features, self.out_features
        packed, b = self.packed, self.bias
        if (
            dk is None
            or not input.is_cpu
            or not packed.is_cpu
            or input.shape[-1] != k
            or input.dtype not in _INPUTS
            or (input.requires_grad and torch.is_grad_enabled())
        ):
            return self._torch(input)
        x = input if input.dtype is torch.float32 and input.is_contiguous() else input.float().contiguous()
        if b is not None and b.dtype is not torch.float32:
            b = b.float()
        out = torch.empty((*input.shape[:-1], n), dtype=torch.float32)
        m = x.numel() // k
        dk.linear(
            self.bits,
            x.data_ptr(),
            k,
            packed.data_ptr(),
            None if b is None else b.data_ptr(),
            out.data_ptr(),
            n,
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        return out if input.dtype is torch.float32 else out.to(input.dtype)

    def c_linear(self) -> CLinear | None:
        """The kernel call :meth:`forward` makes for float32 CPU rows (no gradient), or None where it makes none."""
        packed, b = self.packed, self.bias
        if _KERNEL is None or not packed.is_cpu or (b is not None and b.dtype is not torch.float32):
            return None
        return CLinear(Kind.DRAFT, self.bits, packed, 0, b, self.out_features, self.in_features)

    def _torch(self, input: torch.Tensor) -> torch.Tensor:
        """``F.linear`` on the dequantized weight, in the input's dtype and on its device (dequantized per call)."""
        b = self.bias
        bias = None if b is None else b.to(device=input.device, dtype=input.dtype)
        return F.linear(input, self.dequantized().to(device=input.device, dtype=input.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"bias={self.bias is not None}"
        )


# -- a whole draft ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftingReport:
    """What :func:`quantize_for_drafting` did: layers converted and skipped (with the reason), the bytes of weights
    they read per step before and after, and the kernel's ISA (None, with the ``reason``, where it is off and
    nothing was converted)."""

    layers: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    bits: int
    bytes_before: int
    bytes_after: int
    isa: str | None
    reason: str | None = None


_CONVERTED = (nn.Linear, FastLinear, quant.QuantLinear)


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The linears :func:`quantize_for_drafting` converts, by name (a FrequentHead's ``kept`` among them)."""
    for name, module in model.named_modules():
        if name and type(module) in _CONVERTED:  # not the model itself: it cannot be replaced in place
            yield name, module


def quantize_for_drafting(model: nn.Module, bits: int = 4) -> DraftingReport:
    """Replace every linear of the draft ``model`` (in place) with a :class:`DraftLinear` of ``bits`` per weight.

    A head tied to the input embedding gets a packed copy of its own; the embedding stays as it is. Layers whose
    in_features is not a multiple of 32 stay as they are (``skipped``). Where the kernel is off, the whole model
    stays as it is and the report's ``reason`` says why. Only for a draft: its logits change.
    """
    if bits not in BITS:
        raise HfspecError(f"bits must be one of {BITS}, got {bits!r}")
    dk = kernel()
    if dk is None:  # a DraftLinear without the kernel dequantizes its weight on every call: slower than now
        return DraftingReport((), (), bits, 0, 0, None, unavailable())
    layers, skipped, before, after = [], [], 0, 0
    for name, module in list(_linears(model)):
        if module.in_features % QK:
            skipped.append((name, f"in_features {module.in_features} is not a multiple of {QK}"))
            continue
        replacement = DraftLinear.from_module(module, bits)
        before += module.weight.numel() * module.weight.element_size()
        after += replacement.packed.numel()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, replacement)
        layers.append(name)
    return DraftingReport(tuple(layers), tuple(skipped), bits, before, after, dk.isa)


def describe(model: nn.Module | None) -> dict[str, object]:
    """What of ``model`` runs in integer arithmetic: ``layers`` (DraftLinears), ``bits`` (their widths) and
    ``bytes`` of packed weights."""
    layers = [] if model is None else [m for m in model.modules() if isinstance(m, DraftLinear)]
    return {
        "layers": len(layers),
        "bits": sorted({m.bits for m in layers}),
        "bytes": sum(m.packed.numel() for m in layers),
    }


def weights(model: nn.Module) -> int:
    """The weights ``model`` computes with: its parameters, and those its DraftLinears hold packed."""
    return sum(p.numel() for p in model.parameters()) + sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, DraftLinear)
    )
