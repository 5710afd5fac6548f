"""Quantized linear layers: GGUF blocks kept as stored, computed exactly as the dequantized fp32 weights.

A GGUF model on CPU is 4-8 bits per weight on disk and 32 once transformers dequantizes it. :class:`QuantLinear`
holds a layer's blocks as the file stores them (``weight``: uint8, one row of blocks per output feature) and runs
``hfspec/cpu/csrc/quant.cpp``, which dequantizes each block in registers to exactly the float that the ``gguf``
package's dequantization (what transformers loads) gives it, and accumulates as the fp32 kernel
(:mod:`hfspec.cpu.kernels`) does: a quantized layer's output equals, bit for bit and for every row count, the fp32
kernel's on the dequantized weights. :class:`QuantEmbedding` looks up rows the same way, dequantizing only the
rows it is asked for; a tied head and its embedding share one tensor of blocks.

Formats read in place (:data:`FORMATS`): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K; the loader
(:mod:`hfspec.gguf`) dequantizes any other at load. Where the kernel is off (``HFSPEC_KERNELS=0``, no compiler,
another device, autograd), a layer runs torch's own path: dequantize the weight, then ``F.linear`` -- correct,
and slow, since it dequantizes on every call; :mod:`hfspec.gguf` therefore loads dequantized weights instead when
the kernel is unavailable.

The block shape per row count is timed on the model's own layers as the fp32 kernel's is (:mod:`hfspec.cpu.plan`,
:func:`plan_layers`). :func:`quantize_linear` builds a quantized layer from an fp32 or bf16 ``nn.Linear`` (the
``gguf`` package's quantizers: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hfspec.cpu import int8, kernels
from hfspec.cpu import plan as kernel_plan
from hfspec.cpu.c_linear import CLinear, Kind

__all__ = [
    "FORMATS",
    "Format",
    "QuantEmbedding",
    "QuantKernel",
    "QuantLinear",
    "default_plan",
    "dequantize",
    "describe",
    "format_of",
    "kernel",
    "linear",
    "plan_layers",
    "quantize_linear",
    "quantized_layers",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Format:
    """A GGUF block format: its ggml type id, and ``elements`` weights stored in ``nbytes`` bytes per block."""

    name: str
    type: int
    elements: int
    nbytes: int

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of ``in_features`` weights."""
        return in_features // self.elements * self.nbytes


# The formats quant.cpp reads (ggml's type ids and block sizes, ggml-common.h).
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("Q4_0", 2, 32, 18),
        Format("Q4_1", 3, 32, 20),
        Format("Q5_0", 6, 32, 22),
        Format("Q5_1", 7, 32, 24),
        Format("Q8_0", 8, 32, 34),
        Format("Q4_K", 12, 256, 144),
        Format("Q5_K", 13, 256, 176),
        Format("Q6_K", 14, 256, 210),
    )
}
_BY_TYPE = {f.type: f for f in FORMATS.values()}


def format_of(kind: str | int) -> Format | None:
    """The format named ``kind`` (``"Q4_K"``) or with ggml type id ``kind``; None if quant.cpp does not read it."""
    return FORMATS.get(kind) if isinstance(kind, str) else _BY_TYPE.get(int(kind))


