"""One target step t(1) and verification costs v(k) = t(k) / t(1) of a GGUF target, in int8 and float32 arithmetic.

Loads the file with its blocks kept (``hfspec.models.gguf_native``) once per arithmetic, puts it on hfspec's kernels,
fills hfspec's buffered cache with ``--depth`` tokens, then times a forward of k new tokens against it (the cache
cropped back after each), the contenders taking turns so that a busy machine disturbs all alike: ``int8`` and
``float32`` as hfspec runs them (each decoder layer in one kernel call, ``hfspec.cpu.layer``), and
``int8-modules``, the same int8 model with its layers run module by module (what that one call saves), and
``int8-noamx``, the same int8 model with the kernel's AMX path off (where the CPU has AMX; the bits are the
same, so this shows what the tiles save). Prints JSON
with the CPU's ``lscpu`` model name and the load average: on a shared machine the numbers say so.

    python scripts/int8_speed.py [--file PATH] [--threads 2] [--depth 256] [--ks 1,2,4,8,16] [--reps 7]
        [--contenders int8,int8-modules,int8-noamx,float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from hfspec.cpu import fast, int8
from hfspec.cpu import layer as cpu_layer
from hfspec.models import gguf_native
from hfspec.models.kv_buffer import buffered_cache

DEFAULT = Path.home() / ".cache/hfspec/qwen2.5-coder-1.5b-instruct/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def load(path: Path, arithmetic: str):
    model = gguf_native.load(str(path.parent), path.name, "target", arithmetic=arithmetic)
    if model is None:
        raise SystemExit(f"{path} could not be loaded with its blocks kept")
    fast.accelerate(model)
    return model


@torch.inference_mode()
def step_seconds(model, cache, k: int, vocab: int, g: torch.Generator) -> float:
    ids = torch.randint(100, vocab - 100, (1, k), generator=g)
    t0 = time.perf_counter()
    model(ids, cache=cache, use_cache=True, logits_to_keep=k)
    seconds = time.perf_counter() - t0
    cache.crop(-k)  # back to the depth
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--contenders", default="int8,int8-modules,float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    names = args.contenders.split(",")
    loaded = {a: load(args.file, a) for a in ("int8", "float32") if any(n.startswith(a) for n in names)}
    models = {name: loaded[name.split("-")[0]] for name in names}
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    prompt = torch.randint(100, vocab - 100, (1, args.depth), generator=g)
    caches = {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = buffered_cache(args.depth + max(ks))
            model(prompt, cache=caches[name], use_cache=True, logits_to_keep=1)
    best = {name: dict.fromkeys(ks, float("inf")) for name in models}
    ik = int8.kernel()
    for _ in range(args.reps):
        for k in ks:
            for name, model in models.items():  # in turns: a busy spell hits all
                if name.endswith("-modules"):
                    cpu_layer.unuse(model)
                else:
                    cpu_layer.use(model, fast._KERNEL)
                if ik is not None:
                    ik.use_amx(not name.endswith("-noamx"))
                seconds = step_seconds(model, caches[name], k, vocab, g)
                best[name][k] = min(best[name][k], seconds)
    result = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "file": args.file.name,
        "depth": args.depth,
        "reps": args.reps,
        "note": "best of reps; on a shared machine the absolute times carry its load",
        "amx": bool(ik is not None and ik.use_amx(True)),
    }
    for name in models:
        t1 = best[name][ks[0]] if ks[0] == 1 else None
        result[name] = {
            "t_ms": {k: round(best[name][k] * 1e3, 2) for k in ks},
            "v": {k: round(best[name][k] / t1, 3) for k in ks} if t1 else None,
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
