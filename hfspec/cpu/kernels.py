"""hfspec's CPU linear kernel: built from ``hfspec/cpu/csrc/*.cpp`` at first use and loaded with ctypes.

A decoding step (one row) or the verification of k drafts (k + 1 rows) on CPU is bound by streaming the weights
from memory once, but torch's small-M GEMMs run far below that bound. The kernel streams each
block of weight rows once and uses it for every input row (see the C++ file), so k + 1 rows cost about
what one costs. It is compiled with the system C++ compiler for this CPU into
``$HFSPEC_CACHE/kernels`` (default ``~/.cache/hfspec``), once, by :mod:`hfspec.cpu.toolchain`.

It fails safely: wherever it cannot run, :func:`load` logs one warning saying why and returns ``None``, and callers
keep torch's own ``F.linear`` (the same output as without hfspec). Before any compile, a CPU without AVX2+FMA or
AVX-512 (ARM, old x86: the kernel would be scalar, slower than torch), a missing compiler and Apple's clang (no
OpenMP) are refused. A failed or hung build (``toolchain.BUILD_TIMEOUT_S``) is remembered next to the library
(``linear-*.failed``, with its reason) and tried again only when the source or the compiler changes (delete the file
to try now). Code is loaded only from a cache that is this user's and not writable by group or others; a library
that does not load (a truncated file) is built again once.

The library offers a few block shapes (rows by weight rows, :attr:`KernelLibrary.shapes`); every one gives
the same bits. A *plan* says which to use for M rows (``plan[min(M, len(plan) - 1)]``): :func:`default_plan`
before anything is measured, :mod:`hfspec.cpu.plan` once the shapes were timed on a model's own layers.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hfspec.cpu import toolchain
from hfspec.models.paths import cache_dir

__all__ = ["PLAN_ROWS", "KernelLibrary", "build_failure", "default_plan", "linear", "linear_unchecked", "load"]

log = logging.getLogger(__name__)

# Weight dtypes the kernel reads; inputs, bias and output are fp32 (bf16 activations are widened).
_ENTRY = {torch.float32: "hfspec_linear_f32", torch.bfloat16: "hfspec_linear_bf16w"}
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


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded kernel: where it lives, the vector ISA it was compiled for, and what building it cost."""

    path: Path
    isa: str  # "avx512", "avx2" or "scalar"
    build_seconds: float  # 0.0 when it came from the cache
    shapes: tuple[tuple[int, int], ...]  # (rows, weight rows) per block, by shape index
    entries: dict = field(repr=False, compare=False)  # weight dtype -> ctypes function
    handle: ctypes.CDLL | None = field(default=None, repr=False, compare=False)  # the loaded library itself

    def __deepcopy__(self, memo: dict) -> KernelLibrary:
        return self  # a loaded shared library is process state, not data

    def function(self, name: str, argtypes: list, restype: object = None) -> ctypes._CFuncPtr:
        """The library's C entry ``name`` with its argument and result types set (for modules beside the linears)."""
        fn = getattr(self.handle, name)
        fn.argtypes, fn.restype = argtypes, restype
        return fn


# Per process and per library path: the loaded library, or the reason it could not be built.
_LOADED: dict[Path, KernelLibrary | str] = {}


def _open(path: Path, seconds: float) -> KernelLibrary:
    lib = ctypes.CDLL(str(path))  # torch is imported first, so its OpenMP runtime is the one shared
    lib.hfspec_isa.restype = ctypes.c_char_p
    entries = {}
    for dtype, name in _ENTRY.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, _ARGTYPES
        entries[dtype] = fn
    shapes = []
    for i in range(lib.hfspec_shape_count()):
        mb, nb = ctypes.c_int(), ctypes.c_int()
        lib.hfspec_shape(i, ctypes.byref(mb), ctypes.byref(nb))
        shapes.append((mb.value, nb.value))
    return KernelLibrary(
        path=path,
        isa=lib.hfspec_isa().decode(),
        build_seconds=seconds,
        shapes=tuple(shapes),
        entries=entries,
        handle=lib,
    )


# Plans cover 0..PLAN_ROWS rows one by one; the last entry serves every larger call (prompts).
PLAN_ROWS = 48


@functools.cache
def default_plan(library: KernelLibrary) -> tuple[int, ...]:
    """The shape per row count before any timing: what measured best on one AMD EPYC with AVX-512 (1-2 rows
    one weight row at a time; 9-12 rows one pass of 12 over 2 weight rows; otherwise passes of up to 8 over 3),
    and the one AVX2 shape that was measured (2 rows over 4 weight rows)."""
    index = {shape: i for i, shape in enumerate(library.shapes)}
    if library.isa != "avx512":
        return (index.get((2, 4), 0),) * (PLAN_ROWS + 1)
    return tuple(index[(16, 1) if m <= 2 else (12, 2) if 9 <= m <= 12 else (8, 3)] for m in range(PLAN_ROWS + 1))


