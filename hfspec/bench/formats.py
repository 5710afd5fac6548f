"""What each GGUF block format costs on CPU: a model's quantized layers against the same layers dequantized.

For every format a model holds in blocks (:mod:`hfspec.cpu.quant`), the layers of that format are timed on the
quantized kernel and, dequantized one sampled layer at a time, on the fp32 and bf16 kernels
(:mod:`hfspec.cpu.kernels`): the *step* (milliseconds one row costs through all of them, estimated from
:func:`hfspec.cpu.plan.sample_layers` as the shape plan is) and v(k) (k rows ÷ one row), measured in interleaved
rounds (medians). A format that is cheap to stream but dear to dequantize shows a low step and a high v(k).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hfspec.cpu import kernels, quant
from hfspec.cpu import plan as kernel_plan

__all__ = ["PATHS", "ROWS", "FormatCost", "format_costs", "formats_table"]

ROWS = (1, 2, 4, 8, 16)
PATHS = ("quantized", "fp32", "bf16")


@dataclass(frozen=True)
class FormatCost:
    """One format's layers: how many, their weights and bytes, and milliseconds per row count on each path."""

    format: str
    layers: int
    weights: int
    nbytes: int
    ms: dict[str, dict[int, float]]  # path -> rows -> milliseconds (all the format's layers, one forward)

    def v(self, path: str, rows: int) -> float:
        return self.ms[path][rows] / self.ms[path][1]


def _calls(
    library: kernels.KernelLibrary, layer: quant.QuantLinear, w: torch.Tensor, bias: torch.Tensor | None
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    dense = quant.dequantize(w, layer.fmt, layer.in_features)
    half = dense.bfloat16()
    return {
        "quantized": lambda x: layer.kernel_call(x, w, bias, layer.plan or quant.default_plan(quant.kernel())),
        "fp32": lambda x: kernels.linear(library, x, dense, bias),
        "bf16": lambda x: kernels.linear(library, x, half, bias),
    }


def format_costs(model: nn.Module, rows: Sequence[int] = ROWS, rounds: int = 5) -> list[FormatCost]:
    """Per format of ``model``'s quantized linears, its step and v(k) on each of :data:`PATHS`."""
    qk, library = quant.kernel(), kernels.load()
    if qk is None or library is None:
        return []
    groups: dict[str, list[quant.QuantLinear]] = {}
    for layer in quant.quantized_layers(model):
        groups.setdefault(layer.fmt.name, []).append(layer)
    out = []
    for name, layers in sorted(groups.items()):
        sampled = [
            (count, _calls(library, layer, w, bias), layer.in_features)
            for layer, w, bias, count in kernel_plan.sample_layers(layers)
        ]
        inputs = {k: torch.randn(max(rows), k) for _, _, k in sampled}
        seconds: dict[str, dict[int, list[float]]] = {p: {m: [] for m in rows} for p in PATHS}
        for r in range(rounds + 1):  # the first round warms caches and page faults, and is dropped
            for m in rows:
                for i in range(len(PATHS)):
                    path = PATHS[(i + r) % len(PATHS)]
                    total = 0.0
                    for count, calls, k in sampled:
                        start = time.perf_counter()
                        calls[path](inputs[k][:m])
                        total += (time.perf_counter() - start) * count
                    if r:
                        seconds[path][m].append(total)
        weights = sum(layer.out_features * layer.in_features for layer in layers)
        held = sum(layer.weight.numel() for layer in layers)
        out.append(
            FormatCost(
                name,
                len(layers),
                weights,
                held,
                {p: {m: statistics.median(s) * 1e3 for m, s in by.items()} for p, by in seconds.items()},
            )
        )
    return out


def formats_table(costs: Sequence[FormatCost], title: str = "") -> str:
    """A text table: per format, its layers and bits per weight, then per path the step and v(k)."""
    if not costs:
        return f"{title}: no quantized layers" if title else "no quantized layers"
    rows = sorted(costs[0].ms[PATHS[0]])
    head = (
        ["format", "layers", "bits/w"]
        + [f"{p} ms" for p in PATHS]
        + [f"{p} v({m})" for p in PATHS for m in rows if m > 1]
    )
    lines = [" ".join(f"{h:>12}" for h in head)]
    for c in costs:
        cells = [c.format, str(c.layers), f"{8 * c.nbytes / c.weights:.2f}"]
        cells += [f"{c.ms[p][1]:.2f}" for p in PATHS]
        cells += [f"{c.v(p, m):.2f}" for p in PATHS for m in rows if m > 1]
        lines.append(" ".join(f"{x:>12}" for x in cells))
    return "\n".join(([title] if title else []) + lines)
