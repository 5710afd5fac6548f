"""The quantized kernel at 1-17 rows: single layers of the Qwen2.5-Coder-1.5B Q4_K_M target, and its whole forward.

Sections:
  layers   random blocks in the target's two big layer shapes (Q4_K 8960x1536, Q6_K 1536x8960): ms per call in
           every block shape the kernel offers (the fastest of --repeats rounds that take turns), the best shape's
           G multiply-adds/s and its time over the one-row time;
  forward  the GGUF target (loaded with hfspec.models.gguf_native, accelerated, its shapes planned) fed k new
           tokens after a --context-token cache, as hfspec.measure.costs.forward_seconds does: the fastest of
           --forward-repeats rounds.
On a shared machine: at one thread the times are the thread's CPU time, so that other jobs taking the core cost
nothing; at more, wall time, and a round in which another process used a CPU is not counted (``rounds_dropped``).
Prints one JSON object with the threads and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_files import random_blocks  # noqa: E402

from hfspec.cpu import quant  # noqa: E402

ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 17)
LAYERS = (("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960))
TARGET = Path.home() / ".cache" / "hfspec" / "qwen2.5-coder-1.5b-instruct"


def clock() -> float:
    """Seconds: this thread's CPU time at one thread (a load that takes the core away then costs nothing), else the
    wall clock."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def others_cpu() -> float:
    """CPU seconds that every other process has used so far (Linux's /proc; 0 elsewhere)."""
    total, me = 0, str(os.getpid())
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if pid.isdigit() and pid != me:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
    return total / os.sysconf("SC_CLK_TCK")


def quiet_rounds(fns: list, rounds: int) -> tuple[list[float], int]:
    """The fastest seconds of each of ``fns`` over ``rounds`` rounds that took turns, after one warm-up round; a round
    in which other processes used a CPU for more than a clock tick is not counted (at most ``20 * rounds`` tries, then
    the fastest of them all). Also the rounds not counted."""
    for fn in fns:
        fn()
    quiet, noisy, counted, dropped = [float("inf")] * len(fns), [float("inf")] * len(fns), 0, 0
    while counted < rounds and counted + dropped < 20 * rounds:
        before, times = others_cpu(), []
        for fn in fns:
            t0 = clock()
            fn()
            times.append(clock() - t0)
        noisy = [min(b, t) for b, t in zip(noisy, times)]
        if others_cpu() - before > 1.5 / os.sysconf("SC_CLK_TCK"):
            dropped += 1
        else:
            quiet = [min(b, t) for b, t in zip(quiet, times)]
            counted += 1
    return (quiet if counted else noisy), dropped


@torch.inference_mode()
def layers(rows: list[int], repeats: int) -> list[dict]:
    qk = quant.kernel()
    out = []
    for name, n, k in LAYERS:
        fmt = quant.FORMATS[name]
        blocks = torch.from_numpy(random_blocks(name, n, k, np.random.default_rng(0)))
        x = torch.randn(max(rows), k)
        one = None
        for m in rows:
            seconds, dropped = quiet_rounds(
                [lambda s=s: quant.linear(qk, x[:m], blocks, fmt, None, (s,)) for s in range(len(qk.shapes))], repeats
            )
            ms = [t * 1e3 for t in seconds]
            best = min(range(len(ms)), key=ms.__getitem__)
            one = one or ms[best]
            out.append(
                {
                    "layer": f"{name} {n}x{k}",
                    "rows": m,
                    "ms": [round(t, 3) for t in ms],
                    "best": list(qk.shapes[best]),
                    "gmacs": round(m * n * k / ms[best] / 1e6, 1),
                    "over_one_row": round(ms[best] / one, 2),
                    "rounds_dropped": dropped,
                }
            )
    return out


@torch.inference_mode()
def forward(rows: list[int], repeats: int, context: int) -> dict:
    from hfspec.cpu import fast
    from hfspec.models import gguf_native
    from hfspec.models.adapter import forward as model_forward
    from hfspec.models.kv_cache import KVState

    t0 = time.perf_counter()
    model = gguf_native.load(str(TARGET), "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "target")
    loaded = time.perf_counter() - t0
    report = fast.accelerate(model)
    ids = torch.arange(100, 100 + context)[None]
    kv = KVState(1, torch.device("cpu"), model)
    model_forward(
        model, ids, kv.extend_mask(torch.ones_like(ids)), torch.arange(context)[None], kv.cache, logits_to_keep=1
    )
    start = kv.length

    def step(k: int) -> None:
        feed = ids[:, -k:]
        kv.snapshot()
        model_forward(
            model,
            feed,
            kv.extend_mask(torch.ones_like(feed)),
            torch.arange(start, start + k)[None],
            kv.cache,
            logits_to_keep=0,
        )
        kv.keep(torch.zeros(1, dtype=torch.long), start, feed)

    seconds, dropped = quiet_rounds([lambda k=k: step(k) for k in rows], repeats)
    best = dict(zip(rows, seconds))
    return {
        "load_s": round(loaded, 1),
        "quantized_layers": report.quantized,
        "ms": {k: round(t * 1e3, 1) for k, t in best.items()},
        "over_one_row": {k: round(t / best[rows[0]], 2) for k, t in best.items()},
        "rounds_dropped": dropped,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=20, help="rounds of calls in 'layers' (the fastest counts)")
    parser.add_argument("--forward-repeats", type=int, default=5, help="rounds of forwards (the fastest counts)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["layers", "forward"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "threads": torch.get_num_threads(),
        "clock": "thread CPU time" if args.threads == 1 else "wall",
        "isa": quant.kernel().library.isa,
        "shapes": quant.kernel().shapes,
        "load_before": os.getloadavg(),
    }
    if "layers" not in args.skip:
        result["layers"] = layers(args.rows, args.repeats)
    if "forward" not in args.skip:
        result["forward"] = forward(args.rows, args.forward_repeats, args.context)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
