"""``gamma="auto"``'s costs, kept on disk per machine, model pair, dtype and kernel build, and reused.

Measuring what a step costs (``hfspec.measure.costs.measure``: the target over 1..K+1 new tokens and a drafting step)
takes seconds, and the same pair on the same machine costs the same in the next process. So the costs are kept as the
kernel plan is (``hfspec.cpu.plan``, ``hfspec.cpu.records``): one small JSON file per key under
``$HFSPEC_CACHE/costs`` (:func:`directory`; delete it to measure again), read at a generator's first
``gamma="auto"`` call (with whether the target reads draft trees exactly, ``hfspec.tree.probe``: another few
forwards) and written back, refined by the call's own steps, when the call ends. The key (:func:`key`)
holds what the costs depend on: the machine (its CPU's name, the kernel's ISA, torch's thread count, the device), the
kernel library built for it, each model's identity (:func:`identity`: its parameters' names, shapes, dtypes and a
sample of their bytes) and how the drafter drafts. Anything else (another thread count, dtype, pair, kernel build)
reads as absent and is measured as before. Costs only choose γ; they never change an output.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from hfspec.cpu import records, toolchain
from hfspec.measure.alpha import AlphaEstimate
from hfspec.measure.costs import Costs
from hfspec.measure.timing import cpu_model
from hfspec.models.paths import cache_dir

__all__ = ["SAMPLES", "Kept", "directory", "identity", "key", "keep", "kept", "machine", "path"]

log = logging.getLogger(__name__)

SAMPLES = 16  # elements of each parameter read into its model's identity, spread over the tensor
VERSION = 1  # of the record's layout


def directory() -> Path:
    """Where the costs are kept: ``$HFSPEC_CACHE/costs``."""
    return cache_dir() / "costs"


def machine(device: torch.device) -> dict[str, Any]:
    """What the costs depend on of the machine: its CPU, torch's thread count and version (and transformers', which
    decides how a tree's mask is read), the device (a GPU by name)."""
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device.type,
        "accelerator": accelerator,
    }


def identity(module: nn.Module | None) -> str | None:
    """A model's identity, cheap to compute: its class, each parameter's and buffer's name, shape and dtype, and
    :data:`SAMPLES` of its elements' bytes (another checkpoint of the same architecture differs in them)."""
    if module is None:
        return None
    digest = hashlib.sha256(type(module).__name__.encode())
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        digest.update(f"\0{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel() and flat.device.type != "meta":
            picked = flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES].cpu().clone()
            digest.update(picked.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def _dtype(module: nn.Module | None) -> str | None:
    """A model's dtype, or its first parameter's for a module without one (an EAGLE-3 head)."""
    if module is None:
        return None
    dtype = getattr(module, "dtype", None) or next((p.dtype for p in module.parameters()), None)
    return None if dtype is None else str(dtype)


def key(target: nn.Module, draft: nn.Module | None, drafter: dict[str, Any], fast_kernels: dict[str, Any]) -> dict:
    """What the costs of ``target`` verifying for a drafter (``describe()``: ``drafter``) with ``draft`` as its
    model depend on; ``fast_kernels`` is ``SpeculativeGenerator.describe()``'s (which kernel each model runs)."""
    device = target.get_output_embeddings().weight.device
    on = any(k.get("on") for k in fast_kernels.values())
    return {
        "version": VERSION,
        "machine": machine(device),
        "kernel": toolchain.library_path().name if on else None,
        "fast_kernels": fast_kernels,
        "target": {"model": identity(target), "dtype": _dtype(target)},
        "draft": {"model": identity(draft), "dtype": _dtype(draft)},
        "drafter": drafter,
    }


def _plain(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` as its JSON reads back (tuples as lists, anything else JSON lacks as its text)."""
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def path(key: dict[str, Any]) -> Path:
    """The file the costs of ``key`` are kept in."""
    digest = hashlib.sha256(json.dumps(_plain(key), sort_keys=True).encode()).hexdigest()[:16]
    return directory() / f"costs-{digest}.json"


@dataclass(frozen=True)
class Kept:
    """What was kept for a key: the costs (None: none, or not a whole record of them), whether the target reads
    a draft tree exactly (``hfspec.tree.probe``; None: not probed), and the acceptance seen by sampling setting (a new
    process drafts from it rather than from the prior)."""

    costs: Costs | None = None
    reads_trees: bool | None = None
    acceptance: dict[Any, tuple[float, float]] = field(
        default_factory=dict
    )  # (accepted, trials) by ``Tuning.memory`` key


def kept(key: dict[str, Any]) -> Kept:
    """What was kept for ``key``; nothing where there is no file or it is not a whole record (logged at debug
    level: it is measured again and written over)."""
    where = path(key)
    record = records.read(where)
    if record is None:
        return Kept()
    if _plain(key) != record.get("key"):
        log.debug("ignoring %s: kept for another key", where)
        return Kept()
    try:
        costs = Costs.from_record(record.get("costs"))
    except ValueError as err:
        log.debug("ignoring %s: %s", where, err)
        return Kept()
    reads = record.get("reads_trees")
    return Kept(costs, reads if isinstance(reads, bool) else None, _acceptance(record.get("acceptance")))


def keep(
    key: dict[str, Any],
    costs: Costs,
    reads_trees: bool | None = None,
    acceptance: dict[Any, AlphaEstimate] | None = None,
) -> bool:
    """Write ``costs`` (the tree probe's answer and the acceptance by setting, if known) for ``key``, atomically;
    False where the cache cannot be written."""
    record = {
        "key": _plain(key),
        "costs": costs.to_record(),
        "reads_trees": reads_trees,
        "acceptance": [[setting, a.accepted, a.trials] for setting, a in (acceptance or {}).items()],
    }
    return records.keep(path(key), record)


def _tuples(value: Any) -> Any:
    """A sampling setting as JSON gave it back: its lists as the tuples it was."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _acceptance(rows: Any) -> dict[Any, tuple[float, float]]:
    """The acceptance by setting kept by :func:`keep`; a row that is not [setting, accepted, trials] is dropped."""
    found = {}
    for row in rows if isinstance(rows, list) else []:
        try:
            setting, accepted, trials = row
            if not 0 <= float(accepted) <= float(trials) < math.inf:
                continue
            found[_tuples(setting)] = (float(accepted), float(trials))
        except (TypeError, ValueError):
            continue
    return found
