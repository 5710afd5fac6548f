"""The int8 kernel on a layer's blocks as the file stores them against the same blocks repacked at load.

Random blocks in the given formats and shapes (default: the offline SmolLM2-135M target's, Q4_1 MLP layers and its
Q8_0 tied head); per row count, the best of ``--reps`` calls of each layout, taking turns. Where this build packs
nothing (AVX-512, or no F16C) it says so. Prints JSON with ``lscpu``'s model name and the threads.

    python scripts/int8_layout_speed.py [--threads 2] [--rows 1,4,16,32] [--layers Q4_1:1536x576,Q8_0:49152x576]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_int8_kernel import blocks  # noqa: E402

from hfspec.cpu import int8  # noqa: E402


def model_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--layers", default="Q4_1:1536x576,Q4_1:576x1536,Q8_0:49152x576", help="FMT:NxK,...")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = int8.kernel()
    if kernel is None:
        raise SystemExit("no int8 kernel in this build")
    results = []
    for spec in args.layers.split(","):
        fmt, shape = spec.split(":")
        n, k = (int(v) for v in shape.split("x"))
        w, typ = blocks(fmt, n, k), GGMLQuantizationType[fmt].value
        packed = int8.pack(w, typ, k, kernel)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k)
            layouts = {"file": None, "packed": packed} if packed is not None else {"file": None}
            best = dict.fromkeys(layouts, float("inf"))
            for _ in range(args.reps):
                for name, p in layouts.items():
                    t0 = time.perf_counter()
                    int8.linear(x, w, fmt, typ, None, kernel, p)
                    best[name] = min(best[name], time.perf_counter() - t0)
            row = {"layer": f"{fmt} {n}x{k}", "rows": m}
            row.update({f"{name}_ms": round(t * 1e3, 3) for name, t in best.items()})
            row.update({f"{name}_gmacs": round(m * n * k / t / 1e9, 1) for name, t in best.items()})
            if packed is not None:
                row["speedup"] = round(best["file"] / best["packed"], 2)
            results.append(row)
            print(row, file=sys.stderr)
    info = {"cpu": model_name(), "threads": args.threads, "isa": kernel.isa, "packs": packed is not None}
    print(json.dumps({**info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
