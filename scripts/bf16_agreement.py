"""Greedy hfspec in bfloat16 against the model's own generate(), on tiny random models with many near-ties.

Builds a random Llama target (--layers, --hidden, --vocab; the output layer scaled by --sharpness: small values give
close top-two logits) and a draft (the target's weights plus noise), loads both in bfloat16, and runs --prompts
random prompts x --new-tokens tokens through chain gamma = 1, chain gamma = 4, a tree of 8 nodes and draft="ngram",
each prompt alone. Two modes: "kernel" (hfspec.fast.accelerate on target and draft, as hfspec loads its models on
CPU) and "torch" (torch's own linears and attention). Each is compared with two references: the same model's own
generate() in that mode, and the eager model's generate() (torch). Prints one JSON object: identical prompts per
setting, with lscpu's model name and torch's threads.

Runs against any hfspec on PYTHONPATH, e.g. an older checkout, to compare.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: another checkout can be compared
from hfspec import SpeculativeGenerator  # noqa: E402
from hfspec.cpu import fast  # noqa: E402
from hfspec.measure.timing import cpu_model  # noqa: E402

SETTINGS = {
    "chain, γ = 1": dict(gamma=1, tree=None),
    "chain, γ = 4": dict(gamma=4, tree=None),
    "tree of 8 nodes": dict(tree=8),
    'draft="ngram"': dict(gamma=3, tree=None),
}


def models(args) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden + 8,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        target.lm_head.weight.mul_(args.sharpness)
    draft = LlamaForCausalLM(config)
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(torch.randn(w.shape, generator=g) * w.std().nan_to_num(0.0) * 0.3)
    for m in (target, draft):
        m.generation_config.pad_token_id = 0
    return target.to(torch.bfloat16).eval(), draft.to(torch.bfloat16).eval()


def own(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = []
    for p in prompts:
        x = torch.tensor([p])
        out.append(
            model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, min_new_tokens=new
            )[0, len(p) :].tolist()
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--sharpness", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = models(args)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4, args.vocab) for _ in range(rng.randrange(4, 30))] for _ in range(args.prompts)]
    eager = own(target, prompts, args.new_tokens)
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "model": vars(args)}
    for mode in ("kernel", "torch"):
        if mode == "kernel":
            fast.accelerate(target)
            fast.accelerate(draft)
        reference = own(target, prompts, args.new_tokens) if mode == "kernel" else eager
        rows = {}
        for name, setting in SETTINGS.items():
            gen = SpeculativeGenerator(target, "ngram" if "ngram" in name else draft, None)
            got = [
                gen.generate([p], max_new_tokens=args.new_tokens, **setting).sequences[0, len(p) :].tolist()
                for p in prompts
            ]
            rows[name] = {
                "identical_to_own_generate": f"{sum(a == b for a, b in zip(got, reference))}/{len(prompts)}",
                "identical_to_eager_generate": f"{sum(a == b for a, b in zip(got, eager))}/{len(prompts)}",
            }
        result[mode] = rows
        fast.restore(target)
        fast.restore(draft)
    print(json.dumps(result, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
