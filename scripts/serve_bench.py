#!/usr/bin/env python3
"""Concurrent clients against OpenAI-compatible servers: throughput, time to first token, per-token latency.

Each server is ``LABEL=URL`` (a running server: hfspec serve, llama-server, vLLM) or, with ``--start``,
``LABEL=ARGS`` (this script starts ``python -m hfspec serve ARGS`` on a free port and stops it after). For each
server and each client count (``--clients 1,4,16``), that many clients send streamed greedy chat requests back to
back on loopback until ``--requests`` have finished; one warm-up request per server goes first (hfspec measures
its costs on its first request). Reported per server and client count: total completion tokens per second over
the wall time, and p50/p90/p99 of the time to first token and of the time per output token after the first, in
one JSON object (stdout or ``--json``) and a table on stderr.

    python scripts/serve_bench.py --server hfspec=http://127.0.0.1:8000 --server llama=http://127.0.0.1:8080
    python scripts/serve_bench.py --start "default=--config smollm2-offline" \\
        --start "g0=--config smollm2-offline --gamma 0" --clients 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import httpx

PROMPTS = (
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of Python's itertools module.",
    "Write a Python function that reverses a linked list.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarise the plot of Hamlet in three sentences.",
    "Give a short definition of entropy in thermodynamics.",
    "Write a SQL query that counts orders per customer.",
)


@dataclass(frozen=True)
class Sample:
    ttft: float  # seconds to the first token
    seconds: float  # the whole request
    tokens: int  # completion tokens

    @property
    def per_token(self) -> float | None:
        return (self.seconds - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, pieces, usage = None, 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    pieces += 1
                    first = first if first is not None else time.perf_counter() - start
    seconds = time.perf_counter() - start
    tokens = usage["completion_tokens"] if usage else pieces
    return Sample(first if first is not None else seconds, seconds, tokens)


async def level(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``clients`` clients back to back until ``requests`` requests have finished."""
    samples: list[Sample] = []
    counter = iter(range(requests))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for k in counter:
            samples.append(await one(client, url, model, PROMPTS[k % len(PROMPTS)], max_tokens))

    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - start
    tokens = sum(s.tokens for s in samples)
    return {
        "clients": clients,
        "requests": len(samples),
        "completion_tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall if wall else None,
        "ttft_seconds": percentiles([s.ttft for s in samples]),
        "per_token_seconds": percentiles([t for s in samples if (t := s.per_token) is not None]),
        "samples": [asdict(s) for s in samples],
    }


async def model_of(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(url + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: str, wait: float) -> tuple[subprocess.Popen, str]:
    """``python -m hfspec serve ARGS`` on a free port; returns once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "hfspec", "serve", *shlex.split(args), "--port", str(port)]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"'{' '.join(command)}' exited with status {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise RuntimeError(f"'{' '.join(command)}' did not answer /health within {wait:.0f} s")


def labelled(text: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        raise argparse.ArgumentTypeError(f"expected LABEL=VALUE, got {text!r}")
    return label, value


def counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated client counts >= 1, got {text!r}")
    return values


def machine() -> dict:
    name = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "python": platform.python_version()}


def table(results: dict) -> str:
    lines = [
        f"{'server':<14}{'clients':>8}{'tok/s':>9}{'ttft p50':>10}{'p90':>8}{'p99':>8}{'tpot p50':>10}{'p90':>8}{'p99':>8}"
    ]
    for label, levels in results["servers"].items():
        for lv in levels:
            t, p = lv["ttft_seconds"], lv["per_token_seconds"]
            ms = [x * 1000 if x is not None else float("nan") for x in (*t.values(), *p.values())]
            lines.append(
                f"{label:<14}{lv['clients']:>8}{lv['tokens_per_second']:>9.1f}"
                + "".join(f"{v:>{10 if i in (0, 3) else 8}.1f}" for i, v in enumerate(ms))
            )
    return "\n".join(lines) + "\n(latencies in ms)"


async def bench(servers: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    results: dict = {"machine": machine(), "settings": vars(args).copy(), "servers": {}}
    for label, url in servers:
        model = await model_of(url)
        async with httpx.AsyncClient(timeout=600) as client:  # warm-up: hfspec measures its costs at first
            await one(client, url, model, PROMPTS[0], args.max_tokens)
        results["servers"][label] = [
            {"url": url, "model": model, **await level(url, model, n, max(n, args.requests), args.max_tokens)}
            for n in args.clients
        ]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", type=labelled, action="append", default=[], metavar="LABEL=URL")
    parser.add_argument("--start", type=labelled, action="append", default=[], metavar="LABEL=ARGS")
    parser.add_argument("--clients", type=counts, default=[1, 4, 16], help="client counts (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=16, help="requests per client count (at least the clients)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds a started server may take to load")
    parser.add_argument("--json", metavar="PATH", help="write the JSON here instead of stdout")
    parser.add_argument("--samples", action="store_true", help="keep every request's timings in the JSON")
    args = parser.parse_args(argv)
    if not args.server and not args.start:
        parser.error("give at least one --server LABEL=URL or --start LABEL=ARGS")
    started: list[subprocess.Popen] = []
    try:
        servers = list(args.server)
        for label, serve_args in args.start:
            process, url = start_server(serve_args, args.start_timeout)
            started.append(process)
            servers.append((label, url))
        args.server, args.start = [list(s) for s in args.server], [list(s) for s in args.start]
        results = asyncio.run(bench(servers, args))
    finally:
        for process in started:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    if not args.samples:
        for levels in results["servers"].values():
            for lv in levels:
                del lv["samples"]
    text = json.dumps(results, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    sys.stderr.write(table(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
