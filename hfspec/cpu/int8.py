"""GGUF linears in llama.cpp's integer arithmetic on hfspec's CPU kernel (``csrc/int8.cpp``).

Each input row is quantized on its own to 8-bit codes (Q8_K beside the K-quants, Q8_0/Q8_1 beside the others, as
ggml pairs them), multiplied with the file's weight codes in integers, and scaled in fp32 in one fixed order per
output (:mod:`hfspec.cpu.int8_reference` defines every bit). So a row's output does not depend on the rows beside
it, their count or the thread count, and speculative decoding over such a target gives exactly its plain
decoding. Where the kernel cannot run, :func:`linear` computes the reference in torch (the same bits, slowly).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch

from hfspec.cpu import int8_reference, kernels

__all__ = ["ARITHMETICS", "Int8Kernel", "Packed", "check_arithmetic", "kernel", "linear", "pack"]

# The arithmetics a quantized layer runs in: llama.cpp's integer one, or float32 on the dequantized weights.
ARITHMETICS = ("int8", "float32")


def check_arithmetic(arithmetic: str) -> str:
    """``arithmetic`` if it is one of :data:`ARITHMETICS`, else a ``ValueError`` that names them."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(
            f"arithmetic must be 'int8' (llama.cpp's integer arithmetic on the GGUF blocks) or 'float32' (the "
            f"dequantized model's), got {arithmetic!r}"
        )
    return arithmetic


class Int8Kernel:
    """The library's int8 entry and the ISA it was built for."""

    def __init__(self, library: kernels.KernelLibrary):
        self.isa = library.function("hfspec_int8_isa", [], ctypes.c_char_p)().decode()
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.entry = library.function(
            "hfspec_int8_linear",
            [ctypes.c_int, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int],
            ctypes.c_int,
        )
        self.packed_bytes = library.function("hfspec_int8_packed_bytes", [ctypes.c_int, i64, i64], i64)
        self.pack_entry = library.function(
            "hfspec_int8_pack", [ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int], ctypes.c_int
        )
        self.packed_entry = library.function(
            "hfspec_int8_linear_packed",
            [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int],
            ctypes.c_int,
        )

        self._amx = library.function("hfspec_int8_amx", [ctypes.c_int], ctypes.c_int)

    @property
    def amx(self) -> bool:
        """Whether K-quant layers run several rows on AMX tiles here (same bits as without)."""
        return bool(self._amx(-1))

    def use_amx(self, on: bool) -> bool:
        """Turn the AMX path on or off for this process (where the CPU and build have it); whether it is on."""
        return bool(self._amx(int(on)))

    def __deepcopy__(self, memo: dict) -> Int8Kernel:
        return self  # process state, as the library


@functools.cache
def _bind(library: kernels.KernelLibrary) -> Int8Kernel:
    return Int8Kernel(library)


def kernel() -> Int8Kernel | None:
    """The int8 kernel, or None where hfspec's CPU kernel is off or cannot be built."""
    library = kernels.load()
    return None if library is None else _bind(library)


@dataclasses.dataclass(frozen=True)
class Packed:
    """A layer's weight blocks rewritten once into the layout this build's kernel reads fastest (on AVX2, every format:
    8 output columns interleaved; the K-quants' scales unpacked to bytes and ``d`` widened to fp32; ``csrc/int8.cpp``).
    The same numbers: the kernel gives the same bits from it as from the blocks."""

    data: torch.Tensor
    ggml_type: int
    n: int
    k: int


def pack(blocks: torch.Tensor, ggml_type: int, k: int, kernel: Int8Kernel | None) -> Packed | None:
    """``blocks`` (N, bytes per row) repacked for ``kernel``, or None where it reads this format as stored."""
    if kernel is None or not blocks.is_cpu or blocks.stride(1) != 1:
        return None
    n = blocks.shape[0]
    size = kernel.packed_bytes(ggml_type, n, k)
    if size <= 0:
        return None
    data = torch.empty(size, dtype=torch.uint8)
    if not kernel.pack_entry(
        ggml_type, blocks.data_ptr(), blocks.stride(0), n, k, data.data_ptr(), torch.get_num_threads()
    ):
        return None
    return Packed(data, ggml_type, n, k)


def linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    fmt: str,
    ggml_type: int,
    bias: torch.Tensor | None = None,
    kernel: Int8Kernel | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """``x`` (..., K) times the ``fmt`` weight in ``blocks`` (N, bytes per row, unit stride along a row) in integer
    arithmetic, plus ``bias`` (fp32, N): fp32 (..., N). On ``kernel`` where given (reading ``packed``, the same
    blocks repacked by :func:`pack`, where given), else in torch."""
    k, n = x.shape[-1], blocks.shape[0]
    x2 = x if x.dtype is torch.float32 and x.is_contiguous() else x.float().contiguous()  # the decoding path: as is
    if kernel is None or not (x2.is_cpu and blocks.is_cpu) or blocks.stride(1) != 1:
        out = int8_reference.linear(x2.reshape(-1, k).cpu(), blocks.cpu(), fmt, None if bias is None else bias.cpu())
        return out.to(x.device).reshape(*x.shape[:-1], n)
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    if packed is None:
        entry, weights, missing = kernel.entry, (blocks.data_ptr(), blocks.stride(0)), "does not read"
    elif (packed.ggml_type, packed.n, packed.k) != (ggml_type, n, k):
        raise ValueError(f"packed weights of {packed.n}x{packed.k} do not hold this {fmt} weight of {n}x{k}")
    else:
        entry, weights, missing = kernel.packed_entry, (packed.data.data_ptr(),), "has no packed path for"
    bias_ptr = None if bias is None else bias.data_ptr()
    rows = x2.numel() // k
    if not entry(
        ggml_type, x2.data_ptr(), k, *weights, bias_ptr, out.data_ptr(), n, rows, n, k, torch.get_num_threads()
    ):
        raise ValueError(f"the int8 kernel {missing} {fmt} rows of {k} weights")
    return out