def _load(path: Path, cxx: str) -> KernelLibrary | str:
    """The library at ``path``, built if need be, or why it cannot run here."""
    why = (
        toolchain.unsupported()
        or toolchain.unsafe(cache_dir())
        or toolchain.unsafe(path.parent)
        or toolchain.unsafe(path)
    )
    if why is not None:
        return why
    if path.is_file():
        try:
            return _open(path, 0.0)
        except (OSError, AttributeError) as err:  # truncated, or not this library: built again under the lock
            log.debug("the cached kernel %s did not load (%s); building it again", path, err)
    why = toolchain.unusable(cxx)
    if why is not None:
        return why
    why = toolchain.remembered(path, cxx)
    if why is not None:
        return (
            f"{why} (an earlier build; tried again when the source or the compiler changes, or when "
            f"{path.with_suffix('.failed')} is deleted)"
        )
    try:
        seconds = toolchain.build(path, cxx)
    except toolchain.BuildError as err:
        toolchain.remember(path, cxx, f"cannot build the CPU kernel: {err}")
        return f"cannot build the CPU kernel: {err}"
    except OSError as err:
        return f"cannot write the kernel cache {path.parent} ({err.strerror or err})"
    try:
        return _open(path, seconds)
    except (OSError, AttributeError) as err:
        toolchain.remember(path, cxx, f"the CPU kernel built with {cxx!r} does not load ({err})")
        return f"the CPU kernel built with {cxx!r} does not load ({err})"


def load() -> KernelLibrary | None:
    """The kernel library, built on first use; ``None`` (with one warning per process saying why) where it cannot
    run here. It never raises: every fault leaves torch's own linears."""
    cxx = toolchain.compiler()
    path = toolchain.library_path(cxx)
    if path not in _LOADED:
        try:
            _LOADED[path] = _load(path, cxx)
        except OSError as err:  # the cache cannot be read: whatever it is, torch's linears run
            _LOADED[path] = f"cannot use the kernel cache {path.parent} ({err})"
        if isinstance(_LOADED[path], KernelLibrary):
            log.info("hfspec kernel %s (%s) ready", path, _LOADED[path].isa)
        else:
            log.warning("hfspec: CPU kernel off: %s; torch's linears run", _LOADED[path])
    found = _LOADED[path]
    return found if isinstance(found, KernelLibrary) else None


def build_failure() -> str | None:
    """Why the kernel for the current compiler could not be built, or ``None`` if it could (or was not tried)."""
    found = _LOADED.get(toolchain.library_path())
    return found if isinstance(found, str) else None


def linear(
    library: KernelLibrary,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for fp32 ``x`` (M, K) or (..., K) on CPU, with an fp32 or bf16 ``weight`` (N, K),
    in the block shape ``plan`` names for M rows (by default :func:`default_plan`'s); a new contiguous fp32 tensor
    (..., N).

    ``weight`` needs unit stride along K (its rows may be spaced apart: a slice of columns); ``x`` too, and its
    rows evenly spaced (any 2-D slice of rows, or a contiguous tensor of more dimensions); ``bias`` is fp32,
    contiguous, of N values. Anything else is refused with a ``ValueError`` (or ``TypeError``) before the kernel
    reads a byte: a few attribute checks, cheap next to the call. :class:`hfspec.cpu.fast.FastLinear`, which
    checks its own layers, calls :func:`linear_unchecked`.
    """
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        raise ValueError(
            f"linear runs on CPU tensors; got x on {x.device}, weight on {weight.device}"
            + ("" if bias is None else f", bias on {bias.device}")
        )
    if x.dtype != torch.float32 or weight.dtype not in _ENTRY or (bias is not None and bias.dtype != torch.float32):
        raise TypeError(
            f"linear takes float32 x and bias and a float32 or bfloat16 weight; got x {x.dtype}, weight "
            f"{weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}")
        )
    k = x.shape[-1] if x.dim() else 0
    if weight.dim() != 2 or weight.shape[1] != k or k == 0 or x.dim() == 0:
        raise ValueError(
            f"linear needs x (..., K) and weight (N, K) with K > 0; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if (
        x.stride(-1) != 1
        or weight.stride(1) != 1
        or weight.stride(0) < k
        and weight.shape[0] > 1
        or (x.dim() > 2 and not x.is_contiguous())
        or (x.dim() == 2 and x.stride(0) < k and x.shape[0] > 1)
    ):
        raise ValueError(
            f"linear needs x and weight with unit stride along K and rows that do not overlap; got "
            f"strides {x.stride()} and {weight.stride()}: pass .contiguous() tensors"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"linear needs a contiguous bias of {weight.shape[0]} values, got {tuple(bias.shape)}")
    return linear_unchecked(library, x, weight, bias, plan)


def linear_unchecked(
    library: KernelLibrary,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """:func:`linear` without its checks, for callers that made them (it runs a few hundred times per step)."""
    k, n = x.shape[-1], weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    m = x.numel() // k
    plan = plan or default_plan(library)
    library.entries[weight.dtype](
        plan[min(m, len(plan) - 1)],
        x.data_ptr(),
        x.stride(0) if x.dim() == 2 else k,
        weight.data_ptr(),
        weight.stride(0),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return out
