"""Tokens per target pass, chains against draft trees, on the offline pair at greedy (counts, not time).

The target is SmolLM2-135M-Instruct (``hfspec.models.assets.offline_target_path``), the draft the model shipped with
hfspec (``hfspec.models.assets.shipped_draft_path``), or with ``--drafter eagle3`` the shipped EAGLE-3 head. Each
setting generates --new-tokens for the first --prompts chat prompts of hfspec/data/prompts/bench.jsonl, one batch, and
reports per setting: tokens committed per target pass
(vLLM's mean accepted length), draft forwards per pass, tree nodes verified per pass, and the steps by accepted
depth. Every setting's output must equal the first's (greedy is exact, so they all equal the target's own).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hfspec import SpeculativeGenerator  # noqa: E402
from hfspec.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from hfspec.models.assets import offline_target_float32, shipped_draft_path, shipped_head_path  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "hfspec" / "data" / "prompts" / "bench.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--trees", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--drafter", choices=["model", "eagle3"], default="model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target_dir = offline_target_float32(progress=False)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    if args.drafter == "model":
        draft = AutoModelForCausalLM.from_pretrained(shipped_draft_path(), dtype=torch.float32).eval()
    else:
        draft = Eagle3Drafter.from_pretrained(shipped_head_path(), target)
    gen = SpeculativeGenerator(target, draft, tok)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][: args.prompts]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    batch = tok(chats, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    settings = [("chain", g) for g in args.gammas] + [("tree", n) for n in args.trees]
    results, first = {}, None
    for kind, value in settings:
        kwargs = {"gamma": value} if kind == "chain" else {"tree": value}
        out = gen.generate(
            batch.input_ids, batch.attention_mask, max_new_tokens=args.new_tokens, eos_token_id=[], **kwargs
        )
        first = out.sequences if first is None else first
        assert torch.equal(out.sequences, first), f"{kind} {value}: greedy output differs"
        passes = sum(r.target_passes for r in out.stats.rows)
        results[f"{kind} {value}"] = {
            "tokens_per_pass": round(out.stats.mean_accepted_length, 3),
            "draft_forwards_per_pass": round(out.stats.draft_passes / out.stats.target_passes, 2),
            "nodes_per_row_pass": round(out.stats.tree_nodes / passes, 2) if out.stats.tree_nodes else None,
            "steps_by_accepted_depth": list(out.stats.depth_histogram) or None,
        }
        print(kind, value, results[f"{kind} {value}"], file=sys.stderr, flush=True)
    best = max((k for k in results if k.startswith("chain")), key=lambda k: results[k]["tokens_per_pass"])
    print(
        json.dumps(
            {
                "drafter": args.drafter,
                "prompts": args.prompts,
                "new_tokens": args.new_tokens,
                "best_chain": best,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
