"""Wall-clock timing of device work: one convention for the whole package.

Every cost hfspec reasons about (a target forward over k tokens, a drafting step, a
rollback, a training step, a bench run) is measured the same way: wait for the device
before reading the clock on both sides, so that a CUDA launch that returns at once is
not mistaken for finished work; warm up before measuring, so that allocators and
kernel caches are settled; report the median, which one stall of a shared machine does
not move. This module knows only torch and the clock.
"""

from __future__ import annotations

import functools
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device | str | None) -> None:
    """Wait for ``device``'s queued work, so that the wall clock measures it (a no-op off CUDA)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` once ``device`` has finished what it was given."""
    sync(device)
    return time.perf_counter()


def timed(fn: Callable[[], Any], device: torch.device | str | None = None) -> tuple[Any, float]:
    """``fn()`` and the seconds it took on ``device``."""
    t0 = now(device)
    out = fn()
    return out, now(device) - t0


def median_seconds(
    fn: Callable[[], Any], repeats: int, device: torch.device | str | None = None, warmup: int = 1
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` unmeasured ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device)[1] for _ in range(repeats))


class Stopwatch:
    """Seconds added up over several laps (``with watch: ...``), e.g. all the draft time of a run."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.seconds = 0.0
        self._start: float | None = None

    def __enter__(self) -> Stopwatch:
        self._start = now(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._start is not None, "Stopwatch exited without being entered"
        self.seconds += now(self.device) - self._start
        self._start = None


@functools.cache  # the machine does not change within a process; lscpu takes milliseconds a call
def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it (else /proc/cpuinfo's, else the platform's)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
