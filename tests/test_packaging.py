"""The package as users install it: the wheel carries every file hfspec reads at run time, and the version comes
from one place, answered by ``hfspec --version`` without importing torch.

The package data is checked against ``pyproject.toml``'s patterns, matched as setuptools matches them
(``build_py.find_data_files``: each pattern joined to the package's directory, ``glob(..., recursive=True)``,
files only), so no wheel is built here; ``.ci/run`` builds the real sdist and wheel and runs the kernels from it.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

import hfspec
from hfspec import __main__ as entry
from hfspec._version import __version__
from hfspec.commands import cli
from hfspec.cpu import toolchain

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hfspec"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Folders whose every file the package reads (presets, the shipped draft and head, prompt sets, transformers'
# custom_generate entry), relative to the package.
DATA_DIRS = ("data", "assisted/custom_generate")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def shipped(patterns: list[str]) -> set[Path]:
    """The files under hfspec/ that ``patterns`` put in the wheel, as setuptools' build_py expands them."""
    found = (glob.glob(os.path.join(PACKAGE, pattern), recursive=True) for pattern in patterns)
    return {Path(path).resolve() for paths in found for path in paths if os.path.isfile(path)}


def kernel_files() -> set[Path]:
    """Every file the kernel build reads: the sources and headers it globs, and what they ``#include "..."``
    (resolved beside the including file, as the compiler does with no -I), followed through the headers."""
    todo = [*toolchain.SOURCES, *toolchain.HEADERS]
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
    assert {"data/drafts/smollm2-135m-instruct-draft/model.safetensors", "data/presets/smollm2-offline.json"} <= {
        str(p.relative_to(PACKAGE)) for p in data_files()
    }
    assert left_out(patterns) == [], "add these to [tool.setuptools.package-data] in pyproject.toml"


def test_a_header_left_out_of_the_patterns_is_found():
    # The negative control: the patterns as they were when a built wheel could not compile its kernels.
    old = [
        "assisted/custom_generate/*.py",
        "data/presets/*.json",
        "cpu/csrc/*.cpp",
        "data/drafts/**/*",
        "data/prompts/*",
    ]
    assert left_out(old) == ["cpu/csrc/quant_rows.h", "cpu/csrc/vec.h"]  # every header
    assert "data/drafts/smollm2-135m-instruct-eagle3/config.json" in left_out(
        [p for p in old if p != "data/drafts/**/*"]
    )


def test_the_version_has_one_source():
    assert hfspec.__version__ == __version__ and re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)
    assert "version" in PYPROJECT["project"]["dynamic"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hfspec._version.__version__"}
    assert PYPROJECT["project"]["scripts"]["hfspec"] == "hfspec.__main__:main"


def test_version_answers_without_importing_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hfspec", "--version"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"hfspec {__version__}\n"
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "hfspec._version" in imported  # importtime did report what was imported
    assert not {name for name in imported if name.split(".")[0] in ("torch", "transformers", "numpy")}


def test_the_command_line_prints_the_same_version(capsys):
    assert cli.main(["--version"]) == 0
    assert entry.main(["--version"]) == 0
    assert capsys.readouterr().out == f"hfspec {__version__}\n" * 2


def test_the_public_names_load_on_first_use():
    from hfspec.cpu import fast

    assert all(getattr(hfspec, name) is not None for name in hfspec.__all__)
    assert hfspec.fast is fast and set(hfspec.__all__) <= set(dir(hfspec))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        hfspec.nonexistent