@dataclass(frozen=True)
class QuantKernel:
    """The quantized kernel in the loaded library: its block shapes (rows per pass, weight rows per tile, weight rows
    per panel dequantized into a scratch, 0 for dequantized in registers) and C entries."""

    library: kernels.KernelLibrary
    shapes: tuple[tuple[int, int, int], ...]
    linear: ctypes._CFuncPtr = field(repr=False, compare=False)
    rows: ctypes._CFuncPtr = field(repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> QuantKernel:
        return self  # process state, as the library


_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_KERNEL: QuantKernel | None = None  # what kernel() bound, read on every forward
_INT8: int8.Int8Kernel | None = None  # the int8 entry of the same library, read on every int8 forward


@functools.cache
def _bind(library: kernels.KernelLibrary) -> QuantKernel | str:
    isa = library.function("hfspec_quant_isa", [], ctypes.c_char_p)().decode()
    if isa != library.isa:  # the same FMAs, lanes and sums as the fp32 kernel, or no exactness
        return f"the quantized kernel was built for {isa}, the fp32 kernel for {library.isa}"
    count = library.function("hfspec_quant_shape_count", [], _INT)()
    shape = library.function("hfspec_quant_shape", [_INT, _PTR, _PTR, _PTR])
    shapes = []
    for i in range(count):
        found = [ctypes.c_int() for _ in range(3)]
        shape(i, *map(ctypes.byref, found))
        shapes.append(tuple(v.value for v in found))
    supports = library.function("hfspec_quant_supports", [_INT], _INT)
    missing = [f.name for f in FORMATS.values() if not supports(f.type)]
    if missing:
        return f"the quantized kernel does not read {', '.join(missing)}"
    linear_fn = library.function(
        "hfspec_quant_linear", [_INT, _INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT], _INT
    )
    rows_fn = library.function("hfspec_quant_rows", [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT], _INT)
    return QuantKernel(library, tuple(shapes), linear_fn, rows_fn)


def kernel() -> QuantKernel | None:
    """The quantized kernel (built with the fp32 one on first use), or None where it is off: ``HFSPEC_KERNELS=0``,
    no compiler, or no vector instructions (:func:`unavailable` says why)."""
    global _KERNEL, _INT8
    if unavailable() is not None:
        return None
    found = _bind(kernels.load())
    _KERNEL = found if isinstance(found, QuantKernel) else None
    _INT8 = int8.kernel() if _KERNEL is not None else None
    return _KERNEL


def unavailable() -> str | None:
    """Why quantized layers cannot run the kernel here, or None if they can."""
    if os.environ.get("HFSPEC_KERNELS", "1") == "0":
        return "HFSPEC_KERNELS=0"
    library = kernels.load()
    if library is None:
        return kernels.build_failure() or "the CPU kernel could not be built"
    if library.isa == "scalar":
        return "the CPU kernel has no vector instructions on this CPU"
    found = _bind(library)
    return found if isinstance(found, str) else None


@functools.cache
def default_plan(qk: QuantKernel) -> tuple[int, ...]:
    """The shape per row count before any timing: for a few rows the weights dequantized in registers by each pass,
    for more a panel dequantized once into a scratch for every pass (what ran fastest on one Sapphire Rapids core,
    in its AVX-512 build and in an AVX2 build)."""
    index = {shape: i for i, shape in enumerate(qk.shapes)}
    if qk.library.isa == "avx512":
        pick = [
            (1, 8, 0) if m <= 1 else (4, 4, 0) if m <= 4 else (8, 3, 6) if m <= 7 else (4, 6, 6)
            for m in range(kernels.PLAN_ROWS + 1)
        ]
    else:
        pick = [(4, 2, 0) if m <= 2 else (4, 3, 6) if m <= 5 else (6, 2, 6) for m in range(kernels.PLAN_ROWS + 1)]
    return tuple(index.get(shape, 0) for shape in pick)


def linear(
    qk: QuantKernel,
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: Format,
    bias: torch.Tensor | None = None,
    plan: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``F.linear(x, dequantize(blocks), bias)`` for fp32 ``x`` (M, K) or (..., K) on CPU, in the block shape ``plan``
    names for M rows, with every output bit that the fp32 kernel gives on the dequantized weights.

    ``blocks`` is (N, K / fmt.elements * fmt.nbytes) uint8 with unit stride along a row; ``x`` as for
    :func:`hfspec.cpu.kernels.linear`; ``bias`` fp32 and contiguous.
    """
    k, n = x.shape[-1], blocks.shape[0]
    if (
        k % fmt.elements
        or blocks.shape[1] != fmt.row_bytes(k)
        or x.stride(-1) != 1
        or blocks.stride(1) != 1
        or (x.dim() != 2 and not x.is_contiguous())
    ):
        raise ValueError(
            f"a {fmt.name} linear needs x (M, K) with K a multiple of {fmt.elements} and blocks "
            f"(N, {fmt.nbytes} * K / {fmt.elements}) with unit stride; got {tuple(x.shape)} and "
            f"{tuple(blocks.shape)}"
        )
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    m = x.numel() // k
    plan = plan or default_plan(qk)
    qk.linear(
        fmt.type,
        plan[min(m, len(plan) - 1)],
        x.data_ptr(),
        x.stride(0) if x.dim() == 2 else k,
        blocks.data_ptr(),
        blocks.stride(0),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return out


def dequantize(blocks: torch.Tensor, fmt: Format, in_features: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weights of ``blocks`` (all rows, or the rows ``rows`` indexes), exactly as the ``gguf`` package
    dequantizes them: the kernel's dequantization where it is on, else the package's own."""
    qk = _KERNEL
    if qk is not None and blocks.is_cpu and blocks.stride(1) == 1:
        index = None if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
        n = blocks.shape[0] if index is None else index.numel()
        out = torch.empty((n, in_features), dtype=torch.float32)
        if index is not None and n and (int(index.min()) < 0 or int(index.max()) >= blocks.shape[0]):
            raise IndexError(f"row index out of range for {blocks.shape[0]} rows")
        qk.rows(
            fmt.type,
            blocks.data_ptr(),
            blocks.stride(0),
            None if index is None else index.data_ptr(),
            n,
            in_features,
            out.data_ptr(),
            in_features,
            torch.get_num_threads(),
        )
        return out
    from gguf import GGMLQuantizationType, quants

    picked = blocks if rows is None else blocks[rows.reshape(-1)]
    values = quants.dequantize(picked.cpu().numpy(), GGMLQuantizationType(fmt.type))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(-1, in_features).to(blocks.device)


def _blocks_parameter(blocks: torch.Tensor) -> nn.Parameter:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(
            f"quantized blocks are a 2-D uint8 tensor (rows, bytes per row), got {blocks.dtype} {tuple(blocks.shape)}"
        )
    return blocks if isinstance(blocks, nn.Parameter) else nn.Parameter(blocks, requires_grad=False)


class QuantLinear(nn.Module):
    """``nn.Linear`` whose weight stays in GGUF blocks: ``weight`` (out_features, bytes per row) uint8.

    ``arithmetic`` says what its forward computes. ``"float32"``: the dequantized weight times the input, on the
    quantized kernel on CPU (inputs of any float dtype are summed in fp32 and cast back), and torch's path
    (dequantize, then ``F.linear``) where the kernel is off or autograd needs the graph. ``"int8"``: llama.cpp's
    integer arithmetic (:mod:`hfspec.cpu.int8`), on the int8 kernel, or its torch reference where the kernel is
    off; it has no gradient.
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        fmt: Format | str,
        in_features: int,
        bias: torch.Tensor | None = None,
        arithmetic: str = "float32",
    ):
        super().__init__()
        self.arithmetic = int8.check_arithmetic(arithmetic)
        fmt = fmt if isinstance(fmt, Format) else format_of(fmt)
        if fmt is None:
            raise ValueError(f"no quantized kernel for this format; use one of {', '.join(FORMATS)}")
        if in_features % fmt.elements or blocks.shape[-1] != fmt.row_bytes(in_features):
            raise ValueError(
                f"{fmt.name} rows of {in_features} weights are {fmt.row_bytes(in_features)} bytes "
                f"(in_features a multiple of {fmt.elements}); got blocks {tuple(blocks.shape)}"
            )
        self.fmt = fmt
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.weight = _blocks_parameter(blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.plan: tuple[int, ...] | None = None  # the block shape per row count (plan_layers); None: the default
        self.plan_threads: int | None = None  # the thread count the plan was timed for; None: not timed
        # the int8 kernel's copy of the blocks (int8.pack: at load by plan_layers, else at the first int8 forward)
        # and the storage it was made from; None: not asked yet
        self._packing: tuple[int, int8.Packed | None] | None = None

    @property
    def kernel_kind(self) -> str:
        return self.fmt.name

    def kernel_call(
        self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, plan: tuple[int, ...]
    ) -> torch.Tensor:
        """The kernel on ``blocks`` (some of this layer's rows): what :mod:`hfspec.cpu.plan` times."""
        return linear(_KERNEL, x, blocks, self.fmt, bias, plan)

    def _packed(self, kernel: int8.Int8Kernel | None) -> int8.Packed | None:
        """The blocks as ``kernel`` reads them fastest, packed once (again if the weight was replaced); None where
        it reads them as stored."""
        if kernel is None:
            return None
        if self._packing is None or self._packing[0] != self.weight.data_ptr():
            self._packing = (self.weight.data_ptr(), int8.pack(self.weight, self.fmt.type, self.in_features, kernel))
        return self._packing[1]

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight (out_features, in_features), as the dequantized model holds it."""
        return dequantize(self.weight, self.fmt, self.in_features)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        qk, b, k = _KERNEL, self.bias, self.in_features
        if self.arithmetic == "int8":
            kernel = _INT8 if input.is_cpu and self.weight.is_cpu else None
            bias = b if b is None or b.device == input.device else b.to(input.device)
            out = int8.linear(input, self.weight, self.fmt.name, self.fmt.type, bias, kernel, self._packed(kernel))
            return out if out.dtype is input.dtype else out.to(input.dtype)
        if (
            qk is None
            or not input.is_cpu
            or not self.weight.is_cpu
            or input.shape[-1] != k
            or (torch.is_grad_enabled() and input.requires_grad)
        ):
            bias = None if b is None else b.to(input.dtype)
            return F.linear(input, self.dequantized().to(device=input.device, dtype=input.dtype), bias)
        if input.dtype is torch.float32 and input.is_contiguous():
            return linear(qk, input, self.weight, self.fmt, b, self.plan)  # the decoding path: no copy
        x = input.reshape(-1, k)
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        out = linear(qk, x, self.weight, self.fmt, b, self.plan)
        return out.to(input.dtype).reshape(*input.shape[:-1], self.out_features)

    def c_linear(self) -> CLinear | None:
        """The kernel call :meth:`forward` makes for float32 CPU rows (no gradient), or None where it makes none."""
        w, b, n, k = self.weight, self.bias, self.out_features, self.in_features
        if (
            not w.is_cpu
            or w.stride(1) != 1
            or (b is not None and not (b.is_cpu and b.dtype is torch.float32 and b.is_contiguous()))
        ):
            return None
        if self.arithmetic == "int8":
            if _INT8 is None:
                return None
            packed = self._packed(_INT8)
            if packed is not None:
                return CLinear(Kind.INT8_PACKED, self.fmt.type, packed.data, 0, b, n, k)
            return CLinear(Kind.INT8, self.fmt.type, w, w.stride(0), b, n, k)
        if _KERNEL is None:
            return None
        plan = self.plan or default_plan(_KERNEL)
        return CLinear(Kind.GGUF_FLOAT32, self.fmt.type, w, w.stride(0), b, n, k, plan)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}, "
            f"bias={self.bias is not None}, arithmetic={self.arithmetic}"
        )


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` whose table stays in GGUF blocks; a lookup dequantizes only the rows it returns (exactly).

    A lookup is a gather, not a product, so it returns the dequantized rows in either arithmetic (llama.cpp's
    get_rows does the same); ``arithmetic`` is what a head tied to this table computes in (:class:`QuantLinear`).
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        fmt: Format | str,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        arithmetic: str = "float32",
    ):
        super().__init__()
        self.arithmetic = int8.check_arithmetic(arithmetic)
        fmt = fmt if isinstance(fmt, Format) else format_of(fmt)
        if fmt is None or embedding_dim % fmt.elements or blocks.shape[-1] != fmt.row_bytes(embedding_dim):
            raise ValueError(
                f"blocks {tuple(blocks.shape)} are not {embedding_dim}-wide rows of a format in {', '.join(FORMATS)}"
            )
        self.fmt = fmt
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.padding_idx = None
        self.out_dtype = dtype
        self.weight = _blocks_parameter(blocks)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.weight, self.fmt, self.embedding_dim, input)
        return rows.to(self.out_dtype).reshape(*input.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt.name}, arithmetic={self.arithmetic}"


def quantized_layers(model: nn.Module) -> list[QuantLinear]:
    """``model``'s quantized linears, in forward order."""
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def plan_layers(model: nn.Module, *, progress: bool | None = None) -> int:
    """Give ``model``'s quantized linears in float32 arithmetic the block shape per row count timed on them
    (:mod:`hfspec.cpu.plan`: once per machine, threads and model, cached); the number of quantized layers on the
    kernel (0 where it is off; int8 layers have one shape and are counted without timing)."""
    every = quantized_layers(model)
    layers = [layer for layer in every if layer.arithmetic == "float32"]
    qk = kernel()
    if qk is None:
        return 0
    for layer in every:  # int8 layers are repacked now, at load, not in the first request's forward
        if layer.arithmetic == "int8" and layer.weight.is_cpu:
            layer._packed(_INT8)
    if layers:
        plan = kernel_plan.plan_for(qk.library, layers, progress=progress, shapes=qk.shapes, default=default_plan(qk))
        for layer in layers:
            layer.plan, layer.plan_threads = plan, torch.get_num_threads()
    return len(every)


def describe(model: nn.Module | None) -> dict[str, object]:
    """What of ``model`` stays quantized: ``layers`` (quantized linears), ``formats`` (layers per format, with a
    quantized embedding counted as ``"embedding"``), ``bytes`` of blocks held (a shared table counted once),
    ``packed_bytes`` of the int8 kernel's repacked copies (:func:`hfspec.cpu.int8.pack`) and the ``arithmetic``
    its quantized linears run in (``"int8"``, ``"float32"``, ``"mixed"``; None without any)."""
    if model is None:
        return {"layers": 0, "formats": {}, "bytes": 0, "packed_bytes": 0, "arithmetic": None}
    formats: Counter[str] = Counter()
    held: dict[int, int] = {}
    arithmetics: set[str] = set()
    layers = packed = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m._packing is not None and m._packing[1] is not None:
            packed += m._packing[1].data.numel()
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            formats[m.fmt.name if isinstance(m, QuantLinear) else f"{m.fmt.name} embedding"] += 1
            if isinstance(m, QuantLinear):
                layers += 1
                arithmetics.add(m.arithmetic)
            held[m.weight.data_ptr()] = m.weight.numel()
    arithmetic = None if not arithmetics else arithmetics.pop() if len(arithmetics) == 1 else "mixed"
    return {
        "layers": layers,
        "formats": dict(sorted(formats.items())),
        "bytes": sum(held.values()),
        "packed_bytes": packed,
        "arithmetic": arithmetic,
    }


# The formats the gguf package can quantize to (its quantize_blocks); the K-quants it only dequantizes.
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def quantize_linear(layer: nn.Linear, fmt: str = "Q8_0") -> QuantLinear:
    """A :class:`QuantLinear` holding ``layer``'s fp32 or bf16 weight quantized to ``fmt`` by the ``gguf`` package
    (ggml's own rounding; Q8_0 bit for bit), with its bias in fp32. It computes exactly what the fp32 kernel
    computes on the dequantized weight, not on the original one."""
    if fmt not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {fmt!r}; the gguf package quantizes to {', '.join(QUANTIZABLE)}")
    from gguf import GGMLQuantizationType, quants

    target = FORMATS[fmt]
    weight = layer.weight.detach()
    if weight.shape[1] % target.elements:
        raise ValueError(f"{fmt} needs in_features to be a multiple of {target.elements}, got {weight.shape[1]}")
    blocks = quants.quantize(weight.float().cpu().numpy(), GGMLQuantizationType(target.type))
    return QuantLinear(torch.from_numpy(np.ascontiguousarray(blocks)), target, weight.shape[1], layer.bias)
