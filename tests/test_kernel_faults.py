"""The CPU kernel fails safely: each fault leaves torch's own linears (the same output as without hfspec), at most
one warning per process, and a failed build that is not tried again until the source or the compiler changes."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import kernel_paths
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hfspec.cpu import fast, kernels, toolchain
from hfspec.cpu import plan as kernel_plan

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A process that has loaded no kernel yet, with its own cache; ``fresh.again()`` is the next process."""
    monkeypatch.setenv("HFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HFSPEC_CXX", raising=False)
    monkeypatch.delenv("HFSPEC_KERNELS", raising=False)  # the faults of a build, whether or not the suite runs them
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernel_plan, "_PLANS", {})

    class Fresh:
        cache = tmp_path / "cache"

        @staticmethod
        def again() -> None:
            monkeypatch.setattr(kernels, "_LOADED", {})

    return Fresh


def compiler(tmp_path: Path, body: str, name: str = "cxx") -> tuple[str, Path]:
    """An executable stand-in for the compiler that logs each run to a file and then runs ``body``."""
    log = tmp_path / f"{name}.log"
    script = tmp_path / name
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{body}\n')
    script.chmod(0o755)
    return str(script), log


def runs(log: Path) -> int:
    """Builds the stand-in was asked for: each compiles the first source once (the others go beside it)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(toolchain.SOURCES[0].name in line for line in lines)


def copying(tmp_path: Path, library: kernels.KernelLibrary, pause: float = 0.0) -> tuple[str, Path]:
    """A compiler that 'builds' by copying the library already built (no real compile: fast)."""
    return compiler(
        tmp_path,
        textwrap.dedent(f"""\
        sleep {pause}
        out=""; prev=""
        for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
        cp {library.path} "$out"
        """),
        "copy",
    )


def torch_runs(caplog, says: str) -> str:
    """The kernel is off with a reason that ``says``, a layer keeps torch's linear bit for bit, and hfspec logged at
    most one warning, however often it is asked."""
    layer = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    reference = F.linear(x, layer.weight, layer.bias)
    with caplog.at_level(logging.WARNING, logger="hfspec"):
        first, second = fast.accelerate(layer), fast.accelerate(layer)
    assert first.layers == () and second.reason == first.reason and says in first.reason, first.reason
    assert type(layer) is nn.Linear and torch.equal(layer(x), reference)
    assert kernels.load() is None and says in kernels.build_failure()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("hfspec")]
    assert len(warnings) <= 1, [r.getMessage() for r in warnings]
    caplog.clear()
    return first.reason


def kernel_runs(library: kernels.KernelLibrary) -> None:
    """The kernel loaded, and gives the bits the suite's own build gives."""
    found = kernels.load()
    assert found is not None and found.isa == library.isa
    w, x = torch.randn(9, 40), torch.randn(5, 40)
    assert torch.equal(kernels.linear(found, x, w), kernels.linear(library, x, w))


def test_no_compiler(fresh, caplog, monkeypatch):
    monkeypatch.setenv("HFSPEC_CXX", "/nonexistent/c++")
    torch_runs(caplog, "no C++ compiler '/nonexistent/c++' found")
    assert not list(fresh.cache.glob("kernels/*.failed")), "nothing was built: nothing to remember"


def test_a_failing_compiler_is_remembered_until_it_changes(fresh, caplog, monkeypatch, tmp_path):
    cxx, log = compiler(tmp_path, "echo 'fatal: no space left' >&2; exit 1")
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    torch_runs(caplog, "exited with 1: fatal: no space left")
    assert runs(log) == 1 and len(list(fresh.cache.glob("kernels/*.failed"))) == 1
    fresh.again()  # the next process: told by the marker, without running the compiler
    assert "an earlier build" in torch_runs(caplog, "exited with 1: fatal: no space left") and runs(log) == 1
    fresh.again()  # the compiler changed (reinstalled, upgraded): tried again
    Path(cxx).write_text(Path(cxx).read_text().replace("no space left", "still broken"))
    torch_runs(caplog, "still broken")
    assert runs(log) == 2


def test_a_hung_compiler_is_stopped_and_remembered(fresh, caplog, monkeypatch, tmp_path):
    cxx, log = compiler(tmp_path, "sleep 60 & wait")  # a child of its own keeps the output open: killed too
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    monkeypatch.setattr(toolchain, "BUILD_TIMEOUT_S", 1)
    start = time.perf_counter()
    torch_runs(caplog, "did not finish within 1 s")
    assert time.perf_counter() - start < 15
    fresh.again()
    torch_runs(caplog, "did not finish within 1 s")
    assert runs(log) == 1


