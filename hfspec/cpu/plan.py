"""Which of the kernel's block shapes to use for M rows, timed on a model's own layers where it runs.

The shape that streams M rows fastest depends on the CPU (its prefetchers, caches and memory) more than on
the arithmetic: on one AMD EPYC a forward over 3-4 rows ran fastest over 3 weight rows at once, on another
25% faster one weight row at a time. So :func:`plan_for` times every shape the library offers at the row
counts that verification uses (``TUNED_ROWS``), on a sample of the layers it will serve (a few per distinct
layer shape, weighted back to all of them), in interleaved rounds so that a passing load hits all shapes alike (a
shape ``SLOWER`` times slower than the fastest after the first round, e.g. one for a few rows at many rows, is not timed
again), and takes a shape over :func:`hfspec.cpu.kernels.default_plan`'s only
where it is faster by ``MARGIN``. The plan is cached on disk per library (source, compiler, CPU flags),
thread count and layer shapes (``$HFSPEC_CACHE/kernels/plan-*.json``; delete it to time again): a few
seconds once per machine and model, one process at a time (a file lock: two processes timing at once would
disturb each other's timings, and the second reads the plan the first kept). ``HFSPEC_KERNEL_PLAN=default`` skips the timing and keeps the default plan
(the test suite does, to stay short). Every shape gives the same bits, so a plan changes speed, never output.

Layers of another kernel (the quantized one, :mod:`hfspec.cpu.quant`) are planned the same way: they name their
kind (``kernel_kind``, e.g. ``"Q4_K"``) and run a call on their first weight rows (``kernel_call``), and the caller
passes that kernel's shapes and default plan.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from hfspec.cpu import kernels, records, toolchain

__all__ = [
    "MARGIN",
    "ROUNDS",
    "SAMPLE_LAYERS",
    "SAMPLE_ROWS",
    "SLOWER",
    "TUNED_ROWS",
    "choose",
    "plan_for",
    "plan_path",
    "sample",
    "sample_layers",
    "time_shapes",
]

log = logging.getLogger(__name__)

# Rows per call that verification feeds: chains of gamma + 1 (gamma="auto" drafts up to 8), trees of 4-16 nodes
# + 1; row counts between them take the choice of the timed count below (``choose``).
TUNED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17)
ROUNDS = 3
MARGIN = 0.97  # a shape replaces the default only when its best time is at most this fraction of the default's
SLOWER = 2.0  # a shape this many times slower than the fastest in the first round is not timed in the others

# Plans this process has made or read, by their file.
_PLANS: dict[Path, tuple[int, ...]] = {}


def _kind(layer: nn.Module) -> str:
    """What a layer's weights are to the kernel: its dtype, or the block format a quantized layer names."""
    return getattr(layer, "kernel_kind", None) or str(layer.weight.dtype).replace("torch.", "")


def _signature(layers: Sequence[nn.Module]) -> str:
    """The layers' shapes and weight kinds, in order: what a plan was timed on."""
    return ";".join(f"{m.out_features}x{m.in_features}:{_kind(m)}" for m in layers)


def plan_path(
    library: kernels.KernelLibrary,
    layers: Sequence[nn.Module],
    threads: int,
    shapes: Sequence[tuple[int, int]] | None = None,
) -> Path:
    """Where the plan for these layers, this library (and these shapes, if not the library's) and this many
    threads is cached."""
    extra = "" if shapes is None else f"\0{tuple(map(tuple, shapes))}"
    key = hashlib.sha256(f"{library.path.name}\0{threads}\0{_signature(layers)}{extra}".encode()).hexdigest()[:16]
    return library.path.parent / f"plan-{key}.json"


def choose(default: Sequence[int], best: dict[int, Sequence[float]]) -> tuple[int, ...]:
    """The plan from the best seconds per shape at each timed row count (``best[m][shape]``).

    At a timed row count the fastest shape wins if it beats the default plan's shape there by ``MARGIN``;
    row counts between timed ones take the choice of the nearest timed count below; row counts beyond the
    last timed one (and the last entry, which serves prompts) keep the default.
    """
    plan = list(default)
    timed = sorted(m for m in best if 0 < m < len(plan))
    for i, m in enumerate(timed):
        times = best[m]
        fastest = min(range(len(times)), key=times.__getitem__)
        pick = fastest if times[fastest] <= MARGIN * times[default[m]] else default[m]
        stop = min(timed[i + 1] if i + 1 < len(timed) else m + 1, len(plan) - 1)
        plan[m:stop] = [pick] * (stop - m)
    return tuple(plan)


# What is timed of a model: per distinct layer shape, at most SAMPLE_LAYERS of its layers (spread over the depth),
# each cut to at most SAMPLE_ROWS weight rows, weighted back to the whole model. Timing every layer took 192 s on a
# 1.5B model (197 layers); a few distinct weights per shape still stream from memory as a forward does.
SAMPLE_LAYERS = 2
SAMPLE_ROWS = 8192


def sample_layers(layers: Sequence[nn.Module]) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor | None, float]]:
    """:func:`sample` with each sampled layer: (layer, weight rows, fp32 bias, weight)."""
    groups: dict[tuple, list[nn.Module]] = {}
    for m in layers:
        groups.setdefault((m.out_features, m.in_features, _kind(m), m.bias is not None), []).append(m)
    picked = []
    for (n, _, _, _), group in groups.items():
        take = min(SAMPLE_LAYERS, len(group))
        rows = min(n, SAMPLE_ROWS)
        for i in range(take):
            m = group[(i * len(group)) // take]
            bias = None if m.bias is None else m.bias[:rows].float().contiguous()
            picked.append((m, m.weight[:rows], bias, len(group) / take * n / rows))
    return picked


def sample(layers: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor | None, float]]:
    """The weights to time for ``layers``: (weight rows, fp32 bias, weight) per sampled layer, where the weight is
    how many such calls a pass over all of ``layers`` makes (so that weighted sums estimate the whole pass)."""
    return [(w, bias, count) for _, w, bias, count in sample_layers(layers)]


