"""A kernel source built on its own for the vector paths this CPU's build does not take (-O1: seconds, kept in the
kernel cache for later runs), where the CPU can run them; each path must give the same bits as the native one."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfspec.cpu import kernels, toolchain

AVX2 = (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"})
# AVX-512 with VNNI and without AMX: on a CPU with AMX, the path its native build takes for fewer rows.
AVX512_VNNI = (
    ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"},
)
SCALAR: tuple[list[str], set[str]] = ([], set())


def kept(folder: str, files: list[Path], command: list[str], suffix: str) -> Path:
    """Where a build or check of ``files`` by ``command`` is kept in the kernel cache: a name keyed by the files,
    the command and the compiler's version, as the library's is, so that a change to any of them misses it."""
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join([*(f.read_bytes() for f in files), *map(str.encode, command), compiler.encode()])
    ).hexdigest()[:16]
    where = toolchain.library_path().parent / folder
    where.mkdir(parents=True, exist_ok=True)
    return where / f"{key}{suffix}"


def build(source: Path, paths: dict[str, tuple[list[str], set[str]]], bind: Callable[[Any], Any]) -> dict[str, Any]:
    """``{isa: bind(library)}`` for each of ``paths`` (``isa: (flags, cpu flags it needs)``) this CPU can run,
    compiled in parallel with the flags the library build gives ``source``. Each build is kept in the kernel cache
    under a key of the source, its headers, the flags and the compiler, as the library is: a later run loads it."""
    cpu = set(toolchain.cpu_flags().split())
    common = ["-O1", "-march=x86-64", *toolchain.SOURCE_FLAGS.get(source.name, ())]
    common += ["-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    jobs, found = {}, {}
    for isa, (extra, needs) in paths.items():
        if not needs <= cpu:
            continue
        command = ["g++", *common, *extra]
        path = kept("paths", [source, *toolchain.HEADERS], command, f"-{source.stem}-{isa}.so")
        if not path.is_file():
            staged = path.with_name(f".{path.name}.{os.getpid()}")
            jobs[isa] = (
                path,
                staged,
                subprocess.Popen([*command, "-o", str(staged), str(source)], stderr=subprocess.PIPE, text=True),
            )
        found[isa] = path
    for path, staged, job in jobs.values():
        assert job.wait() == 0, job.stderr.read()[-1500:]
        os.replace(staged, path)
    for isa, path in found.items():
        found[isa] = bind(kernels.KernelLibrary(path, isa, 0.0, (), {}, ctypes.CDLL(str(path))))
        assert found[isa].isa == isa
    return found
