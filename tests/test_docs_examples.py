"""Every Python and shell block in README.md and docs/ runs, or says in its info string why it cannot.

Python blocks are collected by pytest-examples (``find_examples``) and run in this process with
``eval_example.run``, so they share ``hfspec.generate``'s loaded pairs; shell blocks are found with markdown-it's
parser (pytest-examples collects Python only) and run with bash. A block that cannot run here (a hub model, a GPU,
a long download, a server) says so in its info string, which MkDocs renders as the language alone::

    ```python test="skip" reason="needs a GPU"

Runnable blocks use the offline pair with a few tokens: each takes seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from pytest_examples import CodeExample, find_examples

from hfspec.models import assets

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", ROOT / "docs"]
SHELLS = {"bash", "sh", "shell"}
TESTS = {"run", "skip"}  # the values `test=` may take; "run" is the default


def _shell_examples() -> list[CodeExample]:
    """The shell blocks of the Markdown files, as pytest-examples' ``CodeExample`` (for its info-string settings)."""
    files = [p for s in SOURCES for p in ([s] if s.is_file() else sorted(s.rglob("*.md")))]
    found = []
    for path in files:
        for token in MarkdownIt("commonmark").parse(path.read_text("utf-8")):
            if token.type == "fence" and token.info.split(" ", 1)[0].lower() in SHELLS:
                found.append(CodeExample.create(token.content, path=path, start_line=token.map[0] + 1,
                                                prefix=token.info))  # fmt: skip
    return found


# Sorted, so that every xdist worker collects the same tests in the same order.
PYTHON = sorted(find_examples(*SOURCES), key=lambda e: (str(e.path), e.start_line))
SHELL = _shell_examples()


def _id(example: CodeExample) -> str:
    return f"{example.path.relative_to(ROOT)}:{example.start_line}"


def _settings(example: CodeExample) -> dict[str, str]:
    settings = example.prefix_settings()
    assert settings.get("test", "run") in TESTS, f'{_id(example)}: test="{settings["test"]}" is not one of {TESTS}'
    if settings.get("test") == "skip":
        assert settings.get("reason", "").strip(), f'{_id(example)}: test="skip" needs a reason="..."'
    return settings


def _skip_unless_runnable(example: CodeExample) -> None:
    settings = _settings(example)
    if settings.get("test") == "skip":
        pytest.skip(settings["reason"])


@pytest.fixture(scope="module")
def offline_cache(request) -> Path | None:
    """The cache that holds the offline target: the user's when it has one, else the session's fresh build."""
    if (assets.cache_dir() / "smollm2-135m-instruct" / "config.json").is_file():
        return None
    return request.getfixturevalue("offline_target")[0]


@pytest.fixture
def offline_pair(offline_cache, monkeypatch):
    """The examples find the offline target where this session has it; the kernels stay where they were built."""
    if offline_cache is not None:
        monkeypatch.setattr(assets, "cache_dir", lambda: offline_cache)
    return offline_cache


def test_the_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text("utf-8").count("\n")
    assert lines <= 220, f"README.md has {lines} lines; the details belong in docs/"


def test_the_examples_are_found():
    assert len(PYTHON) >= 5 and len(SHELL) >= 5
    for example in PYTHON + SHELL:
        _settings(example)


@pytest.mark.parametrize("example", PYTHON, ids=_id)
def test_python_example(example: CodeExample, eval_example, offline_pair):
    _skip_unless_runnable(example)
    eval_example.run(example)


@pytest.mark.parametrize("example", SHELL, ids=_id)
def test_shell_example(example: CodeExample, offline_pair, library, tmp_path):
    _skip_unless_runnable(example)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The installed `hfspec` command first, whether or not this interpreter's environment is activated.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if offline_pair is not None:
        # That cache with the kernel this session built (building it again would take most of the test's time).
        kernels_dir = offline_pair / "kernels"
        kernels_dir.mkdir(mode=0o755, exist_ok=True)
        if not (kernels_dir / library.path.name).exists():
            shutil.copy2(library.path, kernels_dir / library.path.name)
        env["HFSPEC_CACHE"] = str(offline_pair)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", example.source], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{_id(example)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
