"""Does running two generate calls at once pay? The measurement behind the generator's one-call-at-a-time lock.

On the offline pair (SmolLM2-135M-Instruct and its shipped draft, fp32, hfspec's CPU kernel), two prompts of
greedy decoding at a fixed γ, three ways, interleaved over several rounds (medians):
  serial:   one generator, one prompt after the other (what the lock makes of two threads sharing a generator);
  threads:  two generators on the same models, one thread each, at once (what the lock forbids on one);
  batched:  one generator, both prompts in one call.
Prints tokens per second of each and the ratios; record ``lscpu``'s model name and the thread count beside them.

    PYTHONPATH=$PWD python scripts/concurrency.py [--rounds 5] [--new-tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time

import torch

from hfspec import SpeculativeGenerator

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is in two sentences."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    first = SpeculativeGenerator.from_pretrained("offline", "shipped", dtype="float32")
    second = SpeculativeGenerator(first.target, first.draft, first.tokenizer)  # the same models, its own state
    tok = first.tokenizer
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]
    settings = dict(max_new_tokens=args.new_tokens, gamma=args.gamma, tree=None, eos_token_id=[])

    def serial() -> int:
        return sum(first.generate(x, **settings).stats.committed for x in ids)

    def threads() -> int:
        counts = [0, 0]

        def run(i: int, gen: SpeculativeGenerator) -> None:
            counts[i] = gen.generate(ids[i], **settings).stats.committed

        workers = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate((first, second))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return sum(counts)

    def batched() -> int:
        width = max(x.shape[1] for x in ids)
        batch = torch.stack([torch.nn.functional.pad(x[0], (width - x.shape[1], 0)) for x in ids])
        mask = torch.stack([torch.arange(width) >= width - x.shape[1] for x in ids]).long()
        return first.generate(batch, mask, **settings).stats.committed

    ways = {"serial": serial, "threads": threads, "batched": batched}
    for way in ways.values():  # warm-up: the kernel's build and plan, allocators
        way()
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in list(ways)[r % 3 :] + list(ways)[: r % 3]:  # rotate the order
            t0 = time.perf_counter()
            tokens = ways[name]()
            rates[name].append(tokens / (time.perf_counter() - t0))
    median = {name: statistics.median(v) for name, v in rates.items()}
    print(
        f"{platform.processor() or platform.machine()}, torch threads {args.threads}, γ={args.gamma}, "
        f"{args.new_tokens} new tokens per prompt, {args.rounds} rounds"
    )
    for name, rate in median.items():
        print(f"  {name:8s} {rate:7.1f} tokens/s  ({rate / median['serial']:.2f}x serial)")


if __name__ == "__main__":
    main()