def time_shapes(
    library: kernels.KernelLibrary,
    layers: Sequence[nn.Module],
    rows: Sequence[int] = TUNED_ROWS,
    rounds: int = ROUNDS,
    *,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
) -> dict[int, list[float]]:
    """The fewest seconds a pass over ``layers`` took in each shape (the library's, or ``shapes`` for layers of another
    kernel), at each row count in ``rows`` (estimated from :func:`sample`'s layers, weighted back to all of them).
    A shape ``SLOWER`` times slower than the fastest in the first round keeps that round's time."""
    weights = sample_layers(layers)
    inputs = {k: torch.randn(max(rows), k) for k in {layer.in_features for layer, _, _, _ in weights}}

    def run(shape: int, m: int) -> float:
        total = 0.0
        for layer, w, bias, count in weights:
            call = getattr(layer, "kernel_call", None)
            x = inputs[layer.in_features][:m]
            start = clock()
            if call is not None:
                call(x, w, bias, (shape,))
            else:
                kernels.linear(library, x, w, bias, (shape,))
            total += (clock() - start) * count
        return total

    shapes = range(len(library.shapes if shapes is None else shapes))
    seconds = {m: [[] for _ in shapes] for m in rows}
    with tqdm(
        total=len(rows) * rounds,
        desc="hfspec: timing kernel shapes",
        unit="round",
        leave=False,
        disable=None if progress is None else not progress,
    ) as bar:
        for shape in shapes:
            run(shape, rows[0])  # warm-up: caches, page faults
        for m in rows:
            timed = list(shapes)
            for r in range(rounds):
                for i in range(len(timed)):
                    shape = timed[(i + r) % len(timed)]  # rotate the order so that no shape always runs first
                    seconds[m][shape].append(run(shape, m))
                if r == 0:  # a shape far slower than the fastest is not timed again (a few rows in many passes)
                    fastest = min(seconds[m][shape][0] for shape in timed)
                    timed = [shape for shape in timed if seconds[m][shape][0] <= SLOWER * fastest]
                bar.update()
    # The fastest round: another process that takes a core for a moment stalls a two-thread call by a whole time
    # slice (24 ms here), which no amount of rounds averages out, while nothing makes a call faster than it is.
    return {m: [min(s) for s in by_shape] for m, by_shape in seconds.items()}


def plan_for(
    library: kernels.KernelLibrary,
    layers: Sequence[nn.Module],
    *,
    progress: bool | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
    default: tuple[int, ...] | None = None,
) -> tuple[int, ...]:
    """The plan for ``layers`` (a model's linears, in forward order): cached, or timed now and cached.

    ``shapes`` and ``default`` are another kernel's block shapes and default plan (quantized layers); by default
    the library's own."""
    default = kernels.default_plan(library) if default is None else default
    count = len(library.shapes if shapes is None else shapes)
    if count < 2 or not layers or os.environ.get("HFSPEC_KERNEL_PLAN") == "default":
        return default
    path = plan_path(library, layers, torch.get_num_threads(), shapes)
    if path in _PLANS:
        return _PLANS[path]
    plan = _cached(path, default, count)
    if plan is None:
        # One process times at a time (another's timing would disturb these); one that waited reads what it kept.
        with toolchain.locked(path.parent / "timing.lock", required=False):
            plan = _cached(path, default, count) or _time_and_keep(library, layers, default, path, progress, shapes)
    _PLANS[path] = plan
    return plan


def _cached(path: Path, default: Sequence[int], shapes: int) -> tuple[int, ...] | None:
    """The plan kept at ``path``, if there is a valid one (of this user's, naming shapes the library has)."""
    found = (records.read(path) or {}).get("plan")
    try:
        if len(found) == len(default) and all(0 <= s < shapes for s in found):
            return tuple(found)
    except TypeError:
        pass
    return None


def _time_and_keep(
    library: kernels.KernelLibrary,
    layers: Sequence[nn.Module],
    default: Sequence[int],
    path: Path,
    progress: bool | None,
    shapes: Sequence[tuple[int, int]] | None,
) -> tuple[int, ...]:
    """Time the shapes on ``layers`` and keep the plan at ``path``."""
    t0 = time.perf_counter()
    offered = library.shapes if shapes is None else shapes
    distinct = len({(m.out_features, m.in_features, _kind(m)) for m in layers})
    log.info(
        "hfspec: timing the CPU kernel's %d block shapes on %d distinct layer shapes of this model (once per "
        "machine, threads and model; cached in %s): which one streams each row count fastest depends on "
        "the CPU",
        len(offered),
        distinct,
        path,
    )
    best = time_shapes(library, layers, progress=progress, shapes=shapes)
    plan = choose(default, best)
    record = {
        "plan": plan,
        "shapes": offered,
        "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - t0, 2),
        "ms": {m: [round(s * 1e3, 3) for s in times] for m, times in best.items()},
    }
    records.keep(path, record)  # in a read-only cache the plan still serves this process
    return plan
