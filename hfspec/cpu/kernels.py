"""hfspec's CPU linear kernel: built from ``hfspec/cpu/csrc/*.cpp`` at first use and loaded with ctypes.

A decoding step (one row) or the verification of k drafts (k + 1 rows) on CPU is bound by streaming the weights
from memory once, but torch's small-M GEMMs run far below that bound. The kernel streams each
block of weight rows once and uses it for every input row (see the C++ file), so k + 1 rows cost about
what one costs. It is compiled with the system C++ compiler (``$HFSPEC_CXX``, default ``g++``) for this
CPU into ``$HFSPEC_CACHE/kernels`` (default ``~/.cache/hfspec``), keyed by a hash of the source, the
compiler, its flags and the CPU's flags, under a file lock so that concurrent processes build it once.

It fails safely: wherever it cannot run, :func:`load` logs one warning saying why and returns ``None``, and callers
keep torch's own ``F.linear`` (the same output as without hfspec). Before any compile, a CPU without AVX2+FMA or
AVX-512 (ARM, old x86: the kernel would be scalar, slower than torch), a missing compiler and Apple's clang (no
OpenMP) are refused. A failed or hung build (``BUILD_TIMEOUT_S``) is remembered next to the library
(``linear-*.failed``, with its reason) and tried again only when the source or the compiler changes (delete the file
to try now). Code is loaded only from a cache that is this user's and not writable by group or others; a library
that does not load (a truncated file) is built again once.

The library offers a few block shapes (rows by weight rows, :attr:`KernelLibrary.shapes`); every one gives
the same bits. A *plan* says which to use for M rows (``plan[min(M, len(plan) - 1)]``): :func:`default_plan`
before anything is measured, :mod:`hfspec.cpu.plan` once the shapes were timed on a model's own layers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hfspec.models.paths import cache_dir

try:  # POSIX file locks; elsewhere concurrent first builds are not serialised
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "PLAN_ROWS",
    "KernelLibrary",
    "build",
    "build_failure",
    "compiler",
    "default_plan",
    "library_path",
    "linear",
    "linear_unchecked",
    "load",
    "locked",
    "unsafe",
]

log = logging.getLogger(__name__)

# Every C++ file in csrc/ is compiled into the one library (the linears here; other modules bind their own entries
# through KernelLibrary.function).
SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.h")))  # included by them: in the cache key
# -march=native picks AVX-512 or AVX2+FMA for this CPU (the cache key holds the CPU's flags);
# no -ffast-math, so every sum is IEEE fp32 (FMA contraction aside).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Sources whose float steps are a definition to match bit for bit, each product and sum rounded on its own: the
# compiler may not fuse them into FMAs (GCC's default -ffp-contract=fast would).
SOURCE_FLAGS = {"int8.cpp": ("-ffp-contract=off",)}
BUILD_TIMEOUT_S = 120

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
    key = hashlib.sha256(
        b"\0".join(
            [
                *(s.read_bytes() for s in SOURCES + HEADERS),
                cxx.encode(),
                " ".join(FLAGS).encode(),
                json.dumps(SOURCE_FLAGS, sort_keys=True).encode(),
                _cpu_flags().encode(),
            ]
        )
    ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"linear-{key}.so"


class BuildError(RuntimeError):
    """The compiler failed, hung or could not run: remembered per source and compiler (``_remember``)."""


def unsafe(path: Path) -> str | None:
    """Why ``path`` (the cache, or a file in it) cannot be trusted to hold code this process loads: it belongs to
    another user or is writable by group or others (anyone who can write there could plant a library). None if it
    is safe, or absent."""
    if not hasattr(os, "geteuid"):  # pragma: no cover - Windows: no owners and modes to check
        return None
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if st.st_uid != os.geteuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return (
            f"{path} is writable by {'group and others' if st.st_mode & 0o002 else 'its group'} "
            f"(mode {oct(st.st_mode & 0o777)}); chmod go-w it, or set HFSPEC_CACHE to a directory of your own"
        )
    return None


def _private_dir(path: Path) -> None:
    """Make ``path`` and its missing parents, writable by this user only (whatever the umask lets others do)."""
    for part in reversed([path, *path.parents]):
        if not part.exists():
            os.mkdir(part, 0o755)


@contextlib.contextmanager
def locked(path: Path, required: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if absent), e.g. while building or timing, so that
    concurrent processes take turns. Where there are no POSIX locks, or (``required=False``) the file cannot be
    made (a read-only cache), nothing is held."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError:
        if required:
            raise
        yield
        return
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _compile(cxx: str, out: Path) -> None:
    """Compile every source to an object file, as many at once as there are cores (quant.cpp alone takes about as
    long as the rest), then link them into ``out``. Each compiler runs in a process group of its own, so that a hung
    one is ended with everything it started; all share one deadline."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    objects = [out.with_name(f"{out.name}.{source.stem}.o") for source in SOURCES]
    jobs = [
        [cxx, *FLAGS, *SOURCE_FLAGS.get(source.name, ()), "-c", "-o", str(obj), str(source)]
        for source, obj in zip(SOURCES, objects)
    ]
    try:
        running: list[subprocess.Popen] = []
        for job in jobs:
            if len(running) >= max(1, os.cpu_count() or 1):
                _finish(running.pop(0), cxx, deadline, running)
            running.append(
                subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            )
        while running:
            _finish(running.pop(0), cxx, deadline, running)
        missing = [obj.name for obj in objects if not obj.is_file()]
        if missing:
            raise BuildError(f"{cxx} exited with 0 but wrote no object file ({', '.join(missing)})")
        link = subprocess.Popen(
            [cxx, *FLAGS, "-o", str(out), *map(str, objects)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        _finish(link, cxx, deadline, [])
    finally:
        for obj in objects:
            obj.unlink(missing_ok=True)


def _finish(proc: subprocess.Popen, cxx: str, deadline: float, others: list[subprocess.Popen]) -> None:
    """Wait for one compiler until the deadline; a failure or a timeout ends ``others`` too."""
    try:
        _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for hung in (proc, *others):
            _kill(hung)
        raise BuildError(f"{cxx} did not finish within {BUILD_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        for other in others:
            _kill(other)
        raise BuildError(f"{cxx} exited with {proc.returncode}: {err.strip()[-500:] or 'no message'}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL) if hasattr(os, "killpg") else proc.kill()
    proc.communicate()


def build(path: Path, cxx: str) -> float:
    """Compile the sources to ``path`` (atomically, under a lock) unless a library that loads is there already; the
    seconds it took. Raises ``BuildError`` when the compiler fails or hangs, ``OSError`` when the cache cannot be
    written."""
    _private_dir(path.parent)
    with locked(path.with_suffix(".lock")):  # another process may be building the same library
        if path.is_file():
            try:
                ctypes.CDLL(str(path))
                return 0.0  # built meanwhile by another process
            except OSError:
                path.unlink()  # a truncated or foreign file: built again below
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        t0 = time.perf_counter()
        try:
            _compile(cxx, tmp)
            if not tmp.is_file():
                raise BuildError(f"{cxx} exited with 0 but wrote no library")
            os.chmod(tmp, 0o755)  # not writable by others, whatever the umask
            os.replace(tmp, path)
        except OSError as err:
            if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
                raise
            raise BuildError(f"could not run {cxx} ({err})") from None
        finally:
            tmp.unlink(missing_ok=True)
        return time.perf_counter() - t0


def _identity(cxx: str) -> str:
    """Which compiler ``cxx`` is now: its resolved file, size and modification time (a new install changes it)."""
    found = shutil.which(cxx)
    if found is None:
        return "missing"
    st = os.stat(found)
    return f"{os.path.realpath(found)}:{st.st_size}:{st.st_mtime_ns}"


def _remembered(path: Path, cxx: str) -> str | None:
    """The reason an earlier build of ``path`` with this very compiler failed, if one did."""
    try:
        marker = json.loads(path.with_suffix(".failed").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("identity") != _identity(cxx) or unsafe(path.with_suffix(".failed")):
        return None
    return str(marker.get("reason"))


def _remember(path: Path, cxx: str, reason: str) -> None:
    """Write down that building ``path`` with ``cxx`` failed, so that other processes do not try again."""
    marker = path.with_suffix(".failed")
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"compiler": cxx, "identity": _identity(cxx), "reason": reason}))
        os.chmod(tmp, 0o644)
        os.replace(tmp, marker)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache: every process finds out for itself


def _unsupported() -> str | None:
    """Why the kernel cannot pay on this CPU, found before any compile."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "x86", "i386", "i686"):
        return f"this CPU ({platform.machine()}) has no vector path in the kernel (it has AVX2 and AVX-512 ones)"
    flags = set(_cpu_flags().split())
    if Path("/proc/cpuinfo").is_file() and not ({"avx2", "fma"} <= flags or "avx512f" in flags):
        return "this CPU has neither AVX2+FMA nor AVX-512: the kernel would be scalar, slower than torch's own"
    return None


def _unusable(cxx: str) -> str | None:
    """Why ``cxx`` cannot build the kernel, found without compiling: it is missing, or it is Apple's clang."""
    if shutil.which(cxx) is None:
        return f"no C++ compiler {cxx!r} found; set HFSPEC_CXX to one (g++, or clang++ with OpenMP)"
    if platform.system() == "Darwin":
        try:
            version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            version = ""
        if "Apple clang" in version or "Apple LLVM" in version:
            return (
                f"{cxx!r} is Apple clang, which has no OpenMP (-fopenmp); set HFSPEC_CXX to a GCC (Homebrew's g++-14)"
            )
    return None


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
    why = _unsupported() or unsafe(cache_dir()) or unsafe(path.parent) or unsafe(path)
    if why is not None:
        return why
    if path.is_file():
        try:
            return _open(path, 0.0)
        except (OSError, AttributeError) as err:  # truncated, or not this library: built again under the lock
            log.debug("the cached kernel %s did not load (%s); building it again", path, err)
    why = _unusable(cxx)
    if why is not None:
        return why
    why = _remembered(path, cxx)
    if why is not None:
        return (
            f"{why} (an earlier build; tried again when the source or the compiler changes, or when "
            f"{path.with_suffix('.failed')} is deleted)"
        )
    try:
        seconds = build(path, cxx)
    except BuildError as err:
        _remember(path, cxx, f"cannot build the CPU kernel: {err}")
        return f"cannot build the CPU kernel: {err}"
    except OSError as err:
        return f"cannot write the kernel cache {path.parent} ({err.strerror or err})"
    try:
        return _open(path, seconds)
    except (OSError, AttributeError) as err:
        _remember(path, cxx, f"the CPU kernel built with {cxx!r} does not load ({err})")
        return f"the CPU kernel built with {cxx!r} does not load ({err})"


def load() -> KernelLibrary | None:
    """The kernel library, built on first use; ``None`` (with one warning per process saying why) where it cannot
    run here. It never raises: every fault leaves torch's own linears."""
    cxx = compiler()
    path = library_path(cxx)
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
    found = _LOADED.get(library_path())
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
