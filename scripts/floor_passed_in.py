"""The floor with models passed in: a useless (random) draft given to SpeculativeGenerator as a model, defaults on.

A user who builds ``SpeculativeGenerator(target, draft, tokenizer)`` from models of their own gets them as they are
(no kernels unless asked). With a draft whose guesses are never accepted, gamma="auto" should fall back to plain
decoding and cost at most a few percent against the target's own ``generate()``. Interleaved prompt by prompt, the
order alternating; tokens per second leave out the prompt (the tokens after the first ÷ their seconds). Prints one
JSON object with lscpu's model name and torch's threads.

    python scripts/floor_passed_in.py --prompts 8 --new 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from qwen_pair_bench import FirstToken, chat_ids  # scripts/ is on the path of a script run from it
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfspec import SpeculativeGenerator
from hfspec.bench.field import load_prompts
from hfspec.measure.timing import cpu_model
from hfspec.models import assets


def rate(run, new: int) -> float:
    streamer = FirstToken()
    run(streamer)
    return (new - 1) / (time.perf_counter() - streamer.first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = assets.offline_target_float32()
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoModelForCausalLM.from_pretrained(assets.shipped_draft_path()).config
    torch.manual_seed(0)
    useless = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = SpeculativeGenerator(target, useless, tok)
    prompts = [p["prompt"] for p in load_prompts(None)[: args.prompts]]
    runs = {
        "plain": lambda ids, s: target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            streamer=s,
        ),
        "useless": lambda ids, s: gen.generate(ids, max_new_tokens=args.new, eos_token_id=[], streamer=s),
    }
    warm = chat_ids(tok, "Hello.")
    for run in runs.values():
        rate(lambda s, run=run: run(warm, s), args.new)
    rows = []
    for i, text in enumerate(prompts):
        ids = chat_ids(tok, text)
        row = {}
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            row[name] = rate(lambda s, name=name: runs[name](ids, s), args.new)
        rows.append(row)
    ratios = [r["useless"] / r["plain"] for r in rows]
    print(
        json.dumps(
            {
                "cpu": cpu_model(),
                "threads": torch.get_num_threads(),
                "new_tokens": args.new,
                "plain_tok_s": statistics.median(r["plain"] for r in rows),
                "useless_tok_s": statistics.median(r["useless"] for r in rows),
                "useless_x_plain": statistics.median(ratios),
                "per_prompt": [round(x, 3) for x in ratios],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