def test_a_compiler_that_writes_nothing(fresh, caplog, monkeypatch, tmp_path):
    cxx, _ = compiler(tmp_path, "exit 0")
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    torch_runs(caplog, "wrote no")


def test_a_corrupt_library_is_built_again(fresh, library, caplog, monkeypatch, tmp_path):
    cxx, log = copying(tmp_path, library)
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    path = toolchain.library_path(cxx)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF truncated")
    path.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="hfspec"):
        kernel_runs(library)
    assert runs(log) == 1 and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_unwritable_cache(fresh, caplog, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HFSPEC_CACHE", str(blocker / "cache"))  # no directory can be made under a file
    torch_runs(caplog, "cannot write the kernel cache")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_cache(fresh, caplog, tmp_path):
    fresh.cache.mkdir()
    fresh.cache.chmod(0o555)
    try:
        torch_runs(caplog, "cannot write the kernel cache")
    finally:
        fresh.cache.chmod(0o755)


def test_a_cache_of_another_user_is_refused(fresh, library, caplog, monkeypatch, tmp_path):
    cxx, log = copying(tmp_path, library)
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    kernel_runs(library)  # a good library in the cache
    fresh.again()
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # the same files, seen by another user
    torch_runs(caplog, "belongs to another user")


@pytest.mark.parametrize("where", ["cache", "kernels", "library"])
def test_a_cache_others_can_write_to_is_refused(fresh, library, caplog, monkeypatch, tmp_path, where):
    cxx, log = copying(tmp_path, library)
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    kernel_runs(library)
    fresh.again()
    path = {"cache": fresh.cache, "kernels": fresh.cache / "kernels", "library": toolchain.library_path(cxx)}[where]
    path.chmod(path.stat().st_mode | stat.S_IWOTH)
    torch_runs(caplog, "writable by group and others")
    assert runs(log) == 1, "nothing built either"


def test_files_it_makes_are_not_writable_by_others_whatever_the_umask(fresh, library, monkeypatch, tmp_path):
    cxx, _ = copying(tmp_path, library)
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    old = os.umask(0o000)
    try:
        kernel_runs(library)
    finally:
        os.umask(old)
    for path in [fresh.cache, *fresh.cache.rglob("*")]:
        assert not path.stat().st_mode & 0o022, path


@pytest.mark.parametrize(
    "system,machine,says",
    [
        ("Linux", "aarch64", "this CPU (aarch64) has no vector path"),
        ("Darwin", "arm64", "this CPU (arm64) has no vector path"),
        ("Darwin", "x86_64", "is Apple clang, which has no OpenMP"),
    ],
)
def test_platforms_without_a_build_are_told_why_before_any_compile(
    fresh, caplog, monkeypatch, tmp_path, system, machine, says
):
    cxx, log = compiler(tmp_path, 'case "$1" in --version) echo "Apple clang version 15.0.0";; *) exit 1;; esac')
    monkeypatch.setenv("HFSPEC_CXX", cxx)
    monkeypatch.setattr(toolchain.platform, "system", lambda: system)
    monkeypatch.setattr(toolchain.platform, "machine", lambda: machine)
    torch_runs(caplog, says)
    assert [line for line in (log.read_text().splitlines() if log.exists() else []) if line != "--version"] == []


def unity_build(sources: list[Path], flags: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Compile ``sources`` as one translation unit with ``flags`` (to assembly, thrown away): the system headers and
    ``vec.h`` once, each source in a namespace of its own. Parsing <immintrin.h> is most of a -O0 compile, so one
    unit checks all sources in a fifth of the time; an intrinsic its guard does not allow fails the same way."""
    headers = sorted(
        {line.strip() for f in (*sources, *toolchain.HEADERS) for line in f.read_text().splitlines()
         if line.startswith("#include <")}
    )  # fmt: skip
    unit = tmp_path / "unity.cpp"
    unit.write_text(
        "\n".join(
            [*headers, *(f'#include "{h}"' for h in toolchain.HEADERS)]
            + [f'namespace unit_{s.stem} {{\n#include "{s}"\n}}' for s in sources]
        )
        + "\n"
    )
    command = ["g++", "-O0", "-march=x86-64", *flags.split(), "-fopenmp", "-std=c++17", "-fPIC", "-S"]
    return subprocess.run([*command, "-o", os.devnull, str(unit)], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
@pytest.mark.parametrize(
    "flags",
    ["-mavx512f -mno-avx512bw -mno-avx512vl -mno-avx512dq", "-mavx2 -mfma -mno-avx512f", "-mavx2 -mno-fma", "-mno-avx"],
)
def test_each_vector_path_uses_only_what_its_guard_names(flags, tmp_path):
    # A CPU with AVX-512F but not BW/VL (Xeon Phi), AVX2 with or without FMA, none: each builds what it defines.
    # -O0 is enough: an intrinsic the flags do not allow fails to inline at any level. A pass is kept in the kernel
    # cache under a key of the sources, their headers, the flags and the compiler, as the library is: the same
    # sources are not checked again (the control below always compiles).
    sources = list(toolchain.SOURCES)
    passed = kernel_paths.kept("guards", [*sources, *toolchain.HEADERS], ["g++", *flags.split()], ".ok")
    if passed.is_file():
        return
    proc = unity_build(sources, flags, tmp_path)
    assert proc.returncode == 0, f"the kernel sources with {flags}: {proc.stderr[-1500:]}"
    passed.write_text(flags + "\n")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_guard_check_fails_on_an_intrinsic_its_guard_does_not_name(tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text(
        "#include <immintrin.h>\n#if defined(__AVX2__)\n"
        "static __m256 twice(__m256 a) { return _mm256_fmadd_ps(a, a, a); }  // FMA under an AVX2 guard\n#endif\n"
    )
    assert unity_build([bad], "-mavx2 -mfma", tmp_path).returncode == 0
    proc = unity_build([bad], "-mavx2 -mno-fma", tmp_path)
    assert proc.returncode != 0 and "_mm256_fmadd_ps" in proc.stderr


# The kernel's own modules only (torch, not transformers): each process starts in about 2 s instead of 5.
TWO_PROCESSES = """
import torch
from torch import nn
from hfspec.cpu import kernels, plan
torch.manual_seed(0)
layers = [nn.Linear(64, 96), nn.Linear(96, 64), nn.Linear(64, 96)]
x = torch.randn(5, 64)
library = kernels.load()
shapes = plan.plan_for(library, layers)
with torch.no_grad():
    out = kernels.linear(library, x, layers[0].weight, layers[0].bias, shapes)
print(library.isa, shapes, out.sum().item(), flush=True)
"""


def test_two_processes_building_and_planning_at_once(fresh, library, tmp_path):
    cxx, log = copying(tmp_path, library, pause=1.0)  # the build takes long enough for the second to wait on it
    env = {
        **os.environ,
        "HFSPEC_CACHE": str(fresh.cache),
        "HFSPEC_CXX": cxx,
        "PYTHONPATH": str(ROOT),
        "HFSPEC_KERNEL_PLAN": "timed",
    }
    script = "import logging; logging.basicConfig(level=logging.INFO)\n" + TWO_PROCESSES
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    outs = [out.strip() for out, _ in results]
    assert outs[0] == outs[1] and outs[0].startswith(library.isa), outs
    assert runs(log) == 1, "built once"
    timed = [err.count("timing the CPU kernel's") for _, err in results]
    assert sorted(timed) == [0, 1], "timed once, by one process; the other read its plan"
    assert len(list(fresh.cache.glob("kernels/plan-*.json"))) == 1


# -- kernels.linear checks what it is given ---------------------------------------------------------


def test_a_column_slice_of_a_weight_gives_the_right_numbers(library):
    wide, x = torch.randn(12, 70), torch.randn(4, 30)
    w = wide[:, 20:50]  # rows 70 apart
    torch.testing.assert_close(kernels.linear(library, x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(kernels.linear(library, x, w), kernels.linear(library, x, w.contiguous()))


@pytest.mark.parametrize(
    "bad,error,says",
    [
        (lambda x, w, b: (x.double(), w, b), TypeError, "float32 x"),
        (lambda x, w, b: (x, w.half(), b), TypeError, "bfloat16 weight"),
        (lambda x, w, b: (x, w, b.bfloat16()), TypeError, "bias"),
        (lambda x, w, b: (x[:, :5], w, b), ValueError, "weight (N, K)"),
        (lambda x, w, b: (x, w.t().contiguous().t(), b), ValueError, "unit stride"),
        (lambda x, w, b: (x, w[:1].expand(6, -1), b), ValueError, "do not overlap"),
        (lambda x, w, b: (x.t().contiguous().t(), w, b), ValueError, "unit stride"),
        (lambda x, w, b: (x, w, b[:3]), ValueError, "bias of 6"),
        (lambda x, w, b: (x, w, torch.randn(12)[::2]), ValueError, "contiguous bias"),
        (lambda x, w, b: (x.to("meta"), w, b), ValueError, "CPU"),
    ],
)
def test_bad_arguments_are_refused_before_the_kernel_reads_them(library, bad, error, says):
    x, w, b = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6)
    with pytest.raises(error, match=says.replace("(", r"\(").replace(")", r"\)")):
        kernels.linear(library, *bad(x, w, b))
