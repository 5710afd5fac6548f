"""``hfspec cache`` lists what hfspec keeps, by group with sizes, and clears a group only when told --yes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfspec.commands import cache as cache_command
from hfspec.commands import cli


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache as a first run leaves it, plus a wheel model, a second plan and a leftover temporary build."""
    root = tmp_path / "hfspec"
    files = {
        "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf": 1000,
        "smollm2-135m-instruct/config.json": 10,
        "qwen2.5-coder-0.5b-instruct/Qwen2.5-Coder-0.5B-Instruct.gguf": 500,
        ".build-x1/model/partial.gguf": 7,
        "kernels/linear-abc.so": 300,
        "kernels/linear-abc.lock": 0,
        "kernels/plan-1.json": 20,
        "kernels/plan-2.json": 30,
        "costs/costs-9.json": 40,
        "gguf/e3f/tokenizer/tokenizer.json": 50,
    }
    for name, size in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)
    monkeypatch.setenv("HFSPEC_CACHE", str(root))
    return root


def sizes(entries) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for e in entries:
        out.setdefault(e.group, {})[e.path.name] = e.bytes
    return out


def test_the_listing_groups_what_is_kept_with_sizes(cache):
    assert sizes(cache_command.listing()) == {
        "models": {".build-x1": 7, "qwen2.5-coder-0.5b-instruct": 500, "smollm2-135m-instruct": 1010},
        "kernels": {"linear-abc.lock": 0, "linear-abc.so": 300},
        "plans": {"plan-1.json": 20, "plan-2.json": 30},
        "costs": {"costs-9.json": 40},
        "gguf": {"e3f": 50},
    }


def test_the_command_prints_json_and_text(cache, capsys):
    assert cli.main(["cache", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["root"] == str(cache) and listed["bytes"] == 1957
    assert {g: v["bytes"] for g, v in listed["groups"].items()} == {
        "models": 1517,
        "kernels": 300,
        "plans": 50,
        "costs": 40,
        "gguf": 50,
    }
    assert cli.main(["cache", "list"]) == 0
    text = capsys.readouterr().out
    assert "kernel plans [plans]: 50 B" in text and "smollm2-135m-instruct" in text


def test_clear_is_a_dry_run_without_yes(cache, capsys):
    before = sizes(cache_command.listing())
    assert cli.main(["cache", "clear", "plans", "costs"]) == 0
    out, err = capsys.readouterr()
    assert "plan-1.json" in out and "costs-9.json" in out and "--yes" in err
    assert sizes(cache_command.listing()) == before


def test_clear_with_yes_deletes_only_the_groups_named(cache, capsys):
    assert cli.main(["cache", "--json", "clear", "plans", "models", "--yes"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted"] and report["groups"]["plans"]["bytes"] == 50
    left = sizes(cache_command.listing())
    assert set(left) == {"kernels", "costs", "gguf"}
    assert not (cache / "smollm2-135m-instruct").exists() and (cache / "kernels" / "linear-abc.so").is_file()
    assert cli.main(["cache", "clear", "all", "--yes"]) == 0
    assert cache_command.listing() == [] and cache.is_dir()


def test_an_unknown_group_is_refused(cache, capsys):
    assert cli.main(["cache", "clear", "everything"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_an_absent_cache_lists_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HFSPEC_CACHE", str(tmp_path / "none"))
    assert cache_command.listing() == []
    assert cli.main(["cache", "clear", "all", "--yes"]) == 0
    assert not (tmp_path / "none").exists()


def test_the_listing_imports_no_torch(cache):
    """A file listing: torch is not imported for it (where the package itself does not import torch first)."""
    code = (
        "import sys, hfspec; before = 'torch' in sys.modules\n"
        "from hfspec.commands import cache as cache_command; cache_command.listing()\n"
        "print(before, 'torch' in sys.modules)"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if found[0] == "True":
        pytest.skip("hfspec's package imports torch when imported")
    assert found == ["False", "False"]
