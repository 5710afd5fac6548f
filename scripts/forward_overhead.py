"""Where a forward's time goes outside the linears: per-forward time and torch's own ops (self CPU, per forward).

Loads the Qwen2.5-Coder pair as hfspec loads it (``hfspec.drafters.loading.load_pair``: the target kept in GGUF blocks
in ``--arithmetic``, the draft in its integer drafting arithmetic), fills each cache with ``--depth`` tokens, then
times forwards of k new tokens against it (the cache cropped back after each; best of ``--reps``) and profiles a few
with ``torch.profiler``: the aten ops' self CPU time per forward, the largest first. Each model runs twice, in turns
so that a busy spell hits both alike: ``fused`` with the whole of ``accelerate()``, ``unfused`` with its fused norms,
rotary and MLPs (``hfspec.cpu.norms``, ``hfspec.cpu.rotary``, ``hfspec.cpu.mlp``) switched back to transformers' own
modules. hfspec's kernels run through
ctypes and do not show there, so ``aten_ms`` is the time spent in torch's own ops around them. Prints JSON with the
CPU's ``lscpu`` model name and the load average: on a shared machine the numbers say so.

    python scripts/forward_overhead.py [--threads 2] [--depth 256] [--ks 1,8] [--reps 9] [--top 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from hfspec.cpu import fast, kernels, mlp, norms, rotary
from hfspec.drafters.loading import load_pair

CACHE = Path.home() / ".cache/hfspec"
TARGET = CACHE / "qwen2.5-coder-1.5b-instruct/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
DRAFT = CACHE / "qwen2.5-coder-0.5b-instruct/Qwen2.5-Coder-0.5B-Instruct.gguf"


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def forward(model, cache, ids: torch.Tensor) -> tuple[float, float]:
    """Seconds of wall time and of this thread's CPU time (which a busy machine's other processes do not inflate;
    with one thread it is the whole forward's)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    model(ids, cache=cache, use_cache=True, logits_to_keep=ids.shape[1])
    seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
    cache.crop(-ids.shape[1])  # back to the depth
    return seconds, cpu


def aten_split(model, cache, ids: torch.Tensor, forwards: int, top: int) -> dict[str, object]:
    """The aten ops' self CPU time per forward (ms), summed and the ``top`` largest: per op the least over
    ``forwards`` profiled forwards (a busy machine stalls some calls, not the same ones in every forward)."""
    per_op: dict[str, float] = {}
    calls: dict[str, int] = defaultdict(int)
    for _ in range(forwards):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            forward(model, cache, ids)
        for event in prof.key_averages():
            if event.key.startswith("aten::"):
                ms = event.self_cpu_time_total / 1e3
                per_op[event.key] = min(per_op.get(event.key, ms), ms)
                calls[event.key] = event.count
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1])
    return {
        "aten_ms": round(sum(per_op.values()), 2),
        "aten_calls": sum(calls.values()),
        "top": {name: [round(ms, 3), calls[name]] for name, ms in ranked[:top]},
    }


def fused(model, on: bool) -> None:
    """Switch ``model``'s fused norms, rotary and MLPs on or off (the rest of accelerate() stays)."""
    for part in (norms, rotary, mlp):
        part.use(model, kernels.load()) if on else part.unuse(model)


@torch.inference_mode()
def measure(model, depth: int, ks: list[int], reps: int, top: int, g: torch.Generator) -> dict[str, object]:
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    model(torch.randint(100, vocab - 100, (1, depth), generator=g), cache=cache, use_cache=True, logits_to_keep=1)
    result: dict[str, object] = {"describe": {k: v for k, v in fast.describe(model).items() if k != "quantized"}}
    for k in ks:
        ids = torch.randint(100, vocab - 100, (1, k), generator=g)
        best = {"unfused": (float("inf"),) * 2, "fused": (float("inf"),) * 2}
        for _ in range(reps + 1):  # the first round warms
            for state in best:  # in turns: a busy spell hits both
                fused(model, state == "fused")
                best[state] = tuple(map(min, best[state], forward(model, cache, ids)))
        for state in best:
            fused(model, state == "fused")
            result[f"k={k} {state}"] = {
                "forward_ms": round(best[state][0] * 1e3, 2),
                "thread_cpu_ms": round(best[state][1] * 1e3, 2),
                **aten_split(model, cache, ids, 5, top),
            }
    fused(model, True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=TARGET)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--arithmetic", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--ks", default="1,8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, _ = load_pair(
        str(args.target.parent),
        str(args.draft.parent),
        gguf_file=args.target.name,
        draft_gguf_file=args.draft.name,
        arithmetic=args.arithmetic,
    )
    g = torch.Generator().manual_seed(0)
    ks = [int(k) for k in args.ks.split(",")]
    result = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "depth": args.depth,
        "reps": args.reps,
        "note": "best of reps; aten ops per forward from torch.profiler, per op the least of 5 forwards; on a "
        "shared machine the times carry its load",
    }
    for name, model in (("target", target), ("draft", draft)):
        result[name] = measure(model, args.depth, ks, args.reps, args.top, g)
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
