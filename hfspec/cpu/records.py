"""Small JSON records kept in hfspec's cache: what a process measured once per machine, for the next process.

The kernel plan (:mod:`hfspec.cpu.plan`) and ``gamma="auto"``'s costs (:mod:`hfspec.measure.cost_cache`) are kept this
way. A record is read only when it is whole JSON and this user's, in a directory no one else may write
(:func:`hfspec.cpu.toolchain.unsafe`); anything else reads as absent, and the caller measures again. It is written to
a temporary file and renamed over the old one, so that concurrent processes never see half a file: the last one to
finish wins, and each wrote a whole record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from hfspec.cpu import toolchain

__all__ = ["keep", "read"]

log = logging.getLogger(__name__)


def read(path: Path) -> dict[str, Any] | None:
    """The record kept at ``path``; None if there is none, or it is not a whole JSON object of this user's."""
    try:
        why = toolchain.unsafe(path.parent) or toolchain.unsafe(path)
        if why is not None:
            log.debug("ignoring %s: %s", path, why)
            return None
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # unreadable or cut short: measured again and written over
        log.debug("ignoring %s: %s", path, err)
        return None
    if not isinstance(record, dict):
        log.debug("ignoring %s: not a JSON object", path)
        return None
    return record


def keep(path: Path, record: dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` atomically (its directory made if missing); False where the cache is read-only,
    in which case the caller's value still serves its own process."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        tmp.write_text(json.dumps(record))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as err:
        log.debug("could not keep %s: %s", path, err)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True
