"""A kernel source built on its own for the vector paths this CPU's build does not take (-O1: seconds), where the
CPU can run them; each path must give the same bits as the native one."""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfspec.cpu import kernels, toolchain

AVX2 = (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"})
SCALAR: tuple[list[str], set[str]] = ([], set())


def build(
    source: Path, paths: dict[str, tuple[list[str], set[str]]], out: Path, bind: Callable[[Any], Any]
) -> dict[str, Any]:
    """``{isa: bind(library)}`` for each of ``paths`` (``isa: (flags, cpu flags it needs)``) this CPU can run,
    compiled in parallel with the flags the library build gives ``source``."""
    cpu = set(toolchain.cpu_flags().split())
    common = ["-O1", "-march=x86-64", *toolchain.SOURCE_FLAGS.get(source.name, ())]
    common += ["-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    jobs = {
        isa: subprocess.Popen(
            ["g++", *common, *extra, "-o", str(out / f"{isa}.so"), str(source)], stderr=subprocess.PIPE, text=True
        )
        for isa, (extra, needs) in paths.items()
        if needs <= cpu
    }
    found = {}
    for isa, job in jobs.items():
        assert job.wait() == 0, job.stderr.read()[-1500:]
        path = out / f"{isa}.so"
        found[isa] = bind(kernels.KernelLibrary(path, isa, 0.0, (), {}, ctypes.CDLL(str(path))))
        assert found[isa].isa == isa
    return found
