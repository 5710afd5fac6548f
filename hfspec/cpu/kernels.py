"""hfspec's CPU linear kernel: built from ``hfspec/cpu/csrc/*.cpp`` at first use and loaded with ctypes.

A decoding step (one row) or the verification of k drafts (k + 1 rows) on CPU is bound by streaming the
weights from memory once, but torch's small-M GEMMs run far below that bound. The kernel streams each
block of weight rows once and uses it for every input row (see the C++ file), so k + 1 rows cost about
what one costs. It is compiled with the system C++ compiler (``$HFSPEC_CXX``, default ``g++``) for this
CPU into ``$HFSPEC_CACHE/kernels`` (default ``~/.cache/hfspec``), keyed by a hash of the source, the
compiler, its flags and the CPU's flags, under a file lock so that concurrent processes build it once.
Where no compiler exists or the build fails, :func:`load` logs one warning and returns ``None``, and
callers keep torch's own ``F.linear``.

The library offers a few block shapes (rows by weight rows, :attr:`KernelLibrary.shapes`); every one gives
the same bits. A *plan* says which to use for M rows (``plan[min(M, len(plan) - 1)]``): :func:`default_plan`
before anything is measured, :mod:`hfspec.cpu.plan` once the shapes were timed on a model's own layers.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hfspec.assets import cache_dir

try:  # POSIX file locks; elsewhere concurrent first builds are not serialised
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["PLAN_ROWS", "KernelLibrary", "build", "build_failure", "compiler", "default_plan", "library_path",
           "linear", "load"]

log = logging.getLogger(__name__)

# Every C++ file in csrc/ is compiled into the one library (the linears here; other modules bind their own entries
# through KernelLibrary.function).
SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.h")))  # included by them: in the cache key
# -march=native picks AVX-512 or AVX2+FMA for this CPU (the cache key holds the CPU's flags);
# no -ffast-math, so every sum is IEEE fp32 (FMA contraction aside).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
BUILD_TIMEOUT_S = 120

# Weight dtypes the kernel reads; inputs, bias and output are fp32 (bf16 activations are widened).
_ENTRY = {torch.float32: "hfspec_linear_f32", torch.bfloat16: "hfspec_linear_bf16w"}
_ARGTYPES = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded kernel: where it lives, the vector ISA it was compiled for, and what building it cost."""

    path: Path
    isa: str                     # "avx512", "avx2" or "scalar"
    build_seconds: float         # 0.0 when it came from the cache
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


def compiler() -> str:
    """The C++ compiler to build with: ``$HFSPEC_CXX`` if set, else ``g++``."""
    return os.environ.get("HFSPEC_CXX") or "g++"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), else the platform's name: part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(cxx: str | None = None) -> Path:
    """Where the library for this source, compiler, flags and CPU is cached."""
    cxx = cxx or compiler()
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in SOURCES + HEADERS), cxx.encode(),
                                     " ".join(FLAGS).encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / "kernels" / f"linear-{key}.so"


def build(path: Path, cxx: str) -> float:
    """Compile the sources to ``path`` (atomically, under a lock) unless it exists; the seconds it took."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if path.is_file():
            return 0.0
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([cxx, *FLAGS, "-o", str(tmp), *map(str, SOURCES)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"{cxx} exited with {proc.returncode}: {proc.stderr.strip()[-500:]}")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return time.perf_counter() - t0


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
    return KernelLibrary(path=path, isa=lib.hfspec_isa().decode(), build_seconds=seconds, shapes=tuple(shapes),
                         entries=entries, handle=lib)


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


def load() -> KernelLibrary | None:
    """The kernel library, built on first use; ``None`` (with one warning) where it cannot be built."""
    cxx = compiler()
    path = library_path(cxx)
    if path not in _LOADED:
        try:
            _LOADED[path] = _open(path, build(path, cxx))
            log.info("hfspec kernel %s (%s) ready", path, _LOADED[path].isa)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
            _LOADED[path] = f"cannot build the CPU kernel with {cxx!r} ({err}); using torch's linear"
            log.warning("%s; set HFSPEC_CXX to a working C++ compiler to use it", _LOADED[path])
    found = _LOADED[path]
    return found if isinstance(found, KernelLibrary) else None


def build_failure() -> str | None:
    """Why the kernel for the current compiler could not be built, or ``None`` if it could (or was not tried)."""
    found = _LOADED.get(library_path())
    return found if isinstance(found, str) else None


def linear(library: KernelLibrary, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None, plan: tuple[int, ...] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for fp32 ``x`` (M, K) or (..., K) on CPU, with an fp32 or bf16 ``weight`` (N, K),
    in the block shape ``plan`` names for M rows (by default :func:`default_plan`'s).

    ``weight`` needs unit stride along K; ``x`` too, and its rows evenly spaced (any 2-D slice of
    rows, or a contiguous tensor of more dimensions); ``bias`` is fp32 and contiguous. The caller
    checks the device and dtypes (see :mod:`hfspec.cpu.fast`); the output is a new contiguous fp32
    tensor (..., N). It runs a few hundred times per decoding step, so it checks little.
    """
    k, n = x.shape[-1], weight.shape[0]
    if weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(1) != 1 or (x.dim() != 2 and not x.is_contiguous()):
        raise ValueError(f"linear needs x (M, K) and weight (N, K) with unit stride along K; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}: pass .contiguous() tensors")
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    m = x.numel() // k
    plan = plan or default_plan(library)
    library.entries[weight.dtype](plan[min(m, len(plan) - 1)], x.data_ptr(), x.stride(0) if x.dim() == 2 else k,
                                  weight.data_ptr(), k, None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                                  m, n, k, torch.get_num_threads())
    return out
