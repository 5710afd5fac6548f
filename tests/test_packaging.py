"""The package as users install it: the wheel carries every file hfspec reads at run time.

The package data is checked against ``pyproject.toml``'s patterns, matched as setuptools matches them
(``build_py.find_data_files``: each pattern joined to the package's directory, ``glob(..., recursive=True)``,
files only), so no wheel is built here; ``.ci/run`` builds the real sdist and wheel and runs the kernels from it.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from hfspec.cpu import kernels

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hfspec"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Folders whose every file the package reads (presets, the shipped draft and head, prompt sets, transformers'
# custom_generate entry), relative to the package.
DATA_DIRS = ("configs", "drafts", "prompts", "assisted/custom_generate")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def shipped(patterns: list[str]) -> set[Path]:
    """The files under hfspec/ that ``patterns`` put in the wheel, as setuptools' build_py expands them."""
    found = (glob.glob(os.path.join(PACKAGE, pattern), recursive=True) for pattern in patterns)
    return {Path(path).resolve() for paths in found for path in paths if os.path.isfile(path)}


def kernel_files() -> set[Path]:
    """Every file the kernel build reads: the sources and headers it globs, and what they ``#include "..."``
    (resolved beside the including file, as the compiler does with no -I), followed through the headers."""
    todo = [*kernels.SOURCES, *kernels.HEADERS]
    seen: set[Path] = set()
    while todo:
        path = Path(todo.pop()).resolve()
        if path in seen:
            continue
        seen.add(path)
        assert path.is_file(), f"the kernel build reads {path}, which does not exist"
        todo += [path.parent / name for name in INCLUDE.findall(path.read_text())]
    return seen


def data_files() -> set[Path]:
    return {
        path.resolve()
        for folder in DATA_DIRS
        for path in (PACKAGE / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def left_out(patterns: list[str]) -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in (kernel_files() | data_files()) - shipped(patterns))


def test_the_wheel_carries_every_file_the_kernels_and_presets_read():
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["hfspec"]
    assert any(p.name == "vec.h" for p in kernel_files())  # the includes are followed
    assert {"drafts/smollm2-135m-instruct-draft/model.safetensors", "configs/smollm2-offline.json"} <= {
        str(p.relative_to(PACKAGE)) for p in data_files()
    }
    assert left_out(patterns) == [], "add these to [tool.setuptools.package-data] in pyproject.toml"


def test_a_header_left_out_of_the_patterns_is_found():
    # The negative control: the patterns as they were when a built wheel could not compile its kernels.
    old = ["assisted/custom_generate/*.py", "configs/*.json", "cpu/csrc/*.cpp", "drafts/**/*", "prompts/*"]
    assert left_out(old) == ["cpu/csrc/vec.h"]
    assert "drafts/smollm2-135m-instruct-eagle3/config.json" in left_out([p for p in old if p != "drafts/**/*"])
