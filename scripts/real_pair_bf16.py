"""Greedy hfspec on a real bfloat16 target against the target's own generate(), with the CPU kernels on.

Loads a GGUF target and draft with transformers in bfloat16 (dequantized), accelerates both (hfspec.fast, as
hfspec.drafters.loading does on CPU), and for each of --prompts code prompts (chat template on) x --new-tokens tokens
compares greedy hfspec (the draft model, draft="ngram"; gamma and tree "auto", hfspec's defaults) with the
accelerated target's own generate(do_sample=False). With --eager it also runs the target on torch's kernels
(fast.suspended) for the second reference; with --torch nothing is accelerated (fast_kernels=False): hfspec on
torch's kernels against the model's own generate() on them. Prints one JSON object, with lscpu's model name and
torch's threads.

  python scripts/real_pair_bf16.py   # the Qwen2.5-Coder pair, fetched and verified as hfspec fetches it by name
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfspec import SpeculativeGenerator  # noqa: E402
from hfspec.cpu import fast  # noqa: E402
from hfspec.measure.timing import cpu_model  # noqa: E402
from hfspec.models import assets, wheels  # noqa: E402

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a C function that reverses a string in place.",
    "Explain what a Python list comprehension is, with one example.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a JavaScript function that debounces another function.",
    "Write a Rust function that counts the words in a string.",
]


def load(path: str):
    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.bfloat16).eval()
    return model, AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@torch.inference_mode()
def own(model, ids: torch.Tensor, new: int) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)
    return out[0, ids.shape[1] :].tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="a GGUF file (default: Qwen2.5-Coder-1.5B Q4_K_M)")
    parser.add_argument("--draft", default=None, help="a GGUF file (default: Qwen2.5-Coder-0.5B)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="also compare with the target on torch's kernels")
    parser.add_argument("--torch", action="store_true", help="torch's kernels throughout (fast_kernels=False)")
    parser.add_argument("--fixed", action="store_true", help="also the draft model at γ = 4 and as trees of 8 nodes")
    args = parser.parse_args(argv)
    args.target = args.target or str(wheels.fetch(wheels.QWEN_CODER_1_5B, assets.cache_dir()))
    args.draft = args.draft or str(wheels.fetch(wheels.QWEN_CODER_0_5B, assets.cache_dir()))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, tok = load(args.target)
    draft, _ = load(args.draft)
    reports = [] if args.torch else [fast.accelerate(target), fast.accelerate(draft)]
    result = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "target": args.target,
        "draft": args.draft,
        "dtype": "bfloat16",
        "kernels": "torch" if args.torch else "hfspec",
        "new_tokens": args.new_tokens,
        "load_s": round(time.perf_counter() - t0, 1),
        "accelerated": [
            {"layers": len(r.layers), "attention": r.attention, "activations": r.activations, "isa": r.isa}
            for r in reports
        ],
        "load_before": os.getloadavg(),
        "prompts": [],
    }
    model, lookup = SpeculativeGenerator(target, draft, tok), SpeculativeGenerator(target, "ngram", tok)
    runs = {"draft model": (model, {}), 'draft="ngram"': (lookup, {})}
    if args.fixed:
        runs.update(
            {"draft model, γ = 4": (model, dict(gamma=4, tree=None)), "draft model, trees of 8": (model, dict(tree=8))}
        )
    for text in PROMPTS[: args.prompts]:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        row = {"prompt": text, "prompt_tokens": ids.shape[1]}
        want = own(target, ids, args.new_tokens)
        if args.eager:
            with fast.suspended(target):
                row["own_generate_equals_eager_generate"] = own(target, ids, args.new_tokens) == want
        for name, (gen, setting) in runs.items():
            t = time.perf_counter()
            out = gen.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, **setting)
            got = out.sequences[0, ids.shape[1] : ids.shape[1] + out.stats.rows[0].committed].tolist()
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            row[name] = {
                "identical_to_own_generate": got == want,
                "first_difference": first,
                "accepted": out.stats.accepted,
                "drafted": out.stats.drafted,
                "seconds": round(time.perf_counter() - t, 1),
            }
        result["prompts"].append(row)
        print(json.dumps(row, ensure_ascii=False), file=sys.stderr, flush=True)
    for name in runs:
        same = sum(r[name]["identical_to_own_generate"] for r in result["prompts"])
        result[f"{name}: identical to the target's own generate()"] = f"{same}/{len(result['prompts'])}"
    if args.eager:
        same = sum(r["own_generate_equals_eager_generate"] for r in result["prompts"])
        result["the accelerated target's generate() identical to eager generate()"] = f"{same}/{len(result['prompts'])}"
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
