"""How far int8 arithmetic moves a GGUF target: teacher-forced top-1 agreement with float32, and both perplexities.

The same file is loaded twice with its blocks kept (``hfspec.models.gguf_native``): ``arithmetic="float32"`` (the
dequantized model, as transformers loads it) and ``"int8"`` (llama.cpp's integer arithmetic). Both read the same
code -- Python source from this interpreter's standard library, a fixed list of modules, cut into windows of
``--window`` tokens -- and at every position the next-token argmax of each is compared and the negative
log-likelihood of the true next token summed. Prints JSON with the CPU's ``lscpu`` model name.

    python scripts/int8_quality.py [--file PATH] [--positions 2048] [--window 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hfspec.cpu import fast
from hfspec.models import gguf_native

DEFAULT = Path.home() / ".cache/hfspec/qwen2.5-coder-1.5b-instruct/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
MODULES = ("textwrap", "json.decoder", "heapq", "bisect", "fractions", "statistics", "shlex", "difflib", "csv")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def code_text() -> str:
    import importlib

    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in MODULES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(args.file.parent), gguf_file=args.file.name)
    ids = tok(code_text(), return_tensors="pt").input_ids[0]
    windows = [ids[i : i + args.window + 1] for i in range(0, ids.numel() - args.window - 1, args.window)]
    windows = windows[: math.ceil(args.positions / args.window)]
    seconds, top1, nll = {}, {}, {}
    for arithmetic in ("float32", "int8"):
        model = gguf_native.load(str(args.file.parent), args.file.name, "target", arithmetic=arithmetic)
        fast.accelerate(model)
        t0 = time.perf_counter()
        top1[arithmetic], nll[arithmetic] = [], 0.0
        with torch.inference_mode():
            for w in windows:
                logits = model(w[None, :-1]).logits[0].float()  # (T, V)
                top1[arithmetic].append(logits.argmax(-1))
                logp = torch.log_softmax(logits, -1)[torch.arange(w.numel() - 1), w[1:]]
                nll[arithmetic] -= float(logp.double().sum())
        seconds[arithmetic] = round(time.perf_counter() - t0, 1)
        del model
    total = sum(w.numel() - 1 for w in windows)
    agree = sum(int((a == b).sum()) for a, b in zip(top1["int8"], top1["float32"]))
    result = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "file": args.file.name,
        "text": f"Python standard library: {', '.join(MODULES)}",
        "positions": total,
        "top1_agreement_int8_vs_float32": round(agree / total, 4),
        "perplexity": {name: round(math.exp(nll[name] / total), 4) for name in nll},
        "seconds": seconds,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
