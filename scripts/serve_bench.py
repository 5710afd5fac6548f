#!/usr/bin/env python3
"""Concurrent clients against OpenAI-compatible servers: throughput, time to first token, per-token latency.

Each server is ``LABEL=URL`` (a running server: hfspec serve, llama-server, vLLM) or, with ``--start``,
``LABEL=ARGS`` (this script starts ``python -m hfspec serve ARGS`` on a free port and stops it after). For each
server and each client count (``--clients 1,4,16``), that many clients send streamed greedy chat requests back to
back on loopback until ``--requests`` have finished; one warm-up request per server goes first (a server is
started only once the one before answers /health, which hfspec serve does once it has measured its costs).
Reported per server and client count: total completion tokens per second over the wall time, and p50/p90/p99 of
the time to first token and of the time per output token after the first, in one JSON object (stdout or
``--json``) and a table on stderr.

With ``--llama-server PATH`` (a llama-server binary, e.g. from scripts/build_llama_cpp.py) it also starts
llama-server on ``--gguf-target`` alone (``llama``) and with ``--gguf-draft`` (``llama-spec``: ``-md DRAFT
--spec-type draft-simple``), each on a free loopback port with ``--llama-threads`` threads and as many slots as
the largest client count, and measures them with the same clients and prompts. The servers take turns client
count by client count, so that a busy machine disturbs them alike.

    python scripts/serve_bench.py --server hfspec=http://127.0.0.1:8000 --server llama=http://127.0.0.1:8080
    python scripts/serve_bench.py --start "default=--config smollm2-offline" \\
        --start "g0=--config smollm2-offline --gamma 0" --clients 1,4,16
    python scripts/serve_bench.py --llama-server ~/.cache/hfspec/llama.cpp/0.3.36/build/bin/llama-server \\
        --start "default=--target T.gguf --draft D.gguf -t 2" --start "g0=--target T.gguf --draft D.gguf -t 2 --gamma 0"
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
from pathlib import Path

import httpx

from hfspec.bench import llama_cpp

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

    # A fresh connection per request: a server closing an idle keep-alive connection just as the next request
    # goes out on it ("Server disconnected without sending a response") is a race of the client, not the server.
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=0)
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
    """``python -m hfspec serve ARGS`` on a free port; returns once /health answers 200, which hfspec serve does once
    its engine has measured its costs: the next server's loading cannot slow those timings."""
    port = free_port()
    return started([sys.executable, "-m", "hfspec", "serve", *shlex.split(args), "--port", str(port)], port, wait)


def start_llama_server(args: argparse.Namespace, draft: bool) -> tuple[subprocess.Popen, str]:
    """llama-server on the GGUF target (with the draft model if ``draft``) on a free port."""
    port = free_port()
    command = llama_cpp.server_command(
        args.llama_server,
        args.gguf_target,
        port=port,
        threads=args.llama_threads,
        slots=max(args.clients),
        slot_context=args.max_tokens + 1024,
        draft=args.gguf_draft if draft else None,
    )
    return started(command, port, args.start_timeout, quiet=True)


def started(command: list[str], port: int, wait: float, quiet: bool = False) -> tuple[subprocess.Popen, str]:
    """Runs ``command`` (a server that listens on ``port``); returns once /health answers."""
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.DEVNULL if quiet else None
    )
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


def llama_target() -> Path:
    cache = Path(os.environ.get("HFSPEC_CACHE", "~/.cache/hfspec")).expanduser()
    return cache / "qwen2.5-coder-1.5b-instruct/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"


def llama_draft() -> Path:
    cache = Path(os.environ.get("HFSPEC_CACHE", "~/.cache/hfspec")).expanduser()
    return cache / "qwen2.5-coder-0.5b-instruct/Qwen2.5-Coder-0.5B-Instruct.gguf"


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
    settings = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in vars(args).items()}
    results: dict = {"machine": machine(), "settings": settings, "servers": {label: [] for label, _ in servers}}
    models = {}
    for label, url in servers:
        models[label] = await model_of(url)
        async with httpx.AsyncClient(timeout=600) as client:  # warm-up: a first request is slower
            await one(client, url, models[label], PROMPTS[0], args.max_tokens)
    for n in args.clients:  # the servers in turns, client count by client count
        for label, url in servers:
            lv = await level(url, models[label], n, max(n, args.requests), args.max_tokens)
            results["servers"][label].append({"url": url, "model": models[label], **lv})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", type=labelled, action="append", default=[], metavar="LABEL=URL")
    parser.add_argument("--start", type=labelled, action="append", default=[], metavar="LABEL=ARGS")
    parser.add_argument("--clients", type=counts, default=[1, 4, 16], help="client counts (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=16, help="requests per client count (at least the clients)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds a started server may take to load")
    parser.add_argument(
        "--llama-server", type=Path, metavar="PATH", help="also start this llama-server, plain and with the draft"
    )
    parser.add_argument("--gguf-target", type=Path, default=llama_target(), help="llama-server's target GGUF")
    parser.add_argument("--gguf-draft", type=Path, default=llama_draft(), help="llama-server's draft GGUF")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server's -t (default 2)")
    parser.add_argument("--json", metavar="PATH", help="write the JSON here instead of stdout")
    parser.add_argument("--samples", action="store_true", help="keep every request's timings in the JSON")
    args = parser.parse_args(argv)
    if not args.server and not args.start and not args.llama_server:
        parser.error("give at least one --server LABEL=URL, --start LABEL=ARGS or --llama-server PATH")
    processes: list[subprocess.Popen] = []
    try:
        servers = list(args.server)
        for label, serve_args in args.start:
            process, url = start_server(serve_args, args.start_timeout)
            processes.append(process)
            servers.append((label, url))
        if args.llama_server:
            for label, draft in (("llama", False), ("llama-spec", True)):
                process, url = start_llama_server(args, draft)
                processes.append(process)
                servers.append((label, url))
        args.server, args.start = [list(s) for s in args.server], [list(s) for s in args.start]
        results = asyncio.run(bench(servers, args))
    finally:
        for process in processes:  # all told first, so that they stop together
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
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
