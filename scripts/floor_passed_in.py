"""The floor with models passed in: the shipped draft and a useless (random) one given to SpeculativeGenerator as
models, defaults on, against the target's own ``generate()``.

A user who builds ``SpeculativeGenerator(target, draft, tokenizer)`` from models of their own gets them as they are
(no kernels unless asked). The shipped draft should never cost speed, greedy or sampled (T = 0.7), and with a draft
whose guesses are never accepted gamma="auto" should fall back to plain decoding and cost at most a few percent.
Interleaved prompt by prompt, the order rotating; tokens per second leave out the prompt (the tokens after the
first ÷ their seconds). Prints one JSON object with lscpu's model name and torch's threads.

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
    shipped = AutoModelForCausalLM.from_pretrained(assets.shipped_draft_path(), dtype=torch.float32).eval()
    torch.manual_seed(0)
    useless = AutoModelForCausalLM.from_config(shipped.config, dtype=torch.float32).eval()
    gens = {
        "shipped": SpeculativeGenerator(target, shipped, tok),
        "useless": SpeculativeGenerator(target, useless, tok),
    }
    prompts = [p["prompt"] for p in load_prompts(None)[: args.prompts]]

    def plain(sample: bool):
        def run(ids, s):
            extra = (
                {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0} if sample else {"do_sample": False}
            )
            kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new)
            return target.generate(ids, **kw, **extra, streamer=s)

        return run

    def hfspec(name: str, sample: bool):
        extra = {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0} if sample else {"do_sample": False}
        return lambda ids, s: gens[name].generate(ids, max_new_tokens=args.new, eos_token_id=[], streamer=s, **extra)

    runs = {
        "plain": plain(False),
        "shipped": hfspec("shipped", False),
        "useless": hfspec("useless", False),
        "plain T0.7": plain(True),
        "shipped T0.7": hfspec("shipped", True),
    }
    warm = chat_ids(tok, "Hello.")
    for run in runs.values():
        rate(lambda s, run=run: run(warm, s), args.new)
    rows = []
    names = list(runs)
    for i, text in enumerate(prompts):
        ids = chat_ids(tok, text)
        row = {}
        for name in names[i % len(names) :] + names[: i % len(names)]:
            torch.manual_seed(i)
            row[name] = rate(lambda s, name=name: runs[name](ids, s), args.new)
        rows.append(row)

    def ratio(name: str, base: str) -> dict:
        per = [r[name] / r[base] for r in rows]
        return {"median": round(statistics.median(per), 3), "per_prompt": [round(x, 3) for x in per]}

    print(
        json.dumps(
            {
                "cpu": cpu_model(),
                "threads": torch.get_num_threads(),
                "new_tokens": args.new,
                "tok_s": {name: round(statistics.median(r[name] for r in rows), 2) for name in runs},
                "shipped_x_plain": ratio("shipped", "plain"),
                "useless_x_plain": ratio("useless", "plain"),
                "shipped_T0.7_x_plain_T0.7": ratio("shipped T0.7", "plain T0.7"),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
