"""Building hfspec's CPU kernel library: the compiler, its flags, the cache key, the cache's safety, the lock.

Every C++ file in ``hfspec/cpu/csrc`` is compiled with the system C++ compiler (``$HFSPEC_CXX``, default ``g++``)
for this CPU into ``$HFSPEC_CACHE/kernels``, keyed by a hash of the sources, the compiler, its flags and the CPU's
flags (:func:`library_path`), under a file lock so that concurrent processes build it once (:func:`build`). What
cannot work is found before any compile (:func:`unsupported`, :func:`unusable`); a failed or hung build
(``BUILD_TIMEOUT_S``) is remembered next to the library (:func:`remember`, :func:`remembered`) and tried again only
when the source or the compiler changes. Code is loaded only from a cache that is this user's and not writable by
group or others (:func:`unsafe`). :mod:`hfspec.cpu.kernels` loads what is built here.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from hfspec.models.paths import cache_dir

try:  # POSIX file locks; elsewhere concurrent first builds are not serialised
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "BUILD_TIMEOUT_S",
    "FLAGS",
    "HEADERS",
    "SOURCES",
    "BuildError",
    "build",
    "compiler",
    "cpu_flags",
    "library_path",
    "locked",
    "remember",
    "remembered",
    "unsafe",
    "unsupported",
    "unusable",
]

# Every C++ file in csrc/ is compiled into the one library (the linears here; other modules bind their own entries
# through KernelLibrary.function).
SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.h")))  # included by them: in the cache key
# -march=native picks AVX-512 or AVX2+FMA for this CPU (the cache key holds the CPU's flags);
# no -ffast-math, so every sum is IEEE fp32 (FMA contraction aside).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Sources whose float steps are a definition to match bit for bit, each product and sum rounded on its own: the
# compiler may not fuse them into FMAs (GCC's default -ffp-contract=fast would).
SOURCE_FLAGS = {"int8.cpp": ("-ffp-contract=off",), "norm_rope.cpp": ("-ffp-contract=off",)}
BUILD_TIMEOUT_S = 120


def compiler() -> str:
    """The C++ compiler to build with: ``$HFSPEC_CXX`` if set, else ``g++``."""
    return os.environ.get("HFSPEC_CXX") or "g++"


def cpu_flags() -> str:
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
                cpu_flags().encode(),
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


def remembered(path: Path, cxx: str) -> str | None:
    """The reason an earlier build of ``path`` with this very compiler failed, if one did."""
    try:
        marker = json.loads(path.with_suffix(".failed").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("identity") != _identity(cxx) or unsafe(path.with_suffix(".failed")):
        return None
    return str(marker.get("reason"))


def remember(path: Path, cxx: str, reason: str) -> None:
    """Write down that building ``path`` with ``cxx`` failed, so that other processes do not try again."""
    marker = path.with_suffix(".failed")
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"compiler": cxx, "identity": _identity(cxx), "reason": reason}))
        os.chmod(tmp, 0o644)
        os.replace(tmp, marker)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache: every process finds out for itself


def unsupported() -> str | None:
    """Why the kernel cannot pay on this CPU, found before any compile."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "x86", "i386", "i686"):
        return f"this CPU ({platform.machine()}) has no vector path in the kernel (it has AVX2 and AVX-512 ones)"
    flags = set(cpu_flags().split())
    if Path("/proc/cpuinfo").is_file() and not ({"avx2", "fma"} <= flags or "avx512f" in flags):
        return "this CPU has neither AVX2+FMA nor AVX-512: the kernel would be scalar, slower than torch's own"
    return None


def unusable(cxx: str) -> str | None:
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
