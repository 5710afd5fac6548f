"""``hfspec serve``: load a pair and serve it over HTTP with OpenAI's API, until SIGINT or SIGTERM.

This module imports neither FastAPI nor uvicorn at the top, so that the command line works (and says what to
install) where the ``serve`` extra is missing.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from hfspec import api
from hfspec.commands.common import add_model_flags, load_kwargs, number
from hfspec.errors import HfspecError
from hfspec.generator import SpeculativeGenerator
from hfspec.models.presets import Preset
from hfspec.serve.engine import BatchEngine
from hfspec.serve.events import Engine
from hfspec.serve.sequential import SequentialEngine

log = logging.getLogger(__name__)

EXTRA = "hfspec serve needs its extra: pip install 'hfspec[serve]'"
_port = number(int, lambda v: 0 <= v < 65536, "a port number in [0, 65535]")
_positive = number(int, lambda v: v >= 1, ">= 1")
_gamma_number = number(int, lambda v: v >= 0, ">= 0 (0: plain decoding) or 'auto'")


def _gamma(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _gamma_number(text)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="serve a pair over HTTP with OpenAI's API (chat, completions, streaming, metrics, a page)",
        description="Serve the target, with speculative decoding, at http://HOST:PORT/v1 as OpenAI's API: "
        "/v1/chat/completions, /v1/completions (with suffix: fill-in-the-middle), /v1/models, and /health, "
        "/metrics (Prometheus) and a page at /. Every answer is the target's own: greedy text equals "
        "'hfspec generate'. Needs the serve extra: pip install 'hfspec[serve]'.",
    )
    add_model_flags(p)
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=_port, default=8000, help="port to bind (default 8000; 0: any free port)")
    net.add_argument(
        "--api-key",
        default=os.environ.get("HFSPEC_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every /v1 route (default: $HFSPEC_API_KEY, else none)",
    )
    net.add_argument("--model-name", metavar="NAME", help="the model's name in /v1/models (default: the target's)")
    net.add_argument("--max-batch", type=_positive, default=8, metavar="N", help="requests decoded at once (default 8)")
    net.add_argument(
        "--max-queue",
        type=_positive,
        default=64,
        metavar="N",
        help="requests waiting behind the batch; past that, 503 with Retry-After (default 64)",
    )
    net.add_argument(
        "--gamma",
        type=_gamma,
        default="auto",
        metavar="N|auto",
        help="γ, drafts per step, for every request: 'auto' (default) or a number, 0 for plain decoding",
    )
    net.add_argument(
        "--sequential",
        action="store_true",
        help="serve one request at a time through the speculative loop instead of batching them",
    )
    p.set_defaults(func=run)
    return p


def default_model_name(preset: Preset, gen: SpeculativeGenerator) -> str:
    """A hub name as it is (``Qwen/Qwen2.5-7B``); a directory by its last part."""
    name = str(getattr(gen.target.config, "_name_or_path", "") or preset.target)
    return name if "/" in name and not Path(name).exists() else Path(name).name or name


def make_engine(gen: SpeculativeGenerator, name: str, args: argparse.Namespace) -> Engine:
    """The batching engine where it is there and takes the pair; else one request at a time."""
    if not args.sequential:
        try:
            return BatchEngine(gen, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue)
        except HfspecError as exc:
            log.warning("serving one request at a time: %s", exc)
    return SequentialEngine(gen, model_name=name, max_queue=args.max_queue)


def run(args: argparse.Namespace) -> int:
    try:  # imported here: the extra may be absent, and the other commands must not need it
        from hfspec.serve.app import create_app
        from hfspec.serve.server import SHUTDOWN_SECONDS, Server
    except ModuleNotFoundError:
        raise HfspecError(EXTRA) from None
    preset = api.resolve_preset(args.target, args.draft, args.config, args.ngram)
    gen = api.load(preset, threads=args.threads, **load_kwargs(args))
    gen.threads = args.threads  # every step of the engine runs on them (None: torch's count)
    engine = make_engine(gen, args.model_name or default_model_name(preset, gen), args)
    app = create_app(engine, gen.tokenizer, api_key=args.api_key, gamma=args.gamma)
    server = Server(app, engine, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    sys.stderr.write(
        f"hfspec: serving {engine.model_name} ({type(engine).__name__}) at http://{args.host}:{args.port}/v1; "
        f"the page at http://{args.host}:{args.port}/\n"
    )
    if not isinstance(engine, BatchEngine):
        server.run()
        return 0
    # The engine's loop on the main thread (BatchEngine.run says why), uvicorn on a thread beside it; the signals
    # reach the main thread, and uvicorn's own handler stops the engine, which ends the loop.
    engine.run_here = True
    http = threading.Thread(target=server.run, name="hfspec-http", daemon=True)
    handlers = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        engine.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    http.join(SHUTDOWN_SECONDS + 5)
    return 0
