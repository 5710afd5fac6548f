"""Build llama.cpp's own tools (llama-bench, llama-speculative-simple, llama-server, llama-perplexity) from a pinned
registry sdist.

llama.cpp is the CPU reference line the benchmarks compare hfspec against; it is never a dependency of hfspec.
This script downloads the source distribution of ``llama-cpp-python==VERSION`` with pip (``--no-binary :all:``),
checks its sha256 against the constant pinned below, unpacks it into
``${HFSPEC_CACHE:-~/.cache/hfspec}/llama.cpp/VERSION``, configures the vendored llama.cpp with cmake and ninja and
builds only these four tools. A second run reuses the download, the tree and the build (ninja rebuilds nothing).
Its standard output is one line, the folder holding the binaries; everything else goes to standard error.

``--portable`` configures without ``-march=native`` (AVX-512 and VNNI on, AMX and AVX512-BF16 off): use it where a
native build dies with an illegal instruction, or with a general protection fault in its AMX code (seen on a
Sapphire Rapids Xeon, for any forward of 2 or more tokens). The full build takes about 10 minutes on 2 cores.

    python scripts/build_llama_cpp.py                 # build (or reuse) and print the bin folder
    python scripts/build_llama_cpp.py --jobs 1        # gentler on a shared machine
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
# sha256 of llama_cpp_python-0.3.36.tar.gz as the registry serves it.
SDIST_SHA256 = {"0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
TARGETS = ("llama-bench", "llama-speculative-simple", "llama-server", "llama-perplexity")
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # otherwise it downloads a web UI
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
NATIVE_FLAGS = ("-DGGML_NATIVE=ON",)
PORTABLE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON",
    "-DGGML_AVX512_VNNI=ON",
    "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)


def cache_root() -> Path:
    return Path(os.environ.get("HFSPEC_CACHE", "~/.cache/hfspec")).expanduser() / "llama.cpp"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(version: str, folder: Path) -> Path:
    """The sdist in ``folder``, downloaded once and checked against the pinned hash every time."""
    sdist = folder / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
                + [f"llama-cpp-python=={version}", "-d", tmp]
            )
            os.replace(Path(tmp) / sdist.name, sdist)
    got = sha256(sdist)
    if got != SDIST_SHA256[version]:
        sdist.unlink()
        sys.exit(f"sha256 of {sdist.name} is {got}, expected {SDIST_SHA256[version]}: download removed, run again")
    return sdist


def unpack(sdist: Path, folder: Path) -> Path:
    """The vendored llama.cpp tree, unpacked once (a marker file says the unpacking finished)."""
    source = folder / "src"
    done = folder / ".unpacked"
    if not done.exists():
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(sdist) as tar, tempfile.TemporaryDirectory(dir=folder) as tmp:
            tar.extractall(tmp, filter="data")
            (top,) = Path(tmp).iterdir()
            os.replace(top, source)
        done.write_text(sdist.name + "\n")
    return source / "vendor" / "llama.cpp"


def run(cmd: list[str], nice: int = 0) -> None:
    if nice:
        cmd = ["nice", "-n", str(nice)] + cmd
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def build(llama: Path, build_dir: Path, portable: bool, jobs: int | None, nice: int) -> Path:
    flags = PORTABLE_FLAGS if portable else NATIVE_FLAGS
    if not (build_dir / "build.ninja").exists():
        run(["cmake", "-S", str(llama), "-B", str(build_dir), "-G", "Ninja", *COMMON_FLAGS, *flags])
    run(["ninja", "-C", str(build_dir), *(["-j", str(jobs)] if jobs else []), *TARGETS], nice=nice)
    return build_dir / "bin"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=VERSION, choices=sorted(SDIST_SHA256), help=f"default: {VERSION}")
    parser.add_argument("--portable", action="store_true", help="no -march=native (AVX-512 VNNI, no AMX/BF16)")
    parser.add_argument("--jobs", type=int, default=None, help="ninja -j (default: ninja's choice)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the compile (default: 10)")
    args = parser.parse_args()
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on PATH: install it (e.g. apt-get install cmake ninja-build)")
    folder = cache_root() / args.version
    start = time.perf_counter()
    llama = unpack(download(args.version, folder), folder)
    build_dir = folder / ("build-portable" if args.portable else "build")
    bin_dir = build(llama, build_dir, args.portable, args.jobs, args.nice)
    missing = [t for t in TARGETS if not (bin_dir / t).exists()]
    if missing:
        sys.exit(f"build finished without {', '.join(missing)} in {bin_dir}")
    print(f"built {', '.join(TARGETS)} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
