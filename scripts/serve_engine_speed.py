"""Does the server's engine really batch? Total tokens per second at 1 and at 16 concurrent requests.

On a pair (default: the offline preset, SmolLM2-135M-Instruct with its shipped EAGLE-3 head, on hfspec's CPU
kernels), greedy chat requests through one ``BatchEngine``, four ways, each after a warm-up:
  1 client:       the requests one after another (each submitted when the last one finished), defaults (γ auto);
  1 at γ = 0:     the same, plain decoding;
  16 concurrent:  16 requests submitted at once, defaults;
  16 at γ = 0:    the same 16 at once, plain decoding in the same batching.
Prints total completion tokens per second of each and the ratios (bars: 16 concurrent ≥ 3× 1 client, and
≥ 1.3× γ = 0). Record ``lscpu``'s model name, the thread count and whether the machine was busy beside them.

    PYTHONPATH=$PWD python scripts/serve_engine_speed.py [--config smollm2-offline] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import threading
import time

import torch

from hfspec import api
from hfspec.serve.engine import BatchEngine
from hfspec.serve.events import Done, Request, Usage

TOPICS = [
    "the sea",
    "a hash table",
    "photosynthesis",
    "the French revolution",
    "binary search",
    "a rainbow",
    "gravity",
    "the internet",
    "volcanoes",
    "a compiler",
    "bees",
    "the moon landing",
    "recursion",
    "coffee",
    "black holes",
    "the printing press",
]


async def run(engine: BatchEngine, requests: list[Request], concurrent: bool) -> tuple[list[Usage], float]:
    """(each request's usage, seconds) of ``requests``, all at once or one after another."""
    loop = asyncio.get_running_loop()

    async def one(request: Request) -> Usage:
        async for event in engine.submit(request, loop).events():
            if isinstance(event, Done):
                assert event.finish_reason in ("stop", "length"), event
                return event.usage
        raise AssertionError("no Done")

    start = time.perf_counter()
    if concurrent:
        usages = list(await asyncio.gather(*(one(r) for r in requests)))
    else:
        usages = [await one(r) for r in requests]
    return usages, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-offline")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=4, help="requests in the one-client run")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = api.load(api.resolve_preset(config=args.config))
    tok = gen.tokenizer
    prompts = [
        tuple(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Explain {topic} in a short paragraph."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for topic in TOPICS
    ]

    def requests(gamma: int | str, count: int = len(prompts)) -> list[Request]:
        return [
            Request(f"r{i}", p, args.new_tokens, temperature=0.0, gamma=gamma) for i, p in enumerate(prompts[:count])
        ]

    engine = BatchEngine.from_generator(gen, model_name=args.config, max_batch=16, max_queue=64)
    engine.run_here = True  # the loop on the main thread, as hfspec serve runs it; the clients on another

    async def measure() -> dict[str, tuple[list[Usage], float]]:
        await run(engine, requests("auto", 2), concurrent=True)  # warm-up: costs measured, kernels touched
        return {
            "1 client": await run(engine, requests("auto", args.single), concurrent=False),
            "1 at γ = 0": await run(engine, requests(0, args.single), concurrent=False),
            "16 concurrent": await run(engine, requests("auto"), concurrent=True),
            "16 at γ = 0": await run(engine, requests(0), concurrent=True),
        }

    results: dict[str, tuple[list[Usage], float]] = {}

    def clients() -> None:
        try:
            results.update(asyncio.run(measure()))
        finally:
            engine.stop()

    thread = threading.Thread(target=clients)
    thread.start()
    engine.run()
    thread.join()
    rate = {name: sum(u.completion_tokens for u in usages) / seconds for name, (usages, seconds) in results.items()}
    print(f"{args.config}: {platform.processor() or platform.machine()}, {args.threads} torch threads")
    for name, (usages, seconds) in results.items():
        tokens, passes = sum(u.completion_tokens for u in usages), sum(u.target_passes for u in usages)
        drafted = sum(u.drafted for u in usages)
        print(
            f"  {name:14s} {tokens:5d} tokens in {seconds:6.2f} s: {rate[name]:7.1f} tokens/s; per row and pass "
            f"{drafted / passes:.2f} drafted, {tokens / passes:.2f} tokens"
        )
    print(f"  16 concurrent / 1 client: {rate['16 concurrent'] / rate['1 client']:.2f}× (bar 3×)")
    print(f"  16 concurrent / γ = 0:    {rate['16 concurrent'] / rate['16 at γ = 0']:.2f}× (bar 1.3×)")
    print(f"  1 client / γ = 0:         {rate['1 client'] / rate['1 at γ = 0']:.2f}× (speculation must not cost speed)")


if __name__ == "__main__":
    main()
