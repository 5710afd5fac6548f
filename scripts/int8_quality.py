"""How far int8 arithmetic moves a GGUF target: teacher-forced top-1 agreement with float32, and both perplexities.

The same file is loaded twice with its blocks kept (``hfspec.models.gguf_native``): ``arithmetic="float32"`` (the
dequantized model, as transformers loads it) and ``"int8"`` (llama.cpp's integer arithmetic). Both read the same
code -- Python source from this interpreter's standard library, a fixed list of modules, cut into windows of
``--window`` tokens -- and at every position the next-token argmax of each is compared and the negative
log-likelihood of the true next token summed. Prints JSON with the CPU's ``lscpu`` model name.

Perplexity is given twice: over every position, and in ``llama-perplexity``'s protocol (each window of ``--window``
tokens read from its start, only its second half scored: positions window/2 .. window-2 predicting the next token).
With ``--llama-perplexity PATH`` (built by ``scripts/build_llama_cpp.py``) llama.cpp's own tool reads the same text
from a file with the same window and chunk count, and its estimate stands beside hfspec's in that protocol.

    python scripts/int8_quality.py [--file PATH] [--positions 2048] [--window 512] [--threads 2]
        [--llama-perplexity ~/.cache/hfspec/llama.cpp/0.3.36/build/bin/llama-perplexity]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import subprocess
import tempfile
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


def llama_perplexity(tool: Path, file: Path, text: str, window: int, chunks: int, threads: int) -> dict:
    """llama.cpp's own perplexity of ``file`` on ``text``: its final estimate, and the chunk count it read."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [str(tool), "-m", str(file), "-f", f.name, "-c", str(window), "-b", str(window), "--chunks", str(chunks)]
    cmd += ["-t", str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    log = out.stdout + out.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    read = re.search(r"calculating perplexity over (\d+) chunks", log)
    if final is None:
        raise SystemExit(f"no final estimate in llama-perplexity's output:\n{log[-2000:]}")
    return {
        "perplexity": float(final.group(1)),
        "plus_minus": float(final.group(2)),
        "chunks": int(read.group(1)) if read else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-perplexity", type=Path, default=None, help="llama.cpp's llama-perplexity binary")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(args.file.parent), gguf_file=args.file.name)
    text = code_text()
    ids = tok(text, return_tensors="pt").input_ids[0]
    windows = [ids[i : i + args.window + 1] for i in range(0, ids.numel() - args.window - 1, args.window)]
    windows = windows[: math.ceil(args.positions / args.window)]
    seconds, top1, nll, half = {}, {}, {}, {}
    first = args.window // 2  # llama-perplexity's protocol: the second half of each window is scored
    for arithmetic in ("float32", "int8"):
        model = gguf_native.load(str(args.file.parent), args.file.name, "target", arithmetic=arithmetic)
        fast.accelerate(model)
        t0 = time.perf_counter()
        top1[arithmetic], nll[arithmetic], half[arithmetic] = [], 0.0, 0.0
        with torch.inference_mode():
            for w in windows:
                logits = model(w[None, :-1]).logits[0].float()  # (T, V)
                top1[arithmetic].append(logits.argmax(-1))
                logp = torch.log_softmax(logits, -1)[torch.arange(w.numel() - 1), w[1:]]
                nll[arithmetic] -= float(logp.double().sum())
                half[arithmetic] -= float(logp[first : args.window - 1].double().sum())
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
        "perplexity_second_halves": {
            f"hfspec {name}": round(math.exp(half[name] / (len(windows) * (args.window - 1 - first))), 4)
            for name in half
        },
        "seconds": seconds,
    }
    if args.llama_perplexity is not None:
        llama = llama_perplexity(args.llama_perplexity, args.file, text, args.window, len(windows), args.threads)
        result["perplexity_second_halves"]["llama.cpp"] = llama["perplexity"]
        result["llama_perplexity"] = llama
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
