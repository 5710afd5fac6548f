"""One forward of k new tokens of a GGUF target against a cache of ``--depth`` tokens, with transformers' concatenating
cache and with hfspec's preallocated buffers (``hfspec.models.kv_buffer``), and the time ``aten::cat`` takes in it.

Loads the file with its blocks kept (``hfspec.models.gguf_native``, int8 arithmetic) on hfspec's kernels, fills one
cache of each kind with the same ``--depth`` tokens, then times a forward of k new tokens against each (cropped back
after each, as a rejected verification is), the two taking turns so that a busy machine disturbs both alike; best of
``--reps``. Then profiles ``--profile`` more forwards of one token per cache (``torch.profiler``) and reports the
milliseconds of ``aten::cat`` per forward. Prints JSON with the CPU's ``lscpu`` model name and the load average: on a
shared machine the numbers say so.

    python scripts/kv_cache_speed.py [--file PATH] [--threads 2] [--depth 256] [--ks 1,8] [--reps 7] [--profile 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from hfspec.cpu import fast
from hfspec.models import gguf_native
from hfspec.models.kv_buffer import buffered_cache

DEFAULT = Path.home() / ".cache/hfspec/qwen2.5-coder-1.5b-instruct/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
CACHES = {"concatenated": DynamicCache, "buffered": buffered_cache}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


@torch.inference_mode()
def step_seconds(model, cache, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(ids, cache=cache, use_cache=True, logits_to_keep=ids.shape[1])
    seconds = time.perf_counter() - t0
    cache.crop(-ids.shape[1])  # back to the depth
    return seconds


@torch.inference_mode()
def cat_ms(model, cache, ids: torch.Tensor, forwards: int) -> tuple[float, int]:
    """Milliseconds of ``aten::cat`` per one-token forward, and its calls per forward."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            step_seconds(model, cache, ids)
    cat = [e for e in prof.key_averages() if e.key == "aten::cat"]
    total = sum(e.self_cpu_time_total for e in cat) / 1000
    return total / forwards, sum(e.count for e in cat) // forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--ks", default="1,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    model = gguf_native.load(str(args.file.parent), args.file.name, "target", arithmetic="int8")
    if model is None:
        raise SystemExit(f"{args.file} could not be loaded with its blocks kept")
    fast.accelerate(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab - 100, (1, args.depth), generator=g)
    feeds = {k: torch.randint(100, vocab - 100, (1, k), generator=g) for k in ks}
    caches = {name: make() for name, make in CACHES.items()}
    with torch.inference_mode():
        for cache in caches.values():
            model(prompt, cache=cache, use_cache=True, logits_to_keep=1)
    best = {name: dict.fromkeys(ks, float("inf")) for name in caches}
    for _ in range(args.reps):
        for k in ks:
            for name, cache in caches.items():  # in turns: a busy spell hits both
                best[name][k] = min(best[name][k], step_seconds(model, cache, feeds[k]))
    cats = {name: cat_ms(model, cache, feeds[ks[0]], args.profile) for name, cache in caches.items()}
    result = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "depth": args.depth,
        "forward_ms": {name: {k: round(s * 1000, 2) for k, s in times.items()} for name, times in best.items()},
        f"cat_ms_per_forward_k{ks[0]}": {name: round(ms, 3) for name, (ms, _) in cats.items()},
        "cat_calls_per_forward": {name: calls for name, (_, calls) in cats.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
