"""The CPU threads a call runs on: torch's intra-op threads, which hfspec's kernels read at every call too.

``threads=`` (``--threads`` on the command line, as llama.cpp's ``-t``) sets ``torch.set_num_threads`` for one
call and restores the count after it (:func:`using`); None leaves torch's count as it is. A count above the CPUs
this process may run on is allowed (a container may see fewer than it has) with a warning: threads beyond the cores
only wait for each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from hfspec.errors import HfspecError

__all__ = ["available", "check", "using"]

log = logging.getLogger(__name__)

_warned: set[int] = set()  # counts already warned about, so that a loop of calls warns once


def available() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check(threads: Any) -> int | None:
    """``threads`` if it is a count of threads (an integer >= 1) or None; a warning, once, above :func:`available`."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise HfspecError(f"threads must be an integer >= 1 (CPU threads, as llama.cpp's -t) or None, got {threads!r}")
    cpus = available()
    if threads > cpus and threads not in _warned:
        _warned.add(threads)
        log.warning("%d threads on %d CPUs: the threads beyond the CPUs only slow each other down", threads, cpus)
    return threads


@contextlib.contextmanager
def using(threads: int | None) -> Iterator[int]:
    """Run the block with torch's thread count set to ``threads`` (None: as it is), restored afterwards; yields the
    count the block runs with."""
    threads = check(threads)
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
