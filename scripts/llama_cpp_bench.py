"""llama.cpp and hfspec side by side on one GGUF pair, in one run (llama.cpp's tools from build_llama_cpp.py).

Measured, with the CPU's lscpu model name, the thread count and the load average:
  bench       llama-bench on the target: pp at k = 1, 2, 4, 8, 16 and tg (``-n 32``), all at depth 256, so
              v(k) = k · pp1 / ppk; and the draft's tg, so c = t_draft / t_target = tg_target / tg_draft
  plain       llama-server (started here on a free loopback port) on the target alone: greedy /completion
  spec-N      llama-speculative-simple --spec-type draft-simple -md DRAFT --spec-draft-n-max N, greedy (its
              default N is 3; --n-max sweeps a few and the best by median is named)
  f32-g0, f32 hfspec at γ = 0 and with its defaults on the same files, arithmetic="float32"
  int8-g0, int8   the same with arithmetic="int8" (llama.cpp's integer arithmetic on the blocks)
on code prompts (the package's code and code-edit prompts under Qwen's chat template, rendered once as text that
every contender gets), greedy, --new tokens each (every contender stops at end-of-sequence), the contenders taking
turns prompt by prompt with the order rotating, so that a busy machine disturbs them alike. Reported per contender:
tokens per second end to end (prompt processing included) and after the prompt, × llama.cpp plain (median of the
per-prompt ratios, end to end), llama.cpp's draft acceptance, whether hfspec's output equals its own γ = 0 (it
must) and whether llama.cpp's speculative text equals its plain text (not promised by llama.cpp).

    python scripts/build_llama_cpp.py        # once: prints the bin folder
    python scripts/llama_cpp_bench.py --json runs/llama_cpp.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from qwen_pair_bench import FirstToken  # scripts/ is on the path of a script run from it
from tqdm.auto import tqdm

from hfspec import FixedGamma, SpeculativeGenerator
from hfspec.bench import llama_cpp
from hfspec.bench.field import load_prompts
from hfspec.measure.timing import cpu_model
from hfspec.models import paths

CACHE = Path(os.environ.get("HFSPEC_CACHE", "~/.cache/hfspec")).expanduser()
TARGET = CACHE / "qwen2.5-coder-1.5b-instruct/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
DRAFT = CACHE / "qwen2.5-coder-0.5b-instruct/Qwen2.5-Coder-0.5B-Instruct.gguf"
BIN = CACHE / "llama.cpp/0.3.36/build/bin"
PROMPTS = paths.DATA / "prompts"
HFSPEC = {"f32-g0": ("float32", 0), "f32": ("float32", None), "int8-g0": ("int8", 0), "int8": ("int8", None)}


def run_hfspec(gen: SpeculativeGenerator, text: str, new: int, gamma: int | None) -> dict:
    ids = gen.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    streamer = FirstToken()
    kwargs = {"gamma": FixedGamma(gamma)} if gamma is not None else {}
    start = time.perf_counter()
    out = gen.generate(ids, max_new_tokens=new, do_sample=False, streamer=streamer, **kwargs)
    end = time.perf_counter()
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    return {
        "prompt_tokens": ids.shape[1],
        "new_tokens": len(tokens),
        "tok_s": len(tokens) / (end - start),
        "decode_tok_s": (len(tokens) - 1) / (end - streamer.first) if len(tokens) > 1 else None,
        "per_pass": out.stats.mean_accepted_length,
        "tokens": tokens,
        "text": gen.tokenizer.decode(tokens),
    }


class Server:
    """llama-server on the target alone, on a free loopback port, for plain greedy decoding."""

    def __init__(self, binary: Path, target: Path, threads: int, wait: float = 300):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = llama_cpp.server_command(binary, target, port=port, threads=threads, slots=1, slot_context=4096)
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(llama_cpp.tool_failed(" ".join(map(str, command)), self.process.returncode))
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise SystemExit(f"llama-server did not answer /health within {wait:.0f} s")

    def __call__(self, text: str, new: int) -> dict:
        body = {"prompt": text, "n_predict": new, "temperature": 0, "cache_prompt": False, "return_tokens": True}
        r = httpx.post(self.url + "/completion", json=body, timeout=600)
        r.raise_for_status()
        res = r.json()
        t = res["timings"]
        return {
            "prompt_tokens": t["prompt_n"],
            "new_tokens": t["predicted_n"],
            "tok_s": t["predicted_n"] / ((t["prompt_ms"] + t["predicted_ms"]) / 1e3),
            "decode_tok_s": t["predicted_per_second"],
            "tokens": res.get("tokens"),
            "text": res["content"],
        }

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def run_speculative(binary: Path, args: argparse.Namespace, text: str, n_max: int) -> dict:
    command = llama_cpp.speculative_command(
        binary, args.target, args.draft, text, threads=args.threads, new=args.new, n_max=n_max
    )
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(llama_cpp.tool_failed("llama-speculative-simple", proc.returncode, proc.stderr))
    run = llama_cpp.parse_speculative(proc.stdout, proc.stderr, text)
    return {
        "prompt_tokens": run.prompt_tokens,
        "new_tokens": run.new_tokens,
        "tok_s": run.end_to_end_tok_s,
        "decode_tok_s": run.decode_tok_s,
        "acceptance": run.acceptance,
        "text": run.text,
    }


def bench(binary: Path, args: argparse.Namespace) -> dict:
    def one(model: Path, ks: list[int]) -> list[llama_cpp.BenchRow]:
        command = llama_cpp.bench_command(
            binary, model, threads=args.threads, ks=ks, new=32, depth=args.depth, reps=args.reps
        )
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(llama_cpp.tool_failed("llama-bench", proc.returncode, proc.stderr))
        return llama_cpp.parse_bench(proc.stdout)

    target = llama_cpp.verification_costs(one(args.target, [1, 2, 4, 8, 16]), args.depth)
    draft = llama_cpp.verification_costs(one(args.draft, [0]), args.depth)
    return {"target": target, "draft_tg": draft["tg"], "c": target["tg"] / draft["tg"]}


def same_text(a: str, b: str) -> str:
    """'same', 'prefix' (one stops earlier: an overshoot or end-of-sequence), or 'differs at char N'."""
    if a == b:
        return "same"
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return "prefix" if n == min(len(a), len(b)) else f"differs at char {n}"


def summary(rows: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        have = [r[name] for r in rows if name in r]
        entry = {
            "tok_s": statistics.median(h["tok_s"] for h in have),
            "decode_tok_s": statistics.median(h["decode_tok_s"] for h in have),
            "x_plain": statistics.median(r[name]["tok_s"] / r["plain"]["tok_s"] for r in rows if "plain" in r),
        }
        if "acceptance" in have[0]:
            entry["acceptance"] = statistics.median(h["acceptance"] for h in have if h["acceptance"] is not None)
        if "per_pass" in have[0]:
            entry["per_pass"] = statistics.median(h["per_pass"] for h in have)
        for key in ("same_as_g0", "same_as_plain"):
            if key in have[0]:
                entry[key] = [h[key] for h in have]
        out[name] = entry
    return out


def table(result: dict) -> str:
    lines = [f"machine: {result['cpu']}, {result['threads']} threads, load average {result['load_average']}"]
    b = result.get("bench")
    if b:
        t = b["target"]
        pp = "  ".join(f"pp{k} {v:.1f}" for k, v in t["pp"].items())
        v = "  ".join(f"v({k}) {x:.2f}" for k, x in (t["v"] or {}).items())
        lines += [
            f"llama-bench target @ d{t['depth']}: {pp}  tg {t['tg']:.1f} tok/s",
            f"  {v}",
            f"  draft tg {b['draft_tg']:.1f} tok/s, c = {b['c']:.2f}",
        ]
    cols = ("tok_s", "decode_tok_s", "x_plain", "acceptance", "per_pass")
    lines.append(f"\n{'contender':<10}" + "".join(f"{c:>14}" for c in cols) + "  output")
    for name, e in result["summary"].items():
        cells = [f"{e[c]:.2f}" if isinstance(e.get(c), float) else "-" for c in cols]
        check = e.get("same_as_g0") or e.get("same_as_plain") or ""
        lines.append(f"{name:<10}" + "".join(f"{c:>14}" for c in cells) + f"  {check}")
    if result.get("best_n_max") is not None:
        lines.append(f"best llama.cpp --spec-draft-n-max: {result['best_n_max']} (default 3)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, default=BIN, help=f"llama.cpp's bin folder (default: {BIN})")
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--draft", type=Path, default=DRAFT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="prompts from each of code and code-edit (default 2)")
    parser.add_argument("--new", type=int, default=96, help="new tokens per prompt (default: 96)")
    parser.add_argument("--n-max", default="2,3,4,6,8", help="llama.cpp --spec-draft-n-max values (default 2,3,4,6,8)")
    parser.add_argument("--depth", type=int, default=256, help="llama-bench context depth (default: 256)")
    parser.add_argument("--reps", type=int, default=3, help="llama-bench repetitions (default: 3)")
    parser.add_argument("--skip", default="", help="comma-separated: bench, spec, hfspec")
    parser.add_argument("--json", type=Path, default=None, help="write everything as JSON here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    tools = {t: args.bin / t for t in ("llama-bench", "llama-speculative-simple", "llama-server")}
    missing = [str(p) for p in tools.values() if not p.exists()]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run scripts/build_llama_cpp.py or pass --bin")
    torch.set_num_threads(args.threads)
    result: dict = {"cpu": cpu_model(), "threads": args.threads, "new_tokens": args.new, "files": {}}
    result["files"] = {"target": str(args.target), "draft": str(args.draft)}
    if "bench" not in skip:
        result["bench"] = bench(tools["llama-bench"], args)
        print(json.dumps(result["bench"]), file=sys.stderr, flush=True)
    n_maxes = [int(n) for n in args.n_max.split(",")] if "spec" not in skip else []
    gens = {}
    if "hfspec" not in skip:
        for arithmetic in ("float32", "int8"):
            gens[arithmetic] = SpeculativeGenerator.from_pretrained(
                str(args.target.parent),
                str(args.draft.parent),
                gguf_file=args.target.name,
                draft_gguf_file=args.draft.name,
                arithmetic=arithmetic,
            )
    tok = next(iter(gens.values())).tokenizer if gens else None
    if tok is None:
        from transformers import AutoTokenizer  # only without hfspec's contenders: the template still comes from it

        tok = AutoTokenizer.from_pretrained(str(args.target.parent), gguf_file=args.target.name)
    prompts = (
        load_prompts(PROMPTS / "code.jsonl")[: args.prompts] + load_prompts(PROMPTS / "code-edit.jsonl")[: args.prompts]
    )
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below stops llama-server
    server = Server(tools["llama-server"], args.target, args.threads)
    try:
        runs = {"plain": lambda text: server(text, args.new)}
        for n in n_maxes:
            runs[f"spec-{n}"] = lambda text, n=n: run_speculative(tools["llama-speculative-simple"], args, text, n)
        for name, (arithmetic, gamma) in HFSPEC.items():
            if arithmetic in gens:
                runs[name] = lambda text, g=gens[arithmetic], gamma=gamma: run_hfspec(g, text, args.new, gamma)
        for gen in gens.values():  # warm-up, never timed: gamma="auto" measures its costs on its first request
            run_hfspec(gen, texts[-1], 16, None)
        server(texts[-1], 16)
        names, rows = list(runs), []
        for i, (prompt, text) in enumerate(tqdm(list(zip(prompts, texts)), desc="prompts", disable=args.no_progress)):
            row = {"id": prompt["id"]}
            for name in names[i % len(names) :] + names[: i % len(names)]:
                row[name] = runs[name](text)
            for name in names:
                if name.startswith("spec-"):
                    row[name]["same_as_plain"] = same_text(row[name]["text"], row["plain"]["text"])
                elif name in ("f32", "int8"):
                    row[name]["same_as_g0"] = row[name]["tokens"] == row[f"{name}-g0"]["tokens"]
            if "int8-g0" in row:
                row["int8-g0"]["same_as_plain"] = same_text(row["int8-g0"]["text"], row["plain"]["text"])
            rows.append(row)
            print(
                json.dumps(
                    {
                        k: {m: v for m, v in r.items() if m not in ("tokens", "text")} if isinstance(r, dict) else r
                        for k, r in row.items()
                    }
                ),
                file=sys.stderr,
                flush=True,
            )
    finally:
        server.close()
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    result["rows"] = rows
    result["summary"] = summary(rows, names)
    specs = {n: result["summary"][f"spec-{n}"]["tok_s"] for n in n_maxes}
    result["best_n_max"] = max(specs, key=specs.get) if specs else None
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
